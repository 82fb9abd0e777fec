"""AsyncEngine: the client side of the engine. It owns the engine thread, the inbox and
the per-request streams; the EngineCore it drives is touched by that thread only.

Callers on any thread submit, abort and schedule boundary calls through the inbox; the
asyncio side only enqueues and awaits (deltas reach each event loop in one
`call_soon_threadsafe` per engine step). Readers on other threads see only the snapshot
the engine thread publishes after every iteration.

After device loss the thread stays up but runs nothing: requests in flight end with
DeviceLost, and new requests and boundary calls are refused with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from kiln.engine.backends import Backend
from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.faults import as_device_lost, is_device_loss
from kiln.engine.grammar import GrammarCompiler
from kiln.engine.host_memory import resident_bytes
from kiln.engine.kv_pool import KVPoolSize
from kiln.engine.lora_slots import AdapterWeights
from kiln.engine.metrics import EngineMetrics
from kiln.engine.ownership import Ownership
from kiln.engine.params import SamplingParams
from kiln.engine.request import Delta
from kiln.engine.step_mirror import StepMirror
from kiln.engine.warmup import build_step_set, prime_first_contact
from kiln.errors import DeviceLost, KilnError
from kiln.models.loader import LoadedModel
from kiln.models.sharding import describe as describe_mesh

log = logging.getLogger("kiln.engine")

Sink = Callable[[Delta], None]


@dataclasses.dataclass
class Completion:
    """One finished choice of `AsyncEngine.complete`."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None  # of the sampled tokens, when requested
    finish_reason: str


class RequestStream:
    """The deltas of one submitted request (all its n choices), read by one event loop.

    Iterate it to the final delta of every choice; closing it early (the client went away)
    aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, n: int, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.remaining = n
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.remaining == 0:
            raise StopAsyncIteration
        delta = await self._queue.get()
        if delta.finished:
            self.remaining -= 1
        return delta

    def close(self) -> None:
        if self.remaining and not self._closed:
            self.engine.abort(self.request_id)
        self._closed = True

    async def aclose(self) -> None:
        self.close()


class _Mailbox:
    """Deltas bound for the streams of one event loop, handed over once per engine step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[tuple[RequestStream, Delta]] = []

    def flush(self) -> bool:
        """Hands the pending deltas to the loop; False if the loop is gone."""
        batch, self.pending = self.pending, []
        try:
            self.loop.call_soon_threadsafe(_deliver, batch)
            return True
        except RuntimeError:  # the caller's event loop is closed
            return False


def _deliver(batch: list[tuple[RequestStream, Delta]]) -> None:
    for stream, delta in batch:
        stream._queue.put_nowait(delta)


class AsyncEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, metrics: EngineMetrics | None = None,
                 backend: Backend | None = None):
        self._core = EngineCore(model, config or EngineConfig(), metrics, backend)
        self.model = model
        self.config = self._core.config
        self.max_model_len = self._core.max_model_len
        self.snapshot: dict[str, Any] = self._core.snapshot()
        self._core.ownership.serving_busy = lambda: self.num_requests() > 0
        if metrics is not None:
            metrics.attach(lambda: {**self.snapshot, "waiting": self.num_waiting()})
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # requests submitted, not yet seen by the engine thread
        self._pending_lock = threading.Lock()
        self._deferred_lock = threading.Lock()  # one caller builds the deferred steps; others wait for them
        self._wake = threading.Event()
        self._sinks: dict[str, Sink | tuple[_Mailbox, RequestStream]] = {}  # engine thread only
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _Mailbox; engine thread
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               adapter: AdapterWeights | None = None, cache_salt: str | None = None) -> RequestStream:
        """Validates the request now (raising InvalidRequest) and returns its stream. Call from
        the event loop that will read the stream. Raises DeviceLost once the device is gone."""
        self._core.check_device()
        requests = self._core.make_requests(request_id, prompt_ids, params, adapter, cache_salt)
        stream = RequestStream(self, request_id, params.n, asyncio.get_running_loop())
        self._enqueue_adds(requests, stream)
        return stream

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
                    adapter: AdapterWeights | None = None, cache_salt: str | None = None) -> list[str]:
        """Like submit, for callers without an event loop: `sink` is called in the engine thread
        with every delta (keep it short). Returns the ids of the n choices' requests."""
        self._core.check_device()
        requests = self._core.make_requests(request_id, prompt_ids, params, adapter, cache_salt)
        self._enqueue_adds(requests, sink)
        return [r.request_id for r in requests]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **kwargs) -> AsyncIterator[Delta]:
        """Streams deltas; leaving the loop early (client gone) aborts the request."""
        stream = self.submit(request_id, prompt_ids, params, **kwargs)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def complete(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapter: AdapterWeights | None = None, timeout: float = 600.0) -> list[list[Completion]]:
        """Generates for many prompts at once and waits: each prompt's n choices. For callers
        without an event loop (notebooks, evals, rollouts); the prompts share steps like any
        concurrent requests. `params`: one for all prompts, or one per prompt. A request
        failing in the engine raises its error."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        choices = [[None] * p.n for p in per_prompt]
        parts: dict[tuple[int, int], tuple[list, list, list]] = {}
        errors, remaining, done = [], [sum(p.n for p in per_prompt)], threading.Event()

        def sink_for(p: int) -> Sink:
            def sink(d: Delta) -> None:  # engine thread
                ids, texts, lps = parts.setdefault((p, d.index), ([], [], []))
                ids += d.token_ids
                texts.append(d.text)
                lps += [lp.logprob for lp in d.logprobs or []]
                if d.finished:
                    if d.error is not None:
                        errors.append(d.error)
                    choices[p][d.index] = Completion(ids, "".join(texts),
                                                     lps if per_prompt[p].logprobs is not None else None,
                                                     d.finish_reason)
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

            return sink

        prefix, submitted = f"complete-{uuid.uuid4().hex[:12]}", []
        try:
            for p, prompt in enumerate(prompts):
                self.add_request(f"{prefix}-{p}", prompt, per_prompt[p], sink_for(p), adapter)
                submitted.append(f"{prefix}-{p}")
            if not prompts or done.wait(timeout):
                submitted = []
        finally:
            for request_id in submitted:  # refused or timed out: withdraw the others
                self.abort(request_id)
        if not done.is_set() and prompts:
            raise TimeoutError(f"generation did not finish within {timeout} s")
        if errors:
            raise errors[0]
        return choices

    def abort(self, request_id: str) -> None:
        """Cancels a request (and its siblings); blocks are freed at the next iteration boundary."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def abort_all(self, error: KilnError) -> None:
        """Ends every request now with `error` (finish reason abort): a server's drain deadline."""
        self._inbox.put(("abort_all", error))
        self._wake.set()

    def at_boundary(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs fn in the engine thread between two steps (weight transitions, resets);
        the future carries its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        self._wake.set()
        return future

    def report_device_loss(self, exc: BaseException) -> concurrent.futures.Future:
        """Accelerator work outside the engine's steps (a training job's) found the device lost:
        serving ends as if a step had lost it (see EngineCore.lose_device)."""
        lost = as_device_lost(exc)

        def raise_lost():
            raise lost

        return self.at_boundary(raise_lost)

    def place_adapter(self, adapter: AdapterWeights) -> concurrent.futures.Future:
        """Loads an adapter version into a slot at the next boundary (result: the slot, or
        None while every slot serves live requests: it then loads on first use). The first one
        after a start that deferred the LoRA steps builds them first, on this thread."""
        self._build_deferred_steps()
        return self.at_boundary(lambda: self._core.lora_slots.place(adapter))

    def _build_deferred_steps(self) -> None:
        runner = self._core.runner
        with self._deferred_lock:
            while runner.deferred:
                if runner.backend.is_iree:  # its gates run modules on the device: not beside serving steps
                    build = lambda: runner.install_deferred(*runner.build_deferred())  # noqa: E731
                else:  # built here while serving goes on, installed at a boundary
                    build = functools.partial(runner.install_deferred, *runner.build_deferred())
                if self.at_boundary(build).result():
                    log.info("built the LoRA steps for the first adapter")

    def retire_adapter(self, adapter: AdapterWeights) -> concurrent.futures.Future:
        """Unload/replace: new requests cannot select this version; requests already on it
        finish with it, and its slot frees when the last one ends."""
        return self.at_boundary(lambda: self._core.lora_slots.retire(adapter))

    # ---- what the rest of Kiln uses of the engine -----------------------------------------------

    @property
    def ownership(self) -> Ownership:
        """The accelerator's writer-priority ownership: training steps, checkpoints and reclaims write."""
        return self._core.ownership

    @property
    def metrics(self) -> EngineMetrics | None:
        return self._core.metrics

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars (any thread; a compile never holds up the engine)."""
        return self._core.grammars

    def route_info(self) -> dict[str, Any]:
        """The backend route steps run on: the route, why it was chosen, its capabilities and gates,
        the paged attention's kernel (`[engine] attention` resolved), whether Kiln's CPU kernels serve
        the quantized products, whether it prefills on the device, and what quarantined it (None
        while it serves)."""
        core = self._core
        return {**core.backend.choice.to_json(), "attention": core.runner.attention,
                "cpu_kernels": core.runner.cpu_kernels,
                "resident_prefill": core.resident_prefill,
                "quarantined": core.quarantined}

    @property
    def mesh(self):
        """The jax.sharding.Mesh the model's weights are split over (None: one device); training runs
        on the engine's weights place their own arrays on it."""
        return self._core.mesh

    def mesh_info(self) -> dict[str, Any]:
        """The tensor-parallel mesh the model is split over: axis, size and devices (size 1: none), and
        the bytes of weights and of adapter slots on each device."""
        return describe_mesh(self._core.mesh, self._core.runner.params, self._core.lora_slots.state)

    def step_set(self) -> list[str]:
        """Every compiled step of the engine's bounded set, described."""
        return [key.describe() for key in self._core.runner.executable_set()]

    @property
    def kv_pool(self) -> KVPoolSize:
        """The pool's configured size and why (a training job's resize may hold it smaller for a while)."""
        return self._core.kv_pool

    @property
    def kv_resident_bytes(self) -> int | None:
        """The pool's bytes in host memory now (on the CPU only the blocks ever written); None on accelerators."""
        return resident_bytes(self._core.runner.kv)  # (None too on an IREE route: its own device arrays)

    @property
    def kv_block_bytes(self) -> int:
        """Accelerator bytes of one KV block (every layer's K and V)."""
        runner = self._core.runner
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in runner.abstract[1]) // runner.num_blocks

    @property
    def min_kv_blocks(self) -> int:
        """The smallest pool a KV resize may leave."""
        return self._core.min_kv_blocks

    def prewarm(self, on_progress: Callable[[int, int], None] | None = None) -> concurrent.futures.Future:
        """Builds (or loads) the step set but its LoRA steps, which the first adapter load builds, then
        runs once the steps a short chat turn uses, on the engine thread (see warmup.py); the future
        carries what it did."""
        runner = self._core.runner
        return self.at_boundary(lambda: {**build_step_set(runner, defer_lora=True, on_progress=on_progress),
                                         **prime_first_contact(runner)})

    def warm_prefix(self, prompt_ids: list[int]) -> concurrent.futures.Future:
        """Prefills a prefix most requests share into the prefix cache, on the engine thread
        (EngineCore.warm_prefix); the future carries the tokens cached."""
        return self.at_boundary(lambda: self._core.warm_prefix(prompt_ids))

    def resize_kv(self, blocks: int, attempts: int = 1, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Gives the KV pool `blocks` blocks at an iteration boundary (blocking). The new size's steps
        are compiled here first, so serving never waits for a compile. A shrink is retried every 0.5 s,
        `attempts` times, while running requests hold more blocks than the smaller pool has (False if
        it never could)."""
        core = self._core
        buckets = self.at_boundary(core.runner.installed_buckets).result()
        executables = core.runner.compile_for_pool(blocks, buckets)
        for attempt in range(attempts):
            if self.at_boundary(lambda: core.resize_kv(blocks, executables)).result():
                return True
            if give_up():
                break
            if attempt + 1 < attempts:
                time.sleep(0.5)
        return False

    def measure_buckets(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every compiled forward step against XLA on its gate's batch (its `error` when it cannot run),
        and the steps their gate refused, with why (qualification; blocking)."""
        from kiln.engine.bucket_gate import measure_bucket

        runner = self._core.runner

        def measure():
            buckets = []
            for bucket, executable in list(runner.forwards.items()):
                entry = {"shape": bucket.to_json()}
                try:
                    entry.update(measure_bucket(runner, bucket, executable, runner._lora_abstract(bucket)))
                except Exception as exc:  # a step that cannot run is a finding of the qualification
                    entry.update(passed=False, error=f"{type(exc).__name__}: {exc}")
                buckets.append(entry)
            return buckets, [{"shape": b.to_json(), "why": why} for b, why in runner.gate_failed.items()]

        return self.at_boundary(measure).result()

    def num_waiting(self) -> int:
        """Requests not yet running: queued in the scheduler or not yet picked up."""
        pending = self._pending_adds  # read before the snapshot the engine publishes before lowering it
        return self.snapshot["waiting"] + pending

    def num_requests(self) -> int:
        """Requests not finished: running, queued, or not yet picked up."""
        pending = self._pending_adds  # (as in num_waiting: a request is in one count or the other)
        snapshot = self.snapshot
        return snapshot["running"] + snapshot["waiting"] + pending

    def alive(self) -> bool:
        """The engine thread runs (it stays up after device loss; see `device_lost`)."""
        return self._thread.is_alive() and not self._stop

    @property
    def device_lost(self) -> DeviceLost | None:
        """The device loss that ended serving on this process, if any (permanent)."""
        return self._core.device_lost

    def lead(self, listener, followers: int, timeout_s: float) -> None:
        """Process 0 of a server over several processes: waits for the `followers` to connect on
        `listener`, then sends them every device operation of this engine (see step_mirror.py)."""
        mirror = StepMirror.accept(listener, followers, self._core.runner, timeout_s)
        self._core.runner.mirror = self._core.lora_slots.mirror = mirror

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._core.close()

    def _enqueue_adds(self, requests, sink) -> None:
        with self._pending_lock:
            self._pending_adds += len(requests)
        self._inbox.put(("add", requests, sink))
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._drain_inbox()
                if not self._core.has_work():
                    self.snapshot = self._core.snapshot()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                steps = self._core.steps
                outputs = self._core.step()
                self.snapshot = self._core.snapshot()  # before the outputs: whoever saw a delta sees its step
                self._dispatch(outputs)
                if self._core.steps == steps:  # nothing could run (e.g. every adapter slot is busy)
                    self._wake.wait(0.001)
                    self._wake.clear()
            except DeviceLost as exc:  # raised outside a step (a step turns its own into final deltas)
                if self._core.device_lost is None:
                    self._lose_device(exc)
            except Exception:  # the loop must survive anything one iteration does
                log.exception("engine iteration failed")
                time.sleep(0.01)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "add":
                _, requests, sink = item
                if isinstance(sink, RequestStream):
                    mailbox = self._mailboxes.get(sink.loop)
                    if mailbox is None:
                        mailbox = self._mailboxes[sink.loop] = _Mailbox(sink.loop)
                    sink = (mailbox, sink)
                for req in requests:
                    self._sinks[req.request_id] = sink
                    if self._core.device_lost is None:
                        self._core.add_request(req)
                    else:  # submitted before the device was lost, picked up after
                        self._dispatch([Delta(req.request_id, req.index, [], "", finish_reason="error",
                                              error=DeviceLost(self._core.device_lost.message))])
                # published before the pending count drops, so a reader (the drain's "nothing left"
                # check) never sees the requests in neither count while their first step runs
                self.snapshot = self._core.snapshot()
                with self._pending_lock:
                    self._pending_adds -= len(requests)
            elif kind == "abort":
                self._dispatch(self._core.abort(item[1]))
            elif kind == "abort_all":
                self._dispatch(self._core.abort_all(item[1]))
            elif kind == "call":
                _, fn, future = item
                self._dispatch(self._core.flush())  # a boundary: no step is in flight while fn runs
                try:
                    self._core.check_device()
                    result = fn()
                except Exception as exc:  # a boundary task must not kill the loop
                    if is_device_loss(exc):
                        exc = as_device_lost(exc)
                        if self._core.device_lost is None:
                            self._lose_device(exc)
                    else:
                        log.exception("iteration-boundary task failed")
                        self.snapshot = self._core.snapshot()
                    future.set_exception(exc)
                else:
                    self.snapshot = self._core.snapshot()  # the caller sees the state its call left
                    future.set_result(result)

    def _lose_device(self, exc: DeviceLost) -> None:
        outputs = self._core.lose_device(exc)
        self.snapshot = self._core.snapshot()
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[Delta]) -> None:
        """Hands each delta to its caller; a caller that has gone away gets its request aborted."""
        touched: dict[_Mailbox, list[str]] = {}
        for delta in outputs:
            sink = self._sinks.pop(delta.request_id) if delta.finished else self._sinks.get(delta.request_id)
            if sink is None:
                continue
            if isinstance(sink, tuple):
                mailbox, stream = sink
                mailbox.pending.append((stream, delta))
                touched.setdefault(mailbox, []).append(delta.request_id)
                continue
            try:
                sink(delta)
            except Exception:  # a caller's sink (its event loop) failing must not stop the other streams
                log.warning("caller of %s is gone; aborting it", delta.request_id)
                if not delta.finished:
                    self._inbox.put(("abort", delta.request_id))
        for mailbox, request_ids in touched.items():
            if not mailbox.flush():
                self._mailboxes.pop(mailbox.loop, None)
                for rid in request_ids:
                    self._inbox.put(("abort", rid))
