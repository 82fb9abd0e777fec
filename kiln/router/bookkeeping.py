"""What the router remembers about the requests it picked a worker for.

`InFlight`: requests sent to each worker that its scraped load does not count yet. A worker's
`running` and `waiting` come from a scrape; a request sent after that scrape began is not in them,
so the predictor adds it (`WorkerLoad.inflight`), with its prompt's block keys, so that a later
prompt sharing the prefix is credited with the blocks still being prefilled
(`WorkerLoad.inflight_blocks`). An entry ends when the first successful scrape that began after it
was sent completes (that scrape counts the request, or saw it finish), on Feedback, or after a TTL.
A request such a scrape counted is still remembered until its Feedback: once that comes, the
worker's scraped load counts a request that has ended, until a scrape that began after the end
completes (`InFlight.finished`), and the predictor takes it off (`WorkerLoad.running`).

`Observations`: per request id, the worker picked and the latency predicted, kept until Feedback
reports the observed latency or a TTL passes.

Neither is thread-safe: the router's event loop owns both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.router.kv_index import Key


@dataclass(slots=True)
class _Entry:
    request_id: str
    worker: int
    sent_at: float  # time.monotonic()
    keys: tuple[Key, ...]


@dataclass(slots=True)
class _Worker:
    entries: dict[str, _Entry] = field(default_factory=dict)  # by request id, oldest first
    keys: Counter[Key] = field(default_factory=Counter)  # block keys of those entries' prompts


class InFlight:
    """Requests sent to each worker, by worker_id_num, that its last scrape cannot have counted; and
    requests its last scrape counted that have ended since."""

    def __init__(self) -> None:
        self._workers: dict[int, _Worker] = {}
        self._where: dict[str, int] = {}  # request id -> worker
        self._counted: dict[str, tuple[int, float]] = {}  # settled, not ended: request id -> (worker, sent_at)
        self._ended: dict[int, list[float]] = {}  # per worker: when counted requests ended, oldest first

    def __len__(self) -> int:
        return len(self._where)

    def add(self, request_id: str, worker: int, keys: Sequence[Key], now: float) -> None:
        """A request was sent to `worker` at `now`; a request id held already is replaced."""
        if (held := self._where.get(request_id)) is not None:
            self._drop(self._workers[held].entries[request_id])
        self._counted.pop(request_id, None)
        w = self._workers.setdefault(worker, _Worker())
        w.entries[request_id] = _Entry(request_id, worker, now, tuple(keys))
        w.keys.update(keys)
        self._where[request_id] = worker

    def end(self, request_id: str, now: float) -> bool:
        """The request finished (or failed) at `now`; False if it was neither in flight nor counted."""
        worker = self._where.get(request_id)
        if worker is not None:
            self._drop(self._workers[worker].entries[request_id])
            return True
        counted = self._counted.pop(request_id, None)
        if counted is None:
            return False
        self._ended.setdefault(counted[0], []).append(now)
        return True

    def settle(self, worker: int, scrape_started_at: float | None) -> None:
        """Move `worker`'s entries sent before its last successful scrape began to the counted (that
        scrape counts them), and forget ends that scrape has seen."""
        if scrape_started_at is None:
            return
        ended = self._ended.get(worker)
        if ended:
            seen = sum(1 for t in ended if t < scrape_started_at)
            del ended[:seen]
            if not ended:
                del self._ended[worker]
        w = self._workers.get(worker)
        while w is not None and w.entries:
            oldest = next(iter(w.entries.values()))
            if oldest.sent_at >= scrape_started_at:
                break
            self._drop(oldest)
            self._counted[oldest.request_id] = (worker, oldest.sent_at)
            w = self._workers.get(worker)

    def finished(self, worker: int) -> int:
        """Requests `worker`'s last scrape counted that have ended since (it still counts them)."""
        return len(self._ended.get(worker, ()))

    def expire(self, sent_before: float) -> int:
        """Drop every entry sent before `sent_before` (feedback never came), and ends recorded before
        it; returns how many entries."""
        old = [e for w in self._workers.values() for e in w.entries.values() if e.sent_at < sent_before]
        for entry in old:
            self._drop(entry)
        for request_id in [r for r, (_, sent) in self._counted.items() if sent < sent_before]:
            del self._counted[request_id]
        for worker in list(self._ended):
            self._ended[worker] = [t for t in self._ended[worker] if t >= sent_before]
            if not self._ended[worker]:
                del self._ended[worker]
        return len(old)

    def drop_worker(self, worker: int) -> int:
        """Forget every entry of `worker` (it left); returns how many."""
        w = self._workers.get(worker)
        entries = list(w.entries.values()) if w is not None else []
        for entry in entries:
            self._drop(entry)
        for request_id in [r for r, (num, _) in self._counted.items() if num == worker]:
            del self._counted[request_id]
        self._ended.pop(worker, None)
        return len(entries)

    def count(self, worker: int) -> int:
        w = self._workers.get(worker)
        return len(w.entries) if w is not None else 0

    def leading_blocks(self, worker: int, keys: Sequence[Key], start: int) -> int:
        """How many of the prompt's blocks from `start` on a request in flight to `worker` shares.

        Keys are chained (each names its whole prefix), so a key some entry holds at position i means
        that entry shares the prompt's first i + 1 blocks: the walk needs no per-entry comparison.
        """
        w = self._workers.get(worker)
        if w is None or not w.keys:
            return 0
        n = start
        while n < len(keys) and keys[n] in w.keys:
            n += 1
        return n - start

    def _drop(self, entry: _Entry) -> None:
        w = self._workers[entry.worker]
        del w.entries[entry.request_id]
        del self._where[entry.request_id]
        w.keys.subtract(entry.keys)
        for key in entry.keys:
            if w.keys[key] <= 0:
                del w.keys[key]
        if not w.entries:
            del self._workers[entry.worker]


@dataclass(frozen=True, slots=True)
class Observation:
    """One pick, as Feedback will find it."""

    request_id: str
    worker_id_num: int
    worker_id_str: str
    workerset: str
    predicted_ms: float
    picked_at: float  # time.monotonic()
    tenant: str = ""
    # What calibration.Calibration fits against the observed TTFT: the prediction's uncalibrated queue
    # and prefill terms and the sum of the others; None for a pick not predicted term by term (mock mode).
    features: tuple[float, float, float, float] | None = None


class Observations:
    """Picks waiting for their Feedback, by request id, dropped after `ttl_s`."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._held: dict[str, Observation] = {}  # insertion order is pick order

    def __len__(self) -> int:
        return len(self._held)

    def add(self, observation: Observation) -> None:
        self._held.pop(observation.request_id, None)  # a reused id moves to the end
        self._held[observation.request_id] = observation

    def pop(self, request_id: str) -> Observation | None:
        return self._held.pop(request_id, None)

    def expire(self, now: float) -> list[Observation]:
        """Drop (and return) the observations older than the TTL."""
        gone = []
        while self._held:
            oldest = next(iter(self._held.values()))
            if now - oldest.picked_at < self.ttl_s:
                break
            gone.append(self._held.pop(oldest.request_id))
        return gone
