"""Reading a TOML configuration file, its failures told apart: shared by Kiln's settings (kiln/config.py)
and the router's configuration (kiln/router/config.py), which word them each their own way. Standard
library only, so that the router stays light."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal


class TomlFileError(Exception):
    """A TOML file that cannot be loaded. `problem` is `missing` (no such file), `unreadable` (`detail`
    is the OS's reason) or `invalid` (not TOML, or not UTF-8; `detail` is the parser's message)."""

    def __init__(self, problem: Literal["missing", "unreadable", "invalid"], detail: str = "") -> None:
        super().__init__(f"{problem}: {detail}" if detail else problem)
        self.problem = problem
        self.detail = detail


def read_toml(path: Path) -> dict[str, Any]:
    """The parsed file; raises TomlFileError."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise TomlFileError("missing") from None
    except OSError as e:
        raise TomlFileError("unreadable", str(e.strerror or e)) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TomlFileError("invalid", str(e)) from None
