"""EngineCore: the synchronous engine. One `step()` is schedule -> execute -> update.

It holds the block pool, the scheduler, the runner, the LoRA slots and accelerator
ownership, and is driven by one thread at a time: the async client's engine thread when
serving, or a caller's own loop (benchmarks, trainers' rollouts, tests).

With async scheduling (vLLM v1's), a step's batch stays in flight on the device when `step()`
returns: the next `step()` plans and dispatches the following batch first, then applies the
results of the one in flight while the new one runs, so the host's work (scheduling, laying out
inputs, detokenizing, stop checks) hides behind the device's. A row whose last token the step in
flight is still sampling takes it from that step's sampler on the device. It runs where it pays
(`engine.async_scheduling`, see pacing.py). The engine waits for the results before planning
when a row needs its token on the host first (grammars, penalties, a thinking budget), when
planning would preempt a request in flight, and at every iteration boundary (`flush`): writers,
adapter transitions and KV resizes never see a step in flight.

A step failure fails that step's requests only; on an IREE route it also quarantines the route
(later steps run on XLA, see Runner._quarantine_route). Device loss (DeviceLost, raised by the runner)
is terminal: every request ends with it, their blocks are freed, and from then on `step` and
`add_request` raise it; only a new process gets a device again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time

import jax

from kiln.engine.backends import XLA, Backend
from kiln.engine.block_pool import BlockPool
from kiln.engine.config import EngineConfig
from kiln.engine.grammar import GrammarCompiler
from kiln.engine.kv_pool import DeviceHeap, pool_dtype, size_pool
from kiln.engine.lora_slots import AdapterWeights, LoraSlots
from kiln.engine.metrics import EngineMetrics
from kiln.engine.ownership import Ownership
from kiln.engine.pacing import StepClock
from kiln.engine.params import SamplingParams
from kiln.engine.request import Delta, Request
from kiln.engine.runner import Runner
from kiln.engine.scheduler import Scheduler
from kiln.engine.step_types import Batch, PendingStep, StepFailure
from kiln.errors import DeviceLost, InvalidRequest, KilnError
from kiln.models.loader import LoadedModel
from kiln.models.sharding import lora_slot_shardings, serving_mesh, shard_params

log = logging.getLogger("kiln.engine")


@dataclasses.dataclass
class InFlight:
    """A dispatched batch whose results are not applied yet (it holds an inference share of ownership)."""

    batch: Batch
    pending: PendingStep


class EngineCore:
    def __init__(self, model: LoadedModel, config: EngineConfig, metrics: EngineMetrics | None = None,
                 backend: Backend | None = None):
        self.model = model
        backend = backend or XLA
        # the experimental profile's resident prefill, where the route keeps KV on a Vulkan device
        self.resident_prefill = config.resident_prefill and backend.name == "vulkan" and backend.is_iree
        self.metrics = metrics
        cfg = model.config
        self.ownership = Ownership()
        # a tensor-parallel mesh ([engine] tensor_parallel; None: one device): the weights are sharded over it
        self.mesh = serving_mesh(config.tensor_parallel, backend.name if backend.is_iree else None)
        if self.mesh is not None:
            model.params = shard_params(model.params, cfg, self.mesh)
        # adapter slots first: an accelerator's pool is sized from what is free after them
        slot_shardings = None if self.mesh is None else functools.partial(lora_slot_shardings, cfg=cfg, mesh=self.mesh)
        self.lora_slots = LoraSlots(cfg, config.max_loras, config.max_lora_rank, self.ownership, model.dtype,
                                    config.lora_experts, slot_shardings)
        kv_dtype = pool_dtype(config.kv_cache_dtype, model.dtype, on_iree=backend.is_iree)
        self.kv_pool = size_pool(cfg, config, kv_dtype, config.max_model_len or cfg.max_position_embeddings,
                                 on_host=backend.is_iree, heap=self._device_heap(backend))
        log.info("KV pool: %d blocks of %d tokens, %.0f MiB of %s (%s)", self.kv_pool.blocks, config.block_size,
                 self.kv_pool.blocks * self.kv_pool.block_bytes / (1 << 20), self.kv_pool.dtype, self.kv_pool.reason)
        self.config = config = dataclasses.replace(config, num_kv_blocks=self.kv_pool.blocks)
        capacity = (config.num_kv_blocks - 1) * config.block_size
        self.max_model_len = min(cfg.max_position_embeddings, capacity, config.max_model_len or capacity)
        tok_eos = model.tokenizer.eos_token_id
        self.eos_ids = tuple(cfg.eos_token_ids) or ((tok_eos,) if tok_eos is not None else ())
        self.publisher = None
        self._events: list = []
        if config.kv_events_endpoint:
            from kiln.engine.kv_events import KVEventPublisher

            self.publisher = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint or None,
                                              encoding=config.kv_events_encoding)
        # a route under prefix-reuse quarantine prefills every request afresh
        self.pool = BlockPool(config.num_kv_blocks, config.block_size,
                              config.enable_prefix_caching and backend.reuses_prefixes,
                              on_stored=self._on_stored if self.publisher else None,
                              on_removed=self._on_removed if self.publisher else None)
        self.runner = Runner(cfg, model.params, config, self.max_model_len, self.eos_ids, self.lora_slots, kv_dtype,
                             backend, self.mesh)
        self.scheduler = Scheduler(config, self.pool, self.lora_slots, max_model_len=self.max_model_len,
                                   tokenizer=model.tokenizer, eos_ids=self.eos_ids, step_cost=self.runner.step_cost,
                                   fits=self.runner.fits, on_finish=self._on_finish,
                                   resident_prefill=self.resident_prefill)
        self.grammars = GrammarCompiler(model.tokenizer, cfg.vocab_size, self.eos_ids)
        self.inflight: InFlight | None = None
        self.clock = StepClock(config.async_scheduling)
        self._waited = 0.0  # seconds this step() waited for the device
        self._carried: list[Delta] = []  # deltas of a step completed at a boundary, handed out by the next step()
        self.steps = 0
        self.steps_ahead = 0  # steps dispatched while the step before them still ran
        self.step_failures = 0  # batches that failed (their requests ended with an error)
        self.device_lost: DeviceLost | None = None  # set once, for the life of the process
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none

    def _device_heap(self, backend: Backend) -> DeviceHeap | None:
        """What a Vulkan route's device holds before the KV pool, against its heap (None elsewhere:
        the host, or an XLA accelerator whose allocator says what is free)."""
        if not backend.is_iree or backend.name != "vulkan":
            return None
        placed = jax.tree.leaves((self.model.params, self.lora_slots.abstract_state()))
        capabilities = backend.device.capabilities
        return DeviceHeap(capabilities.memory_bytes, sum(x.size * x.dtype.itemsize for x in placed),
                          capabilities.max_buffer_bytes)

    # ---- requests ----------------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The one check of a request the engine is asked to serve; raises InvalidRequest."""
        vocab = self.model.config.vocab_size
        params.validate(vocab)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest("prompt token ids must be within the vocabulary", param="prompt")
        budget = self.max_model_len - len(prompt_ids)
        if budget < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for a completion. Please reduce the length of the "
                "prompt.", param="prompt")
        if params.max_tokens is not None and params.max_tokens > budget:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + (params.max_tokens or 0)} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens or 0} for the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens")

    def make_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      adapter: AdapterWeights | None = None, cache_salt: str | None = None) -> list[Request]:
        """Validates, then fans n > 1 out into siblings that share the prompt's blocks.

        A request on `adapter` keeps that version's weights until it finishes, even if the
        adapter is replaced or unloaded meanwhile."""
        self.validate(prompt_ids, params)
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        group = request_id if params.n > 1 else None
        return [Request(f"{request_id}-{i}" if group else request_id, list(prompt_ids), params,
                        seed=(base_seed + i) % (1 << 64), adapter=adapter, cache_salt=cache_salt, group_id=group,
                        index=i, matcher=params.grammar.matcher() if params.grammar else None)
                for i in range(params.n)]

    def add_request(self, req: Request) -> None:
        self.check_device()
        self.scheduler.add(req)

    def check_device(self) -> None:
        """Raises DeviceLost once the device is gone."""
        if self.device_lost is not None:
            raise DeviceLost(self.device_lost.message)

    def abort(self, request_id: str) -> list[Delta]:
        """Ends a request (and its siblings) now; returns their final deltas."""
        return self.scheduler.abort(request_id)

    def abort_all(self, error: KilnError) -> list[Delta]:
        """Ends every request now with `error`; returns their final deltas (finish reason abort)."""
        return [self.scheduler.finish(req, "abort", error) for req in list(self.scheduler.requests.values())]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None or bool(self._carried)

    def warm_prefix(self, prompt_ids: list[int]) -> int:
        """Prefills `prompt_ids`, a prefix most requests share (a chat template's opening), into the
        prefix cache before serving: the first request finds its blocks cached as later ones do.
        Only with the cache on and nothing else scheduled; runs to its end on this thread and counts
        in no statistic or metric (its KV events are published: a router learns the blocks are here).
        Returns the tokens cached, whole blocks only (0: none)."""
        cached = len(prompt_ids) // self.config.block_size * self.config.block_size
        if not self.config.enable_prefix_caching or cached == 0 or self.has_work():
            return 0
        counts = [(stats, dataclasses.asdict(stats)) for stats in (self.scheduler.stats, self.pool.stats)]
        metrics, self.metrics = self.metrics, None
        try:
            for req in self.make_requests("kiln-warm-prefix", prompt_ids,
                                          SamplingParams(max_tokens=1, temperature=0.0, seed=0, ignore_eos=True)):
                self.add_request(req)
            while self.has_work():  # (until nothing is in flight either)
                self.step()
        finally:
            self.metrics = metrics
            for stats, before in counts:
                for name, value in before.items():
                    setattr(stats, name, value)
        return cached

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        """One iteration; on device loss, the final (failed) deltas of every request."""
        self.check_device()
        started, self._waited = time.monotonic(), 0.0
        outputs, self._carried = self._carried, []
        try:
            if self.inflight is not None and not self.scheduler.runs_ahead(self.inflight.batch):
                outputs += self._complete()
            plan = self.scheduler.schedule(ahead=self.inflight is not None)
            if plan is None:  # it would preempt a request whose step is in flight
                outputs += self._complete()
                plan = self.scheduler.schedule()
            outputs += plan.finished
            feed = self.inflight.pending.feed if self.inflight is not None else None
            launched = False
            for batch in plan.batches:
                if self.inflight is not None and not self._stays_in_flight(self.inflight):
                    outputs += self._complete()  # an earlier batch of this plan
                batch = batch.live()  # rows whose request an earlier step's results ended drop out
                if batch is not None:
                    outputs += self._launch(batch, feed)
                    launched = True
            if self.inflight is not None and not (launched and self._stays_in_flight(self.inflight)):
                outputs += self._complete()
        except DeviceLost as exc:
            return outputs + self.lose_device(exc)
        self.clock.host(time.monotonic() - started - self._waited)
        return outputs

    def _stays_in_flight(self, flight: InFlight) -> bool:
        """Whether the next step is planned while this one runs (async scheduling, where it pays: see
        pacing.py); an IREE route runs each step to its results."""
        return not self.runner.backend.is_iree and self.clock.runs_ahead(flight.pending.bucket)

    def _launch(self, batch: Batch, feed) -> list[Delta]:
        """Dispatches one batch under accelerator ownership, then applies the results of the step
        in flight before it (while this one runs); this one stays in flight. Returns the deltas."""
        outputs = []
        if not self.ownership.begin_inference(wait=self.inflight is None):
            outputs += self._complete()  # a writer waits: it gets the accelerator at this boundary
            self.ownership.begin_inference()
        try:
            pending = self.runner.dispatch(batch, feed)
        except BaseException:
            self.ownership.end_inference()
            raise
        self.steps += 1
        if self.runner.quarantined and self.resident_prefill:  # resident prefill was the failed route's
            self.resident_prefill = self.scheduler.resident_prefill = False
        if isinstance(pending, StepFailure):
            self.ownership.end_inference()
            outputs += self._complete()  # results apply in dispatch order
            return outputs + self._apply(batch, pending)
        self.scheduler.commit(batch)
        previous, self.inflight = self.inflight, InFlight(batch, pending)
        if previous is not None:
            self.steps_ahead += 1
            outputs += self._finish(previous)
        return outputs

    def _complete(self) -> list[Delta]:
        """Waits for the step in flight (if any) and applies its results."""
        flight, self.inflight = self.inflight, None
        return self._finish(flight) if flight is not None else []

    def _finish(self, flight: InFlight) -> list[Delta]:
        pending = flight.pending
        was_ready, waited_from = pending.ready(), time.monotonic()
        try:
            result = self.runner.fetch(pending)
        finally:
            self.ownership.end_inference()
        done = time.monotonic()
        self._waited += done - waited_from
        self.clock.fetched(pending.bucket, pending.dispatched_at, waited_from, done, was_ready)
        return self._apply(flight.batch, result)

    def _apply(self, batch: Batch, result) -> list[Delta]:
        self.step_failures += isinstance(result, StepFailure) and not result.retry
        outputs = self.scheduler.update_from_batch(batch, result)
        if isinstance(result, StepFailure) and result.kv_lost:
            # a step dispatched after it ran on the lost KV state; its requests recompute (reset above)
            self._discard_inflight()
        self._publish_events()
        return outputs

    def _discard_inflight(self) -> None:
        if self.inflight is not None:
            self.inflight = None
            self.ownership.end_inference()

    def flush(self) -> list[Delta]:
        """An iteration boundary: waits for the step in flight and applies it. Returns the deltas
        not handed out yet (a caller that drives `step()` gets them from its next call otherwise)."""
        self._settle()
        outputs, self._carried = self._carried, []
        return outputs

    def _settle(self) -> None:
        """Nothing in flight from here on; the deltas wait for the next `step()` or `flush()`."""
        if self.inflight is not None:
            try:
                self._carried += self._complete()
            except DeviceLost as exc:
                self._carried += self.lose_device(exc)

    def lose_device(self, exc: DeviceLost) -> list[Delta]:
        """The device is gone: ends every request with `exc` (freeing its blocks and slot) and
        refuses all work from now on. Returns the requests' final deltas."""
        log.critical("device lost: %s; every request fails until the process restarts", exc.message)
        self.device_lost = exc
        self._discard_inflight()
        outputs = [self.scheduler.finish(req, "error", exc) for req in list(self.scheduler.requests.values())]
        self._events = []  # nothing is published about a KV state that no longer exists
        return outputs

    def _publish_events(self) -> None:
        """Sends the KV events the pool raised since the last call (stored and removed blocks)."""
        if self._events:
            self.publisher.publish(self._events)
            self._events = []

    # ---- dynamic KV resize -------------------------------------------------------------------

    @property
    def min_kv_blocks(self) -> int:
        """The smallest pool a resize may leave: room for one sequence of max_model_len (+ block 0)."""
        return -(-self.max_model_len // self.config.block_size) + 1

    def resize_kv(self, num_blocks: int, executables: dict | None = None) -> bool:
        """Gives the KV pool `num_blocks` blocks at this iteration boundary (engine thread). A
        shrink evicts cached blocks first and moves the blocks of running requests below the cut,
        never dropping them; it returns False, changing nothing, while running requests hold more
        blocks than the smaller pool has. `executables`: the steps compiled for the new size
        (`Runner.compile_for_pool`); without them the buckets compile on first use."""
        if num_blocks < self.min_kv_blocks:
            raise ValueError(f"a KV pool of {num_blocks} blocks cannot hold one {self.max_model_len}-token sequence")
        self._settle()
        current = len(self.pool.blocks)
        if num_blocks == current:
            return True
        moves = self.pool.shrink(num_blocks) if num_blocks < current else {}
        if moves is None:
            return False
        if num_blocks > current:
            self.pool.grow(num_blocks)
        with self.ownership.write("kv resize"):
            self.runner.resize_kv(num_blocks, moves, executables or {})
        for req in self.scheduler.running:
            req.block_ids = [moves.get(b, b) for b in req.block_ids]
        self._publish_events()
        log.info("KV pool resized from %d to %d blocks (%d moved)", current, num_blocks, len(moves))
        return True

    # ---- state -------------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The route steps run on: the chosen one, or XLA once an accelerator failure quarantined it."""
        return self.runner.backend

    @property
    def quarantined(self) -> str | None:
        """The route an accelerator failure took out of service (and why); a restart brings it back."""
        return self.runner.quarantined

    def snapshot(self) -> dict:
        """Live state for readers on other threads (taken by the engine thread, between steps)."""
        sched, pool, slots = self.scheduler, self.pool, self.lora_slots
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_usage": pool.usage(),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free,
            "prefix_queries": pool.stats.prefix_queries,
            "prefix_hits": pool.stats.prefix_hits,
            "lora_slots_used": sum(s is not None for s in slots.slots),
            "lora_slots_total": slots.n_slots,
            "lora_loads": slots.loads,
            "lora_evictions": slots.evictions,
            "resident_adapters": slots.resident(),
            "waiting_for_adapter_slot": sched.waiting_for_adapter_slot(),
            "running_adapters": sorted({r.adapter_name for r in sched.running if r.adapter_name}),
            "waiting_adapters": sorted({r.adapter_name for r in sched.waiting if r.adapter_name}),
            "writer_operations": self.ownership.writes,
            "writer_hold_s": self.ownership.write_hold_s,
            "training_slice_s": self.ownership.slice_total_s,
            "steps": self.steps,
            "steps_ahead": self.steps_ahead,
            "compiled_steps": len(self.runner.executables),
            "step_set_size": len(self.runner.executable_set()),
            "compile_waits": self.runner.compile_waits,
            "prompt_tokens": sched.stats.prompt_tokens,
            "generation_tokens": sched.stats.generation_tokens,
            "preemptions": sched.stats.preemptions,
            "finished": sched.stats.finished,
            "step_failures": self.step_failures,
            "device_lost": self.device_lost.message if self.device_lost else None,
            "route_quarantined": self.runner.quarantined,
        }

    def close(self) -> None:
        if self.publisher:
            self.publisher.close()
        if self.runner.mirror is not None:  # the followers stop with process 0
            self.runner.mirror.close()

    # ---- hooks -------------------------------------------------------------------------------

    def _on_finish(self, req: Request, final: Delta) -> None:
        if self.metrics is not None:
            self.metrics.record_finished(final)

    def _on_stored(self, hashes, parent, tokens, lora_name):
        from kiln.engine.kv_events import BlockStored

        self._events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                        block_size=self.config.block_size, lora_id=None, medium="GPU",
                                        lora_name=lora_name))

    def _on_removed(self, hashes):
        from kiln.engine.kv_events import BlockRemoved

        self._events.append(BlockRemoved(block_hashes=hashes, medium="GPU"))
