"""Publish KV-cache events in vLLM's ZMQ wire format (the format itself: kiln/kv_wire.py).

KV-aware routers written for vLLM (vLLM's own subscriber, llm-d, Dynamo) can consume Kiln's
block events unchanged:

* PUB socket, one multipart message per batch: ``(topic, seq, payload)``; ``seq`` is an 8-byte
  big-endian signed int counting batches from 0; ``payload`` is a msgpack :class:`KVEventBatch`,
  positional (``encoding="array"``, vLLM's layout) or as msgpack maps (``encoding="map"``).
* Optional ROUTER replay socket: a client sends an 8-byte big-endian start seq (vLLM expects a
  REQ-style empty delimiter frame before it; a bare DEALER frame is accepted too) and gets one
  ``(seq, payload)`` reply per buffered batch with ``seq >= start``, then ``(-1, b"")``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

# kiln/engine/core.py makes its events with these names from here.
from kiln.kv_wire import BlockRemoved as BlockRemoved
from kiln.kv_wire import BlockStored as BlockStored
from kiln.kv_wire import KVEvent, KVEventBatch, as_map_form

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("array", "map")


def offset_endpoint_port(endpoint: str | None, rank: int | None) -> str | None:
    """vLLM convention: DP rank r publishes on base port + r (inproc/ipc: ``_dp{r}`` suffix)."""
    if not endpoint or not rank:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}" if port.isdigit() else endpoint


def _should_bind(endpoint: str) -> bool:
    # vLLM's heuristic: wildcard hosts/ports and local transports bind, anything else connects.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Non-blocking publisher: ``publish`` only enqueues; a daemon thread owns the sockets.

    ``endpoint``/``replay_endpoint`` hold the actual bound addresses once constructed (useful
    with ``tcp://127.0.0.1:*``). ``dropped_batches`` counts batches lost to a full queue.
    ``encoding`` is ``"array"`` (vLLM's positional layout) or ``"map"`` (field names).
    """

    POLL_S = 0.02
    CLOSE_TIMEOUT_S = 2.0

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int | None = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        linger_ms: int = 500,
        encoding: str = "array",
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
        self.encoding = encoding
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self.data_parallel_rank = data_parallel_rank
        self.dropped_batches = 0
        self.published_batches = 0
        self._topic = topic.encode()
        self._hwm = hwm
        self._linger_ms = linger_ms
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error

    def publish(self, events: list[KVEvent]) -> None:
        """Queue ``events`` as one batch. Never blocks; drops (and counts) if full or closed.

        Events are encoded later on the publisher thread: don't mutate them afterwards.
        """
        if not events:
            return
        if self._closing.is_set():
            self.dropped_batches += 1
            return
        batch = KVEventBatch(time.time(), list(events), self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1
            if self.dropped_batches == 1 or self.dropped_batches % 1000 == 0:
                logger.warning("KV event queue full; %d batches dropped", self.dropped_batches)

    def drained(self) -> bool:
        """Every batch queued so far has been sent (and counted in published_batches) or failed."""
        with self._queue.all_tasks_done:
            return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets. Idempotent."""
        self._closing.set()
        self._thread.join(self.CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV event publisher still flushing after %.1fs", self.CLOSE_TIMEOUT_S)

    # -- background thread -------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            if _should_bind(self.endpoint):
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                # Room for one full replay per client; ROUTER drops (never blocks) beyond it.
                replay.setsockopt(zmq.SNDHWM, self._buffer.maxlen + 1)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as e:  # surfaced to the constructor
            self._startup_error = e
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()

        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    if self._closing.is_set():
                        break
                    continue
                try:
                    payload = encoder.encode(as_map_form(batch) if self.encoding == "map" else batch)
                    # PUB never blocks: past the HWM, zmq drops for that subscriber.
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big", signed=True), payload))
                    self._buffer.append((seq, payload))
                    seq += 1
                    self.published_batches += 1
                except Exception:  # the publisher thread must outlive one batch that fails to encode or send
                    logger.exception("failed to publish KV event batch")
                finally:
                    self._queue.task_done()
        finally:
            # Linger lets already-queued frames reach subscribers; it does not block close().
            pub.close(linger=self._linger_ms)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        # ROUTER prepends the client identity; REQ clients (as in vLLM) also add b"" delimiter.
        if len(frames) == 3 and frames[1] == b"":
            envelope = frames[:2]
        elif len(frames) == 2:
            envelope = frames[:1]
        else:
            logger.warning("invalid KV event replay request with %d frames", len(frames))
            return
        if len(frames[-1]) != 8:
            logger.warning("invalid KV event replay start seq %r", frames[-1])
            return
        start = int.from_bytes(frames[-1], "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart([*envelope, seq.to_bytes(8, "big", signed=True), payload])
        replay.send_multipart([*envelope, END_SEQ, b""])
