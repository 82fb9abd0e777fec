"""Stored responses of the Responses API: one SQLite database in WAL mode (`<data dir>/responses.db`,
beside the training store's and the evals' databases), so that `previous_response_id`, retrieve
and `input_items` survive a restart.

A row holds the response object, the input items its request gave (with their ids, for
`input_items`), and its context: every item of the conversation before its output, so that a
later request naming it as `previous_response_id` needs one lookup, not a walk along the chain.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.sqlite_store import SqliteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, body TEXT NOT NULL, input TEXT NOT NULL, context TEXT NOT NULL);
"""

DB_NAME = "responses.db"


class ResponseStore(SqliteStore):
    def __init__(self, root: str | Path):
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root / DB_NAME, _SCHEMA)

    def put(self, body: dict, input_items: list[dict], context: list[dict]) -> None:
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM responses").fetchone()[0]
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                             (body["id"], seq, json.dumps(body), json.dumps(input_items), json.dumps(context)))

    def get(self, response_id: str) -> dict | None:
        rows = self._query("SELECT body FROM responses WHERE id = ?", (response_id,))
        return json.loads(rows[0][0]) if rows else None

    def conversation(self, response_id: str) -> list[dict] | None:
        """The items a request continuing this response starts from: its context, then its output."""
        rows = self._query("SELECT body, context FROM responses WHERE id = ?", (response_id,))
        if not rows:
            return None
        return json.loads(rows[0][1]) + json.loads(rows[0][0])["output"]

    def input_items(self, response_id: str) -> list[dict] | None:
        rows = self._query("SELECT input FROM responses WHERE id = ?", (response_id,))
        return json.loads(rows[0][0]) if rows else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
