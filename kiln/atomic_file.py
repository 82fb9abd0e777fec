"""Writing a file whole or not at all, for the caches and stores several processes may share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` to a temporary file beside `path`, then renames it over `path`: a reader in
    another process sees the old file or the new one, never part of one. The directory must exist."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
