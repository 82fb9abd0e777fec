"""A SQLite database in WAL mode, shared by threads: one connection, used under a lock."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path


class SqliteStore:
    def __init__(self, path: Path, schema: str):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # with WAL: a process crash loses no commit
        self._db.executescript(schema)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()
