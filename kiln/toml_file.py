"""Reading a TOML configuration file, its failures told apart and worded once: shared by Kiln's settings
(kiln/config.py) and the router's configuration (kiln/router/config.py), which raise them as their own
error classes. Standard library only, so that the router stays light."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal


class TomlFileError(Exception):
    """A TOML file that cannot be loaded. `problem` is `missing` (no such file), `unreadable` (`detail`
    is the OS's reason) or `invalid` (not TOML, or not UTF-8; `detail` is the parser's message)."""

    def __init__(self, problem: Literal["missing", "unreadable", "invalid"], where: str, detail: str = "") -> None:
        super().__init__(
            {
                "missing": f"{where} does not exist",
                "unreadable": f"{where}: cannot read it: {detail}",
                "invalid": f"{where}: not valid TOML: {detail}",
            }[problem]
        )
        self.problem = problem
        self.detail = detail


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """The parsed file; raises TomlFileError, whose message names the file as `{what} {path}`."""
    where = f"{what} {path}"
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise TomlFileError("missing", where) from None
    except OSError as e:
        raise TomlFileError("unreadable", where, str(e.strerror or e)) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TomlFileError("invalid", where, str(e)) from None
