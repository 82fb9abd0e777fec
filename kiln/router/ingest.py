"""KV-event ingest: one subscriber per worker feeding its worker set's prefix index.

Each worker gets a daemon thread with a ZMQ SUB socket connected to its ``zmq_endpoint`` (polled,
so that ``stop()`` returns within ``POLL_MS``). Messages are ``(topic, seq, payload)``; the thread
keeps the last applied seq and:

* first message (or first after the worker restarted): with a replay endpoint, replays from seq 0
  first (catch-up), so that blocks the worker cached before the router connected are known; what
  the worker's replay buffer no longer holds is simply missing (the index only under-reports).
  Without one, the seq is taken as the start.
* a gap (seq > last + 1): replays from last + 1 on the worker's ROUTER replay socket within
  ``replay_timeout_ms``, applying replayed batches in order and skipping those already applied.
  If it cannot (no replay endpoint, a timeout, the buffer no longer reaches back), the worker's
  blocks are cleared, since removals may have been missed, and rebuilt from live events.
* a seq at or below one already received: the worker restarted (its seq starts over, its cache
  is empty), so its blocks are cleared.

A BlockStored whose block_size differs from the worker set's ``kv_block_size`` evicts the worker:
its blocks go, its events are ignored from then on, and ``is_evicted`` tells the picker.

Nothing a worker sends can stop the thread: a bad message or event is counted and skipped.
``start()`` and ``stop()`` are synchronous and quick; from asyncio, ``await asyncio.to_thread(ingest.stop)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kiln.kv_wire import MEDIUM_GPU
from kiln.router.config import RouterConfig, Worker, WorkerSet
from kiln.router.kv_index import KVIndex
from kiln.router.kv_wire import Batch, Cleared, Malformed, Removed, Stored, Unknown, decode_payload

log = logging.getLogger("kiln.router.ingest")

END_SEQ = -1
CONNECTION_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclasses.dataclass
class WorkerStats:
    """What ingest saw of one worker. Read a copy: ``KVIngest.stats(worker)``."""

    worker_id_num: int
    worker_id_str: str
    batches: int = 0  # batches applied
    events: int = 0  # events applied to the index
    malformed: int = 0  # unreadable messages, batches and events (skipped)
    ignored: int = 0  # well-formed events not indexed: unknown types, tiers other than GPU
    orphans: int = 0  # BlockStored events whose parent block the router did not know (skipped)
    gaps: int = 0  # seqs missed on the live stream
    replays_ok: int = 0  # replays that filled a gap (or caught up on the first message)
    replays_failed: int = 0  # replays that timed out or fell short, or gaps with no replay endpoint
    restarts: int = 0  # times the worker's seq started over
    last_seq: int | None = None  # last seq applied
    last_event_at: float | None = None  # time.time() of the last message received
    connected: bool = False  # the SUB socket holds a connection to the worker's KV-event endpoint
    replay_connected: bool = False  # a probe socket holds one to its replay endpoint (where one is set)
    evicted: str | None = None  # why the worker's events are ignored, once they are


class _Feed:
    """One worker's stream: seq tracking, replay and applying batches. Runs on its own thread."""

    POLL_MS = 100

    def __init__(
        self, worker: Worker, index: KVIndex, block_size: int, replay_timeout_ms: int, ctx: zmq.Context
    ) -> None:
        self.worker = worker
        self.wid = worker.worker_id_num
        self.index = index
        self.block_size = block_size
        self.replay_timeout_ms = replay_timeout_ms
        self.ctx = ctx
        self.stats = WorkerStats(worker.worker_id_num, worker.worker_id_str)
        self.stopping = threading.Event()
        self.last_live: int | None = None  # last seq received on the live stream
        self.last_applied: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"kv-ingest-{worker.worker_id_str}", daemon=True)

    # ---- thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        # connection state for readiness: ZMQ connects in the background, so its monitor events say
        # when the worker's endpoints are reachable (a DEALER probe stands for the replay endpoint,
        # which is otherwise only connected to during a replay)
        probe = self.ctx.socket(zmq.DEALER) if self.worker.replay_endpoint else None
        watched = {"connected": sub.get_monitor_socket(CONNECTION_EVENTS)}
        if probe is not None:
            watched["replay_connected"] = probe.get_monitor_socket(CONNECTION_EVENTS)
        poller = zmq.Poller()
        for socket in (sub, *watched.values()):
            poller.register(socket, zmq.POLLIN)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 100_000)  # room for live batches while a replay runs
            sub.connect(self.worker.zmq_endpoint)
            if probe is not None:
                probe.connect(self.worker.replay_endpoint)
            while not self.stopping.is_set() and self.stats.evicted is None:
                ready = dict(poller.poll(self.POLL_MS))
                for field, monitor in watched.items():
                    while monitor in ready and monitor.poll(0):
                        event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                        setattr(self.stats, field, event == zmq.EVENT_CONNECTED)
                if sub in ready:
                    self.on_message(sub.recv_multipart(zmq.NOBLOCK))
        except Exception:  # a bad endpoint, or a bug: logged; the worker's blocks stay as they were
            log.exception("KV event subscriber of worker %s stopped", self.worker.worker_id_str)
        finally:
            self.stats.connected = self.stats.replay_connected = False
            for owner in (sub, probe):
                if owner is not None:
                    # fails with ETERM once the context is terminating; the sockets must close all the
                    # same, or the context's term() waits for them forever
                    with contextlib.suppress(zmq.ZMQError):
                        owner.disable_monitor()
            for socket in (*watched.values(), sub, probe):
                if socket is not None:
                    socket.close(linger=0)

    # ---- messages ------------------------------------------------------------------------------

    def on_message(self, frames: list[bytes]) -> None:
        stats = self.stats
        stats.last_event_at = time.time()
        if stats.evicted is not None:
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            stats.malformed += 1
            log.debug("worker %s: message of %d frame(s) skipped", self.worker.worker_id_str, len(frames))
            return
        seq, payload = int.from_bytes(frames[1], "big", signed=True), frames[2]
        if self.last_live is not None and seq <= self.last_live:
            stats.restarts += 1
            log.info(
                "worker %s: seq went back from %d to %d (restart); clearing its blocks", self._name, self.last_live, seq
            )
            self.index.clear(self.wid)
            self.last_applied = None
        self.last_live = seq

        if self.last_applied is None:
            if seq > 0 and self.worker.replay_endpoint:
                self._replay(0, seq, catch_up=True)
        elif seq <= self.last_applied:
            return  # already applied from a replay
        elif seq > self.last_applied + 1:
            stats.gaps += 1
            start = self.last_applied + 1
            if not self._replay(start, seq, catch_up=False):
                log.warning(
                    "worker %s: batches %d..%d missed and not replayed; clearing its blocks", self._name, start, seq - 1
                )
                self.index.clear(self.wid)
        if self.last_applied is None or seq > self.last_applied:
            self.apply(seq, payload)

    @property
    def _name(self) -> str:
        return self.worker.worker_id_str

    def _replay(self, start: int, live: int, catch_up: bool) -> bool:
        """Fetch and apply the batches from ``start`` on, which must reach the live seq without a
        hole. A gap repair must also begin at ``start``; a catch-up may begin later (the batches
        the worker no longer buffers only hold blocks the index will not know)."""
        stats = self.stats
        if not self.worker.replay_endpoint:
            stats.replays_failed += 1
            return False
        got = fetch_replay(self.ctx, self.worker.replay_endpoint, start, self.replay_timeout_ms, self.stopping)
        if isinstance(got, str):
            problem = got
        else:
            got = [(s, p) for s, p in got if s >= start]
            seqs = [s for s, _ in got]
            first = seqs[0] if catch_up and seqs else start
            holes = seqs != list(range(first, first + len(seqs))) or first + len(seqs) < live
            problem = f"got seqs {_span(seqs)} for {start}..{live - 1}" if holes else None
        if problem is not None:
            stats.replays_failed += 1
            log.warning("worker %s: replay from seq %d failed: %s", self._name, start, problem)
            return False
        for s, payload in got:
            if self.last_applied is None or s > self.last_applied:
                self.apply(s, payload)
        stats.replays_ok += 1
        return True

    def apply(self, seq: int, payload: bytes) -> None:
        stats = self.stats
        if stats.evicted is not None:  # (evicted by an earlier batch of the same replay)
            return
        self.last_applied = stats.last_seq = seq
        batch = decode_payload(payload)
        if isinstance(batch, Malformed):
            stats.malformed += 1
            log.debug("worker %s: batch %d skipped: %s", self._name, seq, batch.reason)
            return
        self._apply_events(batch)
        stats.batches += 1

    def _apply_events(self, batch: Batch) -> None:
        stats, index, wid = self.stats, self.index, self.wid
        for event in batch.events:
            match event:
                case Stored():
                    if not _on_gpu(event.medium):  # (an offload tier may use other block sizes)
                        stats.ignored += 1
                        continue
                    if event.block_size != self.block_size:
                        bs = event.block_size
                        self.evict(f"its KV events have block_size {bs}, the worker set's is {self.block_size}")
                        return
                    if index.store(wid, event.block_hashes, event.parent_block_hash, event.token_ids, _lora(event)):
                        stats.events += 1
                    else:
                        stats.orphans += 1
                case Removed():
                    if not _on_gpu(event.medium):
                        stats.ignored += 1
                        continue
                    index.remove(wid, event.block_hashes)
                    stats.events += 1
                case Cleared():
                    index.clear(wid)
                    stats.events += 1
                case Unknown():
                    stats.ignored += 1
                case Malformed():
                    stats.malformed += 1
                    log.debug("worker %s: event skipped: %s", self._name, event.reason)

    def evict(self, reason: str) -> None:
        self.stats.evicted = reason
        self.index.remove_worker(self.wid)
        log.warning("worker %s evicted from KV-aware routing: %s", self._name, reason)


def _on_gpu(medium: str | None) -> bool:
    return medium is None or medium.upper() == MEDIUM_GPU


def _lora(event: Stored) -> object:
    """The adapter part of the index key: its name; an id alone never matches a prompt's name."""
    if event.lora_name is None and event.lora_id is not None:
        return ("lora_id", event.lora_id)
    return event.lora_name


def _span(seqs: list[int]) -> str:
    return f"{seqs[0]}..{seqs[-1]}" if seqs else "none"


def fetch_replay(
    ctx: zmq.Context, endpoint: str, start: int, timeout_ms: int, stopping: threading.Event | None = None
) -> list[tuple[int, bytes]] | str:
    """Ask a worker's replay socket for its buffered batches from seq ``start`` on.

    Returns ``[(seq, payload)]`` in the order sent, or a reason string when it failed (timeout,
    a bad reply, ``stopping`` set). Sent REQ-style (an empty delimiter frame first), as vLLM wants.
    """
    deadline = time.monotonic() + timeout_ms / 1000
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        got: list[tuple[int, bytes]] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no end of replay within {timeout_ms} ms ({len(got)} batch(es) received)"
            if stopping is not None and stopping.is_set():
                return "stopping"
            if not sock.poll(min(left * 1000, _Feed.POLL_MS)):
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) == 3 and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                return f"bad reply of {len(frames)} frame(s)"
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == END_SEQ:
                return got
            got.append((seq, frames[1]))
    finally:
        sock.close(linger=0)


class KVIngest:
    """KV-event ingest for one worker set: a subscriber per worker, all feeding ``self.index``."""

    def __init__(
        self,
        workerset: WorkerSet,
        *,
        replay_timeout_ms: int = 60_000,
        index: KVIndex | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.name = workerset.name
        self.block_size = workerset.kv_block_size
        self.replay_timeout_ms = replay_timeout_ms
        self.index = index if index is not None else KVIndex(self.block_size)
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._feeds: dict[int, _Feed] = {}
        self._retired: list[_Feed] = []  # removed feeds, until their thread has ended (stop waits for them)
        self._lock = threading.Lock()
        self._started = self._stopped = False
        for worker in workerset.workers:
            self.add_worker(worker)

    def start(self) -> None:
        with self._lock:
            self._started = True
            for feed in self._feeds.values():
                if feed.thread.ident is None:
                    feed.thread.start()

    def stop(self) -> None:
        """Stop every subscriber (within about POLL_MS). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            feeds = [*self._feeds.values(), *self._retired]
        for feed in feeds:
            feed.stopping.set()
        alive = 0
        for feed in feeds:
            if feed.thread.ident is not None:
                feed.thread.join(5)
                alive += feed.thread.is_alive()
        if alive:  # then the context cannot be terminated (it would wait for their sockets)
            log.warning("%d KV event subscriber(s) still running", alive)
        elif self._own_ctx:
            self._ctx.term()

    def add_worker(self, worker: Worker) -> None:
        """Subscribe to ``worker`` (started now if ingest runs). A known worker id is replaced."""
        if not worker.zmq_endpoint:
            raise ValueError(f"worker {worker.worker_id_str} has no zmq_endpoint")
        self.remove_worker(worker.worker_id_num)
        feed = _Feed(worker, self.index, self.block_size, self.replay_timeout_ms, self._ctx)
        with self._lock:
            if self._stopped:
                raise RuntimeError("ingest is stopped")
            self._feeds[worker.worker_id_num] = feed
            self.index.add_worker(worker.worker_id_num)
            if self._started:
                feed.thread.start()

    def remove_worker(self, worker_id_num: int) -> None:
        """Stop following a worker and forget its blocks and stats."""
        with self._lock:
            feed = self._feeds.pop(worker_id_num, None)
            started = feed is not None and feed.thread.ident is not None
            if started:
                self._retired.append(feed)  # a stop() from now on waits for its thread too
        if feed is None:
            return
        feed.stopping.set()
        if started:
            feed.thread.join(5)
            with self._lock:
                self._retired = [f for f in self._retired if f.thread.is_alive()]
        self.index.remove_worker(worker_id_num)

    def is_evicted(self, worker_id_num: int) -> bool:
        feed = self._feeds.get(worker_id_num)
        return feed is not None and feed.stats.evicted is not None

    def stats(self, worker_id_num: int) -> WorkerStats:
        """A copy of one worker's counters; KeyError for a worker not followed."""
        return dataclasses.replace(self._feeds[worker_id_num].stats)

    def status(self) -> dict[int, WorkerStats]:
        return {wid: dataclasses.replace(feed.stats) for wid, feed in list(self._feeds.items())}

    def last_event_at(self, worker_id_num: int) -> float | None:
        return self._feeds[worker_id_num].stats.last_event_at


def ingest_for(config: RouterConfig) -> dict[str, KVIngest]:
    """One (unstarted) ingest per worker set; none in mock mode, which ingests no KV events."""
    if config.mock_mode:
        return {}
    return {ws.name: KVIngest(ws, replay_timeout_ms=config.replay_timeout_ms) for ws in config.workerset}
