"""A server over several processes: process 0 runs the engine, the others repeat its device work.

A mesh that spans hosts is one SPMD program: every process launches the same executables on the
same arguments in the same order, each on its own devices' shards, and XLA's collectives join
them. Process 0 plans, samples and serves HTTP. Its `StepMirror` sends each operation on the mesh,
as the engine makes it, to the other processes, whose `Follower` applies it to an engine of its
own: the executables to build, each step's bucket and host inputs (and which earlier step's token
feed it reads), adapter weights written into a slot or a slot cleared, a KV reset. Followers send
nothing back: a step's outputs are replicated, so process 0 reads them from its own devices.

The channel is TCP from each follower to process 0, at the coordinator's host and port + 1
(`[distributed] coordinator`); a frame is a length and a msgpack message, numpy arrays as
extension values. A follower whose process 0 went away exits; process 0 takes a follower that
went away for a lost device (requests get 503 until the set restarts).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import socket
import struct
import threading
import time

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

from kiln.distributed import connect_within
from kiln.engine.buckets import StepBucket
from kiln.engine.runner import SamplerKey
from kiln.errors import ConfigError, DeviceLost

log = logging.getLogger("kiln.engine")

_ARRAY = 1  # msgpack extension code of a numpy array: (dtype name, shape, bytes)
_LENGTH = struct.Struct("!Q")
FEEDS_KEPT = 4  # recent steps whose token feed a later step may read (the engine reads the previous one)


def _to_wire(obj):
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(_ARRAY, msgspec.msgpack.encode((a.dtype.name, a.shape, a.data)))
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"a step mirror cannot send {type(obj).__name__}")


def _from_wire(code: int, data: memoryview):
    if code != _ARRAY:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype, shape, raw = msgspec.msgpack.decode(data)
    return np.frombuffer(raw, jnp.dtype(dtype)).reshape(shape)


_encoder = msgspec.msgpack.Encoder(enc_hook=_to_wire)
_decoder = msgspec.msgpack.Decoder(ext_hook=_from_wire)


def _key(key: StepBucket | SamplerKey) -> list:
    if isinstance(key, StepBucket):
        return ["forward", key.kind, key.tokens, key.tiles, key.tile_size, key.rows, key.lora]
    return ["sampler", key.rows]


def _unkey(wire: list) -> StepBucket | SamplerKey:
    return StepBucket(*wire[1:]) if wire[0] == "forward" else SamplerKey(wire[1])


def _receive(conn: socket.socket) -> list:
    (length,) = _LENGTH.unpack(_read(conn, _LENGTH.size))
    return _decoder.decode(_read(conn, length))


def _read(conn: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the connection closed")
        got += k
    return buf


def _send(conn: socket.socket, message: list) -> None:
    frame = _encoder.encode(message)
    conn.sendall(_LENGTH.pack(len(frame)) + frame)


def mirror_address(coordinator: str) -> tuple[str, int]:
    """Where process 0 takes its followers: the coordinator's host, its port + 1."""
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port) + 1


def identity(runner) -> dict:
    """What must agree between process 0's engine and a follower's for one to repeat the other's steps."""
    return {"num_kv_blocks": runner.num_blocks, "max_model_len": runner.max_model_len,
            "executables": [_key(k) for k in runner.executable_set()]}


class StepMirror:
    """Process 0's side: sends each device operation of its engine to every follower, in order."""

    def __init__(self, followers: dict[int, socket.socket]):
        self._followers = followers
        self._lock = threading.Lock()  # one frame at a time (builds are sent from other threads)
        self._seq = 0
        self._feeds: collections.deque = collections.deque(maxlen=FEEDS_KEPT)  # (seq, the step's token feed)

    @classmethod
    def accept(cls, listener: socket.socket, followers: int, runner, timeout_s: float) -> StepMirror:
        """Waits up to `timeout_s` for every follower to connect and say which process it is; tells each
        the engine it must match."""
        conns: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        with listener:
            while len(conns) < followers:
                listener.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, followers + 1)) - set(conns))
                    raise ConfigError(f"process(es) {missing} of the server did not connect to process 0 within "
                                      f"{timeout_s:g} s (distributed.timeout_s)") from None
                conn.settimeout(10)  # for its greeting
                try:
                    op, index = _receive(conn)
                    if op != "follower" or index in conns or not 0 < index <= followers:
                        raise ValueError(f"{op} {index}")
                except (OSError, ValueError, TypeError, msgspec.DecodeError) as exc:
                    log.warning("process 0: ignored a connection to the step channel that is not a follower (%s)",
                                exc)
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[index] = conn
                _send(conn, ["engine", identity(runner)])
        log.info("process 0: %d follower process(es) repeat this engine's steps", followers)
        return cls(conns)

    def send(self, op: str, *args) -> None:
        frame = _encoder.encode([op, *args])
        with self._lock:
            for index, conn in self._followers.items():
                try:
                    conn.sendall(_LENGTH.pack(len(frame)) + frame)
                except OSError as exc:
                    raise DeviceLost(f"process {index} of the server's mesh is gone ({exc.strerror or exc}); "
                                     "restart the server's processes") from None

    def build(self, keys: list) -> None:
        """Executables the engine is building: followers build them too, beside their steps."""
        if keys:
            self.send("build", [_key(k) for k in keys])

    def prime(self, bucket: StepBucket) -> None:
        self.send("prime", _key(bucket))

    def forward(self, bucket: StepBucket, host: tuple, feed: jax.Array | None) -> int:
        """A forward step on `host` (inputs, last index, prompt targets, feed sources), reading `feed` (an
        earlier step's token feed, or None); returns the step's number, for `sample`."""
        source = None
        if feed is not None:
            source = next((seq for seq, f in self._feeds if f is feed), None)
            if source is None:
                raise RuntimeError("a step reads a token feed the step mirror did not see")
        self._seq += 1
        self.send("forward", self._seq, _key(bucket), source, jax.tree.leaves(host))
        return self._seq

    def sample(self, seq: int, sampling) -> None:
        """Step `seq`'s sampling arrays. Those on the device already are the sampler's idle extras
        (step_inputs.py), the same in every process: sent as None, a follower takes its own."""
        self.send("sample", seq, [None if isinstance(a, jax.Array) else a for a in jax.tree.leaves(sampling)])

    def sampled(self, seq: int, feed: jax.Array) -> None:
        """Step `seq`'s token feed (a later step may read it)."""
        self._feeds.append((seq, feed))

    def close(self) -> None:
        """Tells the followers to stop (they exit), once."""
        try:
            self.send("stop")
        except DeviceLost:
            pass
        for conn in self._followers.values():
            conn.close()
        self._followers = {}


def listen(coordinator: str) -> socket.socket:
    """Process 0's listening socket for its followers (bound before its engine is built, so that they
    can connect as soon as theirs is)."""
    return socket.create_server(("", mirror_address(coordinator)[1]))


def connect(coordinator: str, index: int, timeout_s: float) -> socket.socket:
    """A follower's connection to process 0, tried until `timeout_s` has passed."""
    host, port = mirror_address(coordinator)
    conn = connect_within(host, port, timeout_s, f"process 0's step channel at {host}:{port}")
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send(conn, ["follower", index])
    return conn


class Follower:
    """A follower's side: applies process 0's operations to this process's engine (its runner)."""

    def __init__(self, runner, index: int):
        self.runner = runner
        self.index = index
        self._builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-follow-build")
        self._builds: list[concurrent.futures.Future] = []
        self._feeds: dict[int, jax.Array] = {}
        self._logits: jax.Array | None = None
        self._rows = 0

    def run(self, conn: socket.socket, following: threading.Event | None = None) -> None:
        """Until process 0 says stop (returns) or goes away (raises ConnectionError); sets `following`
        once the engines agree."""
        op, theirs = _receive(conn)
        if (ours := identity(self.runner)) != theirs:
            differ = sorted(k for k in ours if ours[k] != theirs.get(k))
            raise ConfigError(f"process {self.index}: its engine differs from process 0's in {', '.join(differ)}; "
                              "start every process of a server with the same settings and model")
        log.info("process %d: following process 0's steps", self.index)
        if following is not None:
            following.set()
        apply = {"build": self._build, "forward": self._forward, "sample": self._sample, "prime": self._prime,
                 "slot": self._slot, "clear": self._clear, "reset_kv": self.runner.reset_kv}
        try:
            while True:
                op, *args = _receive(conn)
                if op == "stop":
                    return
                if op not in apply:
                    raise ConfigError(f"process {self.index}: process 0 sent an unknown operation {op!r}; run the "
                                      "same Kiln version in every process")
                apply[op](*args)
        finally:
            self._builder.shutdown(cancel_futures=True)

    def _build(self, keys: list) -> None:
        keys = [_unkey(k) for k in keys]
        self._builds.append(self._builder.submit(self.runner.warm, keys, os.cpu_count() or 1))

    def _built(self, key) -> None:
        """Waits for the builds under way when `key` is one this process has not built yet (a step needs
        it now; one never announced is built by the step itself)."""
        if key not in self.runner.executables:
            for build in self._builds:
                build.result()
            self._builds = [b for b in self._builds if not b.done()]

    def _forward(self, seq: int, key: list, source: int | None, leaves: list) -> None:
        bucket = _unkey(key)
        self._built(bucket)
        inputs, last_index, targets, feed = self.runner.layout.padding_inputs(bucket)
        host = jax.tree.unflatten(jax.tree.structure((inputs, last_index, targets, feed.source)), leaves)
        self._logits, _ = self.runner.run_forward(bucket, self.runner.forward_for(bucket), host,
                                                  None if source is None else self._feeds[source])
        self._rows = bucket.rows

    def _sample(self, seq: int, leaves: list) -> None:
        self._built(SamplerKey(self._rows))
        template = self.runner.layout.sampling_arrays([], self._rows)  # (its extras are the idle ones)
        leaves = [ours if theirs is None else theirs for theirs, ours in zip(leaves, jax.tree.leaves(template),
                                                                             strict=True)]
        sampling = jax.tree.unflatten(jax.tree.structure(template), leaves)
        _, self._feeds[seq] = self.runner.sampler_for(self._rows)(self._logits, sampling)
        for old in [s for s in self._feeds if s <= seq - FEEDS_KEPT]:
            del self._feeds[old]

    def _prime(self, key: list) -> None:
        bucket = _unkey(key)
        self._built(bucket)
        self.runner.forward_for(bucket)
        self.runner.prime(bucket)

    def _slot(self, slot: int, weights: dict, scale: float) -> None:
        self.runner.lora_slots.write(slot, weights, scale)

    def _clear(self, slot: int) -> None:
        self.runner.lora_slots.clear(slot)
