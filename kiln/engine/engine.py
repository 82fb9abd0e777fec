"""The engine: one thread runs the scheduler/runner loop; callers submit and await deltas.

The asyncio side only enqueues (submit/abort) and awaits (deltas arrive through
loop.call_soon_threadsafe). JAX releases the GIL while a step computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from kiln.engine.kv_cache import BlockPool
from kiln.engine.lora_slots import AdapterWeights, LoraSlots
from kiln.engine.output import Delta, OutputState, TokenLogprob
from kiln.engine.ownership import Ownership
from kiln.engine.request import Request, Status
from kiln.engine.runner import GraphCaptureDisabled, Runner, RunnerConfig
from kiln.engine.sampling import SamplingError, SamplingParams
from kiln.engine.scheduler import Scheduler, SchedulerConfig
from kiln.models.loader import LoadedModel

log = logging.getLogger("kiln.engine")


@dataclasses.dataclass
class EngineConfig:
    num_kv_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 0  # 0: min(model's max positions, pool capacity)
    enable_prefix_caching: bool = True
    row_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    allow_live_capture: bool = True
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    max_loras: int = 4  # LoRA slots resident on the accelerator
    max_lora_rank: int = 16


class EngineRequestError(Exception):
    """A request failed inside the engine (HTTP 500 for that request only)."""


@dataclasses.dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finished: int = 0


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig):
        self.model = model
        self.config = config
        cfg = model.config
        capacity = (config.num_kv_blocks - 1) * config.block_size
        self.max_model_len = min(cfg.max_position_embeddings, capacity, config.max_model_len or capacity)
        eos = tuple(cfg.eos_token_ids) or ((model.tokenizer.eos_token_id,) if model.tokenizer.eos_token_id is not None else ())
        self.eos_ids = eos
        self.publisher = None
        if config.kv_events_endpoint:
            from kiln.engine.kv_events import KVEventPublisher

            self.publisher = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint or None)
        self.pool = BlockPool(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                              on_stored=self._on_stored if self.publisher else None,
                              on_removed=self._on_removed if self.publisher else None)
        self._events: list = []
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.pool)
        self.ownership = Ownership()
        self.lora_slots = LoraSlots(cfg, config.max_loras, config.max_lora_rank, self.ownership, model.dtype)
        self._adapter_waiting: deque[Request] = deque()  # FCFS until their adapter has a slot
        self.runner = Runner(cfg, model.params, RunnerConfig(
            num_blocks=config.num_kv_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            row_buckets=config.row_buckets, token_buckets=config.token_buckets,
            allow_live_capture=config.allow_live_capture, kv_dtype=model.dtype), eos, self.lora_slots)
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # submitted, not yet seen by the engine thread
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._outputs: dict[str, OutputState] = {}
        self._sinks: dict[str, Callable[[Delta], None]] = {}
        self._requests: dict[str, Request] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) -----------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises SamplingError for a request the engine cannot serve (HTTP 400)."""
        params.validate(self.model.config.vocab_size)
        if not prompt_ids:
            raise SamplingError("the prompt is empty", "prompt")
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt_ids):
            raise SamplingError("prompt token ids must be within the vocabulary", "prompt")
        budget = self.max_model_len - len(prompt_ids)
        if budget < 1 or (params.max_tokens is not None and params.max_tokens > budget):
            raise SamplingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + (params.max_tokens or 0)} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens or 0} for the completion). Please reduce the length of the prompt or completion.",
                "max_tokens",
            )

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    sink: Callable[[Delta], None], adapter: AdapterWeights | None = None,
                    cache_salt: str | None = None) -> list[str]:
        """Queues a request (n > 1 fans out into siblings sharing the prompt's blocks).

        `sink` is called from the engine thread with every Delta. Returns the child ids.
        A request on `adapter` keeps that version's weights until it finishes, even if the
        adapter is replaced or unloaded meanwhile."""
        self.validate(prompt_ids, params)
        if adapter is not None and adapter.rank > self.config.max_lora_rank:
            raise SamplingError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.config.max_lora_rank}", "model")
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        ids = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            req = Request(rid, list(prompt_ids), params, seed=(base_seed + i) % (1 << 64), adapter=adapter,
                          cache_salt=cache_salt, group_id=request_id if params.n > 1 else None)
            with self._pending_lock:
                self._pending_adds += 1
            self._inbox.put(("add", req, sink, i))
            ids.append(rid)
        self._wake.set()
        return ids

    def abort(self, request_id: str) -> None:
        """Cancels a request (and its siblings); blocks are freed at the next iteration boundary."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def at_boundary(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs fn in the engine thread between two steps (weight transitions, resets);
        the future carries its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        self._wake.set()
        return future

    def place_adapter(self, adapter: AdapterWeights) -> concurrent.futures.Future:
        """Loads an adapter version into a slot at the next boundary (result: the slot, or
        None while every slot serves live requests: it then loads on first use)."""
        return self.at_boundary(lambda: self.lora_slots.place(adapter))

    def retire_adapter(self, adapter: AdapterWeights) -> concurrent.futures.Future:
        """Unload/replace: new requests cannot select this version; requests already on it
        finish with it, and its slot frees when the last one ends."""
        return self.at_boundary(lambda: self.lora_slots.retire(adapter))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, **kwargs) -> AsyncIterator[Delta]:
        """Streams deltas; closing the iterator early (client gone) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta] = asyncio.Queue()
        self.add_request(request_id, prompt_ids, params, lambda d: loop.call_soon_threadsafe(q.put_nowait, d), **kwargs)
        remaining = params.n
        try:
            while remaining:
                delta = await q.get()
                if delta.finish_reason is not None:
                    remaining -= 1
                yield delta
        finally:
            if remaining:
                self.abort(request_id)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        if self.publisher:
            self.publisher.close()

    def num_waiting(self) -> int:
        """Requests not yet running: queued in the scheduler or not yet picked up."""
        return len(self.scheduler.waiting) + len(self._adapter_waiting) + self._pending_adds

    def live_stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": self.num_waiting(),
            "kv_usage": self.pool.usage(),
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "prefix_queries": self.pool.stats.prefix_queries,
            "prefix_hits": self.pool.stats.prefix_hits,
            "lora_slots_used": sum(s is not None for s in self.lora_slots.slots),
            "lora_slots_total": self.lora_slots.n_slots,
            "waiting_for_adapter_slot": len(self._adapter_waiting),
            "running_adapters": sorted({r.adapter_name for r in list(self.scheduler.running) if r.adapter_name}),
            "waiting_adapters": sorted({r.adapter_name for r in [*self.scheduler.waiting, *self._adapter_waiting]
                                        if r.adapter_name}),
            "writer_operations": self.ownership.writes,
            **dataclasses.asdict(self.stats),
        }

    # ---- engine thread ------------------------------------------------------------------

    def _on_stored(self, hashes, parent, tokens, lora_name):
        from kiln.engine.kv_events import BlockStored

        self._events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                        block_size=self.config.block_size, lora_id=None, medium="GPU", lora_name=lora_name))

    def _on_removed(self, hashes):
        from kiln.engine.kv_events import BlockRemoved

        self._events.append(BlockRemoved(block_hashes=hashes, medium="GPU"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "add":
                _, req, sink, index = item
                with self._pending_lock:
                    self._pending_adds -= 1
                req.index = index
                self._requests[req.request_id] = req
                self._sinks[req.request_id] = sink
                self._outputs[req.request_id] = OutputState(req, self.model.tokenizer, self.eos_ids, self.max_model_len)
                if req.adapter is None:
                    self.scheduler.add(req)
                else:
                    self._adapter_waiting.append(req)
            elif kind == "abort":
                for rid, req in list(self._requests.items()):
                    if rid == item[1] or req.group_id == item[1]:
                        self._finish(req, "abort")
            elif kind == "call":
                _, fn, future = item
                try:
                    future.set_result(fn())
                except Exception as exc:  # a boundary task must not kill the loop
                    log.exception("iteration-boundary task failed")
                    future.set_exception(exc)

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._iteration()
            except Exception:  # the loop must survive anything one iteration does
                log.exception("engine iteration failed")
                time.sleep(0.01)

    def _emit(self, req: Request, delta: Delta) -> None:
        """Hands a delta to the caller; a caller that has gone away gets its request aborted."""
        try:
            self._sinks[req.request_id](delta)
        except Exception:  # e.g. the caller's event loop is closed
            log.warning("caller of %s is gone; aborting it", req.request_id)
            if delta.finish_reason is None:
                self._inbox.put(("abort", req.request_id))

    def _admit_adapter_requests(self) -> None:
        """Gives waiting adapter requests their slot, first come first served: a request whose
        adapter cannot get a slot yet holds back the ones behind it, so busy slots drain."""
        while self._adapter_waiting:
            req = self._adapter_waiting[0]
            try:
                slot = self.lora_slots.acquire(req.adapter)
            except Exception as exc:  # the adapter cannot be placed: fail this request only
                log.exception("loading adapter %s failed", req.adapter.name)
                self._finish(req, "error", EngineRequestError(f"loading adapter {req.adapter.name!r} failed: {exc}"))
                continue
            if slot is None:
                return
            self._adapter_waiting.popleft()
            req.adapter_slot = slot
            self.scheduler.add(req)

    def _iteration(self) -> None:
        self._drain_inbox()
        self._admit_adapter_requests()
        if not self.scheduler.has_work():
            self._wake.wait(0.05)
            self._wake.clear()
            return
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        if not batch.rows:
            self._fail_unschedulable()
            return
        try:
            with self.ownership.inference():
                results, prompt_lps = self.runner.run(batch.rows)
        except GraphCaptureDisabled as exc:
            for req, _ in batch.rows:
                self._finish(req, "error", exc)
            return
        except Exception as exc:  # a failed step fails its rows, never the process
            log.exception("step failed")
            self._recover_after_failure(batch, exc)
            return
        self.stats.steps += 1
        now = time.monotonic()
        produced = set(self.scheduler.after_step(batch))
        for i, (req, n) in enumerate(batch.rows):
            if req.num_preemptions == 0 and req.timing.prefill_done is None and req.num_computed >= len(req.prompt_ids):
                req.timing.prefill_done = now
            if i in prompt_lps:
                self._collect_prompt_logprobs(req, n, prompt_lps[i])
            if req in produced:
                self._on_token(req, results[i], now)
        if self._events and self.publisher:
            self.publisher.publish(self._events)
            self._events = []

    def _collect_prompt_logprobs(self, req: Request, n: int, data) -> None:
        target, top_ids, top_lps, targets = data
        k = req.params.prompt_logprobs or 0
        for j in range(n):
            if targets[j] >= 0:
                top = list(zip(top_ids[j, :k].tolist(), top_lps[j, :k].tolist(), strict=True))
                req.prompt_logprobs.append(TokenLogprob(int(targets[j]), float(target[j]), top))

    def _on_token(self, req: Request, result, now: float) -> None:
        req.output_ids.append(result.token)
        self.stats.generation_tokens += 1
        first = req.timing.first_token is None
        if first:
            req.timing.first_token = now
            self.stats.prompt_tokens += len(req.prompt_ids)
        text, finish, stop_reason = self._outputs[req.request_id].add_token(result.token)
        logprobs = [TokenLogprob(result.token, result.logprob, result.top)] if req.params.logprobs is not None else None
        delta = Delta(req.request_id, req.index, [result.token], text, logprobs, finish, stop_reason)
        if first and req.params.prompt_logprobs is not None:
            delta.prompt_logprobs = [None, *req.prompt_logprobs]
        if finish is not None:
            self.scheduler.finish(req, finish)
            self._final(req, delta)
        else:
            self._emit(req, delta)

    def _final(self, req: Request, delta: Delta) -> None:
        delta.usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                       "cached_tokens": req.num_cached_prompt_tokens}
        delta.metrics = {**req.timing.phases(), "preemptions": req.num_preemptions}
        self.stats.finished += 1
        if req.adapter_slot:
            self.lora_slots.release(req.adapter_slot)
            req.adapter_slot = 0
        self._emit(req, delta)
        self._sinks.pop(req.request_id, None)
        self._outputs.pop(req.request_id, None)
        self._requests.pop(req.request_id, None)

    def _finish(self, req: Request, reason: str, error: Exception | None = None) -> None:
        if req.status is Status.FINISHED and req.request_id not in self._sinks:
            return
        if req in self._adapter_waiting:
            self._adapter_waiting.remove(req)
        self.scheduler.finish(req, reason)
        self._final(req, Delta(req.request_id, req.index, [], "", finish_reason=reason, error=error))

    def _fail_unschedulable(self) -> None:
        """Nothing could be scheduled: a waiting request that can never fit the pool fails."""
        if self.scheduler.running or not self.scheduler.waiting:
            time.sleep(0.001)
            return
        req = self.scheduler.waiting[0]
        self._finish(req, "error", EngineRequestError(
            f"the request needs more KV blocks than the pool holds ({self.pool.num_blocks} blocks)"))

    def _recover_after_failure(self, batch, exc: Exception) -> None:
        """Fails the batch's requests; if the donated KV state was lost, recompute the others."""
        for req, _ in batch.rows:
            self._finish(req, "error", EngineRequestError(f"request failed: {type(exc).__name__}"))
        if self.runner.kv.k.is_deleted():
            from kiln.models.decoder import init_kv_cache

            self.runner.kv = init_kv_cache(self.model.config, self.config.num_kv_blocks, self.config.block_size,
                                           self.runner.kv.k.dtype)
            for req in list(self.scheduler.running):
                self.scheduler.preempt(req)
            self.pool.reset_prefix_cache()
