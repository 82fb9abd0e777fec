"""EngineCore: the synchronous engine. One `step()` is schedule -> execute -> update.

It holds the block pool, the scheduler, the runner, the LoRA slots and accelerator
ownership, and is driven by one thread at a time: the async client's engine thread when
serving, or a caller's own loop (benchmarks, trainers' rollouts, tests).

A step failure fails that step's requests only; on an IREE route it also quarantines the route
(later steps run on XLA, see Runner._quarantine_route). Device loss (DeviceLost, raised by the runner)
is terminal: every request ends with it, their blocks are freed, and from then on `step` and
`add_request` raise it; only a new process gets a device again.
"""

from __future__ import annotations

import logging
import random

from kiln.engine.block_pool import BlockPool
from kiln.engine.config import EngineConfig
from kiln.engine.grammar import GrammarCompiler
from kiln.engine.lora_slots import AdapterWeights, LoraSlots
from kiln.engine.metrics import EngineMetrics
from kiln.engine.output import Delta
from kiln.engine.ownership import Ownership
from kiln.engine.request import Request
from kiln.engine.routes import XLA, StepRoute
from kiln.engine.runner import Runner, StepResult
from kiln.engine.sampling import SamplingParams
from kiln.engine.scheduler import Scheduler, StepFailure, StepPlan
from kiln.errors import DeviceLost, InvalidRequest
from kiln.models.loader import LoadedModel

log = logging.getLogger("kiln.engine")


class EngineCore:
    def __init__(self, model: LoadedModel, config: EngineConfig, metrics: EngineMetrics | None = None,
                 route: StepRoute | None = None):
        self.model = model
        route = route or XLA
        # the experimental profile's resident prefill, where the route keeps KV on a Vulkan device
        self.resident_prefill = config.resident_prefill and route.name == "vulkan" and route.is_iree
        self.config = config
        self.metrics = metrics
        cfg = model.config
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
                              config.enable_prefix_caching and route.reuses_prefixes,
                              on_stored=self._on_stored if self.publisher else None,
                              on_removed=self._on_removed if self.publisher else None)
        self.ownership = Ownership()
        self.lora_slots = LoraSlots(cfg, config.max_loras, config.max_lora_rank, self.ownership, model.dtype)
        self.runner = Runner(cfg, model.params, config, self.max_model_len, self.eos_ids, self.lora_slots, model.dtype,
                             route)
        self.scheduler = Scheduler(config, self.pool, self.lora_slots, max_model_len=self.max_model_len,
                                   tokenizer=model.tokenizer, eos_ids=self.eos_ids, step_cost=self.runner.step_cost,
                                   fits=self.runner.fits, on_finish=self._on_finish,
                                   resident_prefill=self.resident_prefill)
        self.grammars = GrammarCompiler(model.tokenizer, cfg.vocab_size, self.eos_ids)
        self.steps = 0
        self.step_failures = 0  # batches that failed (their requests ended with an error)
        self.device_lost: DeviceLost | None = None  # set once, for the life of the process
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none

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
        if budget < 1 or (params.max_tokens is not None and params.max_tokens > budget):
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

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        """One iteration; on device loss, the final (failed) deltas of every request."""
        self.check_device()
        plan = self.scheduler.schedule()
        try:
            results = self.execute(plan)
        except DeviceLost as exc:
            return plan.finished + self.lose_device(exc)
        return self.update_from_output(plan, results)

    def lose_device(self, exc: DeviceLost) -> list[Delta]:
        """The device is gone: ends every request with `exc` (freeing its blocks and slot) and
        refuses all work from now on. Returns the requests' final deltas."""
        log.critical("device lost: %s; every request fails until the process restarts", exc.message)
        self.device_lost = exc
        outputs = [self.scheduler.finish(req, "error", exc) for req in list(self.scheduler.requests.values())]
        self._events = []  # nothing is published about a KV state that no longer exists
        return outputs

    def execute(self, plan: StepPlan) -> list[StepResult | StepFailure | None]:
        """Runs each planned batch as one inference step under accelerator ownership (writers
        waiting get the accelerator between steps). After a failure that lost the KV state,
        the remaining batches are not run (None)."""
        results: list[StepResult | StepFailure | None] = []
        for batch in plan.batches:
            if any(isinstance(r, StepFailure) and r.kv_lost for r in results):
                results.append(None)
                continue
            with self.ownership.inference():
                results.append(self.runner.execute(batch))
            self.steps += 1
            self.step_failures += isinstance(results[-1], StepFailure) and not results[-1].retry
            if self.runner.quarantined and self.resident_prefill:  # resident prefill was the failed route's
                self.resident_prefill = self.scheduler.resident_prefill = False
        return results

    def update_from_output(self, plan: StepPlan, results: list[StepResult | StepFailure | None]) -> list[Delta]:
        outputs = self.scheduler.update_from_output(plan, results)
        self._publish_events()
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
    def route(self) -> StepRoute:
        """The route steps run on: the chosen one, or XLA once an accelerator failure quarantined it."""
        return self.runner.route

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
            "steps": self.steps,
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
