"""Durable evals: one SQLite database in WAL mode (`<data dir>/evals.db`, next to the training
store's `kiln.db`).

- `evals`: an eval's OpenAI object;
- `runs`: a run's OpenAI object (status, totals) and, apart from it, its spec: what it needs to
  run or resume (the items, samples, criteria, input messages, sampling, model), written once;
- `outcomes`: one row per finished item, keyed (run_id, item_index).

An item's outcome and its run's updated totals are committed in one transaction as soon as
the item is done, so a crash loses at most the items in flight, and never counts an item
twice or misses one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kiln.sqlite_store import SqliteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS evals (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at REAL NOT NULL,
    body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, eval_id TEXT NOT NULL, seq INTEGER NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL,
    spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outcomes (
    run_id TEXT NOT NULL, item_index INTEGER NOT NULL, id TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (run_id, item_index));
CREATE INDEX IF NOT EXISTS runs_by_eval ON runs (eval_id, seq);
CREATE UNIQUE INDEX IF NOT EXISTS outcomes_by_id ON outcomes (run_id, id);
"""

DB_NAME = "evals.db"


class EvalStore(SqliteStore):
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        super().__init__(self.root / DB_NAME, _SCHEMA)

    def _transaction(self, statements: list[tuple[str, tuple]]) -> list[int]:
        """Runs the statements as one transaction; returns their row counts."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                counts = [self._db.execute(sql, args).rowcount for sql, args in statements]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return counts

    @staticmethod
    def _page(rows: list[tuple], after: str | None, limit: int) -> tuple[list[dict], bool]:
        """rows of (id, body) in order -> the page after the row `after` (OpenAI's cursor)."""
        ids = [r[0] for r in rows]
        start = ids.index(after) + 1 if after in ids else 0 if after is None else len(ids)
        page = rows[start:start + limit]
        return [json.loads(body) for _, body in page], start + limit < len(rows)

    # ---- evals ---------------------------------------------------------------------------

    def put_eval(self, body: dict) -> None:
        """Creates or replaces an eval; its update time is now."""
        updated_at = time.time()
        with self._lock:
            seq = self._db.execute("SELECT seq FROM evals WHERE id = ?", (body["id"],)).fetchone()
            if seq is None:
                seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM evals").fetchone()
            self._db.execute("INSERT OR REPLACE INTO evals VALUES (?, ?, ?, ?, ?)",
                             (body["id"], seq[0], body["created_at"], updated_at, json.dumps(body)))

    def get_eval(self, eval_id: str) -> dict | None:
        rows = self._query("SELECT body FROM evals WHERE id = ?", (eval_id,))
        return json.loads(rows[0][0]) if rows else None

    def list_evals(self, after: str | None, limit: int, order: str = "asc",
                   order_by: str = "created_at") -> tuple[list[dict], bool]:
        column = "updated_at" if order_by == "updated_at" else "created_at"
        direction = "DESC" if order == "desc" else "ASC"
        rows = self._query(f"SELECT id, body FROM evals ORDER BY {column} {direction}, seq {direction}")
        return self._page(rows, after, limit)

    def delete_eval(self, eval_id: str) -> bool:
        return self._transaction([
            ("DELETE FROM outcomes WHERE run_id IN (SELECT id FROM runs WHERE eval_id = ?)", (eval_id,)),
            ("DELETE FROM runs WHERE eval_id = ?", (eval_id,)),
            ("DELETE FROM evals WHERE id = ?", (eval_id,)),
        ])[-1] > 0

    # ---- runs ----------------------------------------------------------------------------

    def add_run(self, body: dict, spec: dict) -> None:
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM runs").fetchone()[0]
            self._db.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)",
                             (body["id"], body["eval_id"], seq, body["status"], json.dumps(body), json.dumps(spec)))

    def set_status(self, run_id: str, status: str, from_statuses: tuple[str, ...], **fields) -> dict | None:
        """Sets the run's status (and other fields of its object) only if its stored status is one
        of `from_statuses`, so a cancel and the run's own end cannot overwrite each other; returns
        the updated object, or None if the run is not in one of those states (or is gone)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT status, body FROM runs WHERE id = ?", (run_id,)).fetchone()
                if row is None or row[0] not in from_statuses:
                    self._db.execute("ROLLBACK")
                    return None
                body = {**json.loads(row[1]), **fields, "status": status}
                self._db.execute("UPDATE runs SET status = ?, body = ? WHERE id = ?",
                                 (status, json.dumps(body), run_id))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return body

    def get_run(self, run_id: str) -> dict | None:
        rows = self._query("SELECT body FROM runs WHERE id = ?", (run_id,))
        return json.loads(rows[0][0]) if rows else None

    def run_spec(self, run_id: str) -> dict | None:
        rows = self._query("SELECT spec FROM runs WHERE id = ?", (run_id,))
        return json.loads(rows[0][0]) if rows else None

    def list_runs(self, eval_id: str, after: str | None, limit: int, order: str = "asc",
                  status: str | None = None) -> tuple[list[dict], bool]:
        direction = "DESC" if order == "desc" else "ASC"
        rows = self._query(f"SELECT id, body FROM runs WHERE eval_id = ? AND (? IS NULL OR status = ?) "
                           f"ORDER BY seq {direction}", (eval_id, status, status))
        return self._page(rows, after, limit)

    def runs_with_status(self, statuses: tuple[str, ...]) -> list[dict]:
        """Oldest first."""
        rows = self._query("SELECT status, body FROM runs ORDER BY seq")
        return [json.loads(body) for status, body in rows if status in statuses]

    def delete_run(self, run_id: str) -> bool:
        return self._transaction([("DELETE FROM outcomes WHERE run_id = ?", (run_id,)),
                                  ("DELETE FROM runs WHERE id = ?", (run_id,))])[-1] > 0

    # ---- outcomes ------------------------------------------------------------------------

    def add_outcome(self, run: dict, outcome: dict) -> bool:
        """Commits an item's outcome together with its run's updated object (its totals), if the
        run is still in progress (not canceled or deleted meanwhile); returns whether it did."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                updated = self._db.execute("UPDATE runs SET body = ? WHERE id = ? AND status = 'in_progress'",
                                           (json.dumps(run), run["id"])).rowcount
                if updated:
                    self._db.execute("INSERT INTO outcomes VALUES (?, ?, ?, ?, ?)",
                                     (run["id"], outcome["datasource_item_id"], outcome["id"], outcome["status"],
                                      json.dumps(outcome)))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return bool(updated)

    def done_indices(self, run_id: str) -> set[int]:
        return {r[0] for r in self._query("SELECT item_index FROM outcomes WHERE run_id = ?", (run_id,))}

    def outcomes(self, run_id: str, after: str | None = None, limit: int | None = None, order: str = "asc",
                 status: str | None = None) -> tuple[list[dict], bool]:
        """In item order (`desc`: reversed); `status` filters (pass, fail, errored)."""
        direction = "DESC" if order == "desc" else "ASC"
        rows = self._query(f"SELECT id, body FROM outcomes WHERE run_id = ? AND (? IS NULL OR status = ?) "
                           f"ORDER BY item_index {direction}", (run_id, status, status))
        return self._page(rows, after, len(rows) if limit is None else limit)

    def get_outcome(self, run_id: str, outcome_id: str) -> dict | None:
        rows = self._query("SELECT body FROM outcomes WHERE run_id = ? AND id = ?", (run_id, outcome_id))
        return json.loads(rows[0][0]) if rows else None
