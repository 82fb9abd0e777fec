"""Durable training state: uploaded files, fine-tuning jobs, their events and checkpoints.

One SQLite database in WAL mode (`<data dir>/kiln.db`) holds the records; file contents live
next to it (`<data dir>/files/<id>`), written to a temporary name and renamed before their row
is committed, so a crash never leaves a record without its content. A job is stored as its
whole JSON object plus the columns that queries need.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from kiln.atomic_file import write_atomic
from kiln.sqlite_store import SqliteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, sha256 TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, job_id TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, job_id TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE INDEX IF NOT EXISTS checkpoints_by_job ON checkpoints (job_id, seq);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class TrainingStore(SqliteStore):
    def __init__(self, root: str | Path):
        self.root = Path(root)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        super().__init__(self.root / "kiln.db", _SCHEMA)

    # ---- files ---------------------------------------------------------------------------

    def add_file(self, content: bytes, filename: str, purpose: str, sha256: str) -> dict:
        file_id = new_id("file")
        path = self.root / "files" / file_id
        write_atomic(path, content)
        self._query("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                    (file_id, now(), filename, purpose, len(content), sha256))
        return self.get_file(file_id)

    @staticmethod
    def _file(row: tuple) -> dict:
        file_id, created_at, filename, purpose, size, sha256 = row
        return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None, "expires_at": None,
                "sha256": sha256}

    def get_file(self, file_id: str) -> dict | None:
        rows = self._query("SELECT * FROM files WHERE id = ?", (file_id,))
        return self._file(rows[0]) if rows else None

    def list_files(self, purpose: str | None = None) -> list[dict]:
        rows = self._query("SELECT * FROM files WHERE ? IS NULL OR purpose = ? ORDER BY created_at DESC, rowid DESC",
                           (purpose, purpose))
        return [self._file(r) for r in rows]

    def file_content(self, file_id: str) -> bytes:
        return (self.root / "files" / file_id).read_bytes()

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        (self.root / "files" / file_id).unlink(missing_ok=True)
        return deleted

    # ---- jobs ----------------------------------------------------------------------------

    def put_job(self, job: dict) -> None:
        with self._lock:
            seq = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (job["id"],)).fetchone()
            if seq is None:
                seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()
            self._db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?)",
                             (job["id"], seq[0], job["status"], json.dumps(job)))

    def get_job(self, job_id: str) -> dict | None:
        rows = self._query("SELECT body FROM jobs WHERE id = ?", (job_id,))
        return json.loads(rows[0][0]) if rows else None

    def list_jobs(self, statuses: tuple[str, ...] | None = None) -> list[dict]:
        """Newest first."""
        rows = self._query("SELECT status, body FROM jobs ORDER BY seq DESC")
        return [json.loads(body) for status, body in rows if statuses is None or status in statuses]

    # ---- events and checkpoints ------------------------------------------------------------

    def add_event(self, job_id: str, message: str, level: str = "info", type_: str = "message",
                  data: dict | None = None) -> dict:
        event = {"id": new_id("ftevent"), "object": "fine_tuning.job.event", "created_at": now(), "level": level,
                 "message": message, "type": type_, "data": data}
        self._query("INSERT INTO events (id, job_id, body) VALUES (?, ?, ?)", (event["id"], job_id, json.dumps(event)))
        return event

    def add_checkpoint(self, job_id: str, checkpoint: dict) -> None:
        self._query("INSERT INTO checkpoints (id, job_id, body) VALUES (?, ?, ?)",
                    (checkpoint["id"], job_id, json.dumps(checkpoint)))

    def _page(self, table: str, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, starting after the item `after` (OpenAI's cursor pagination)."""
        start = None
        if after:
            row = self._query(f"SELECT seq FROM {table} WHERE id = ? AND job_id = ?", (after, job_id))
            start = row[0][0] if row else None
        rows = self._query(f"SELECT body FROM {table} WHERE job_id = ? AND (? IS NULL OR seq < ?) "
                           "ORDER BY seq DESC LIMIT ?", (job_id, start, start, limit + 1))
        return [json.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def events(self, job_id: str, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        return self._page("events", job_id, after, limit)

    def checkpoints(self, job_id: str, after: str | None = None, limit: int = 10) -> tuple[list[dict], bool]:
        return self._page("checkpoints", job_id, after, limit)
