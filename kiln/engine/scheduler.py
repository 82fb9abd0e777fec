"""Scheduler: owns admission, the step plan, finishing and the freeing of blocks.

One rule, as in vLLM v1: each request has computed and known tokens, and each step
advances them under a token budget, so continuous batching of decodes with chunked
prefills falls out. Admission takes KV blocks (preempting the newest running request
when they run out), the row limit and the LoRA slot limit into account: a request whose
adapter cannot get a slot is skipped this step and stays at its place in the queue.

The plan says how the step runs: one batch (decode-only, prefill-only or mixed), or the
decode rows and the prefill chunks as two batches when the cost model says padding the
decode rows to the prefill chunk's length costs more than a second step.

A dispatched batch is committed (`commit`): its tokens are in flight and, for rows that sample,
one more token is pending. The next step may be planned before those results reach the host
(`schedule(ahead=True)`, async scheduling): a row whose last token is pending decodes it from the
device, a row whose pending token must be its last is left out, and a plan that would need to
preempt a request in flight is refused (the engine then waits for the results and plans again).
Once a batch's results are on the host, `update_from_batch` advances every row, caches newly full
blocks, appends sampled tokens, applies stop conditions and finishes requests.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable

from kiln.engine.block_pool import BlockPool, block_hashes
from kiln.engine.config import EngineConfig
from kiln.engine.lora_slots import LoraSlots
from kiln.engine.request import Delta, OutputState, Request, Status, TokenLogprob
from kiln.engine.step_types import Batch, RowOutput, Rows, StepFailure, StepPlan
from kiln.errors import KilnError, RequestFailed
from kiln.models.tokenizer import KilnTokenizer

log = logging.getLogger("kiln.engine")

@dataclasses.dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, lora_slots: LoraSlots | None, *, max_model_len: int,
                 tokenizer: KilnTokenizer, eos_ids: tuple[int, ...], step_cost: Callable[[Rows], float],
                 fits: Callable[[Rows], bool], on_finish: Callable[[Request, Delta], None] | None = None,
                 resident_prefill: bool = False):
        self.config = config
        self.resident_prefill = resident_prefill
        self.pool = pool
        self.lora_slots = lora_slots
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.step_cost = step_cost  # relative cost of running rows as one step (runner.step_cost)
        self.fits = fits  # whether rows can run without compiling a new step (runner.fits)
        self.on_finish = on_finish
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.stats = SchedulerStats()

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        req.output = OutputState(req, self.tokenizer, self.eos_ids, self.max_model_len)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> list[Delta]:
        """Ends a request and its n > 1 siblings; their blocks and adapter slots are freed now."""
        hit = [r for r in self.requests.values() if request_id in (r.request_id, r.group_id)]
        return [self.finish(r, "abort") for r in hit]

    def waiting_for_adapter_slot(self) -> int:
        return sum(r.adapter is not None and not r.adapter_slot for r in self.waiting)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> StepPlan | None:
        """The next step's plan. `ahead`: a dispatched step's results are not applied yet; returns
        None when the plan would have to preempt (the caller applies them and plans again)."""
        budget = self.config.max_num_batched_tokens
        rows: Rows = []
        preempted: list[Request] = []
        finished: list[Delta] = []
        # 1. running requests, oldest first; preempt the newest when blocks run out
        for req in list(self.running):
            if req.status is not Status.RUNNING:  # preempted below to make room
                continue
            if self._ends_in_flight(req):
                continue
            n = min(req.num_tokens_ahead - req.num_scheduled, budget, self._row_cap(req))
            if n <= 0:
                continue
            need = self._blocks_needed(req, req.num_scheduled + n)
            if need > self.pool.num_free and ahead:
                return None
            while need > self.pool.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            req.block_ids += self.pool.allocate(need)
            rows.append((req, n))
            budget -= n
        # 2. admit waiting requests in order while blocks, rows, adapter slots and budget allow
        skipped: list[Request] = []
        blocked: Request | None = None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting.popleft()
            if self._sibling_prefilling(req):
                skipped.append(req)  # wait for the shared prompt blocks
                continue
            if req.adapter is not None and not req.adapter_slot:
                try:
                    slot = self.lora_slots.acquire(req.adapter)
                except Exception as exc:  # the adapter cannot be placed: this request fails, no other
                    log.exception("loading adapter %s failed", req.adapter.name)
                    finished.append(self.finish(req, "error", RequestFailed(
                        f"loading adapter {req.adapter.name!r} failed: {exc}", code="adapter_transition_failed")))
                    continue
                if slot is None:  # every slot serves other live requests
                    skipped.append(req)
                    continue
                req.adapter_slot = slot
            n = self._admit(req, budget)
            if n is None:
                self.waiting.appendleft(req)
                blocked = req
                break
            rows.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if blocked is not None and not rows and not self.running:
            # alone in an empty pool and still no room: it can never run
            finished.append(self.finish(blocked, "error", RequestFailed(
                f"the request needs more KV blocks than the pool holds ({self.pool.num_blocks} blocks)")))
        self.stats.preemptions += len(preempted)
        return StepPlan(self._plan(rows), finished, preempted)

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether the token a dispatched step samples for the request is its last (its length limit)."""
        if not req.num_pending:
            return False
        limit = req.params.max_tokens
        return (limit is not None and req.num_output_ahead >= limit) or req.num_tokens_ahead >= self.max_model_len

    def runs_ahead(self, batch: Batch) -> bool:
        """Whether the next step may be planned before this batch's sampled tokens reach the host: not
        when a row's next step depends on the host seeing its token first (a grammar's mask, a forced
        token, penalties over its history, a thinking budget)."""
        return not any(sampled and (r.matcher is not None or r.forced or r.params.needs_penalties
                                    or r.params.thinking is not None)
                       for (r, _), sampled in zip(batch.rows, batch.samples, strict=True))

    def commit(self, batch: Batch) -> None:
        """The batch was dispatched: its tokens are in flight, and a token is pending for each row it samples."""
        for i, ((req, n), sampled) in enumerate(zip(batch.rows, batch.samples, strict=True)):
            req.num_inflight += n
            if sampled:
                req.num_pending += 1
                req.feed_row = i

    def _row_cap(self, req: Request) -> int:
        """New tokens a row may take in one step. Resident prefill feeds prompts one token per
        active row, as decode steps do; a request whose shape needs the whole-prompt path (prompt
        logprobs) keeps it."""
        if self.resident_prefill and req.params.prompt_logprobs is None:
            return 1
        return req.num_tokens

    def _admit(self, req: Request, budget: int) -> int | None:
        """Starts (or restarts) a waiting request on its cached prefix; None if blocks lack."""
        hits = self._prefix_hits(req)
        self.pool.touch(hits)
        num_computed = len(hits) * self.block_size
        n = min(req.num_tokens - num_computed, budget, self._row_cap(req))
        need = max(0, math.ceil((num_computed + n) / self.block_size) - len(hits))
        if need > self.pool.num_free:
            self.pool.release(hits)
            return None
        self.pool.record_query(self._queried_tokens(req), num_computed)
        req.block_ids = hits + self.pool.allocate(need)
        req.block_hashes = [self.pool.blocks[b].block_hash for b in hits]
        req.num_computed = num_computed
        if req.num_preemptions == 0:
            req.num_cached_prompt_tokens = num_computed
        req.status = Status.RUNNING
        if req.timing.first_scheduled is None:
            req.timing.first_scheduled = time.monotonic()
        self.running.append(req)
        return n

    def _plan(self, rows: Rows) -> list[Batch]:
        """One batch, or decode rows and prefill chunks apart when that is cheaper (cost model)
        or when they cannot run together (see fits), split further where a part still cannot."""
        if not rows:
            return []
        decode = [r for r in rows if r[1] == 1]
        prefill = [r for r in rows if r[1] > 1]
        mixed = bool(decode and prefill)
        if mixed and self.step_cost(rows) > self.step_cost(decode) + self.step_cost(prefill):
            groups = [decode, prefill]
        elif self.fits(rows) or not mixed:
            groups = [rows]
        else:
            groups = [decode, prefill]
        return [Batch(part) for group in groups for part in self._split(group)]

    def _split(self, rows: Rows) -> list[Rows]:
        """Rows that cannot run as one step (no step bucket fits them, none that fits is built with
        live compiling off, or every one that fits failed its correctness gate) run as halves,
        recursively; a lone prompt chunk that still cannot runs as half the chunk (the rest of the
        prompt follows in later steps)."""
        if self.fits(rows):
            return [rows]
        if len(rows) == 1:
            req, n = rows[0]
            return self._split([(req, n // 2)]) if n > 1 else [rows]
        half = len(rows) // 2
        return self._split(rows[:half]) + self._split(rows[half:])

    def preempt(self, req: Request) -> None:
        """Free and recompute later: the request returns to the front of the queue."""
        self.running.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids, req.block_hashes, req.num_computed = [], [], 0
        req.num_inflight = req.num_pending = 0  # a step still in flight for it is discarded
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _blocks_needed(self, req: Request, upto: int) -> int:
        return max(0, math.ceil(upto / self.block_size) - len(req.block_ids))

    def _queried_tokens(self, req: Request) -> int:
        return ((req.num_tokens - 1) // self.block_size) * self.block_size

    def _prefix_hits(self, req: Request) -> list[int]:
        if req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        # leave at least one token to compute, so the step yields logits to sample from
        usable = (req.num_tokens - 1) // self.block_size
        if req.lookup_hashes is None or req.lookup_hashes[0] != usable:  # hashed once per length
            tokens = req.all_ids[: usable * self.block_size]
            req.lookup_hashes = (usable, block_hashes(tokens, self.block_size, req.hash_extra))
        return self.pool.lookup(req.lookup_hashes[1])

    def _sibling_prefilling(self, req: Request) -> bool:
        if req.group_id is None or req.num_preemptions:
            return False
        return any(r.group_id == req.group_id and r.in_prefill for r in self.running)

    # ---- update --------------------------------------------------------------------------

    def update_from_batch(self, batch: Batch, result: RowOutput | StepFailure) -> list[Delta]:
        """Applies one dispatched batch's results; returns its requests' deltas (finals included).
        Rows whose request stopped running meanwhile (aborted, or finished by an earlier step) are skipped."""
        if isinstance(result, StepFailure):
            if result.retry:  # it did not run: its rows are planned again, with their state unchanged
                return []
            outputs = [self.finish(req, "error", result.error) for req, _ in batch.rows if not req.finished]
            if result.kv_lost:
                self._recompute_all()
            return outputs
        outputs = []
        now = time.monotonic()
        for i, ((req, n), sampled) in enumerate(zip(batch.rows, batch.samples, strict=True)):
            if req.status is not Status.RUNNING:
                continue
            self._advance(req, n)
            if req.params.prompt_logprobs is not None:
                for pos, lp in result.prompt_logprobs(i):
                    if pos == len(req.prompt_logprobs):  # a recomputed prefill adds nothing twice
                        req.prompt_logprobs.append(lp)
            if req.timing.prefill_done is None and not req.in_prefill:
                req.timing.prefill_done = now
            if sampled:
                req.num_pending -= 1
                outputs.append(self._on_token(req, *result.token(i), now))
        return outputs

    def _advance(self, req: Request, n: int) -> None:
        """Marks n more tokens computed and caches the blocks they filled."""
        B = self.block_size
        req.num_computed += n
        req.num_inflight -= n
        full = req.num_computed // B
        if full > len(req.block_hashes):
            start = len(req.block_hashes)
            ids = req.all_ids
            parent = req.block_hashes[-1] if req.block_hashes else None
            new = block_hashes(ids[: full * B], B, req.hash_extra, start=start, parent=parent)
            self.pool.cache_blocks(req.block_ids[start:full], new, ids[start * B : full * B], parent, req.adapter_name)
            req.block_hashes += new

    def _on_token(self, req: Request, token: int, logprob: float, top: list[tuple[int, float]], now: float) -> Delta:
        req.output_ids.append(token)
        self.stats.generation_tokens += 1
        first = req.timing.first_token is None
        if first:
            req.timing.first_token = now
            self.stats.prompt_tokens += len(req.prompt_ids)
        text, finish, stop_reason = req.output.add_token(token)
        logprobs = [TokenLogprob(token, logprob, top)] if req.params.logprobs is not None else None
        delta = Delta(req.request_id, req.index, [token], text, logprobs, finish, stop_reason)
        if first and req.params.prompt_logprobs is not None:
            delta.prompt_logprobs = req.prompt_logprobs
        return self.finish(req, finish, delta=delta) if finish is not None else delta

    def _recompute_all(self) -> None:
        """The KV state is gone: every running request recomputes, and no cached block is valid."""
        for req in list(self.running):
            self.preempt(req)
        self.pool.reset_prefix_cache()

    def finish(self, req: Request, reason: str, error: KilnError | None = None, delta: Delta | None = None) -> Delta:
        """Ends a request (stop, length, abort, error): frees its blocks and adapter slot.

        Returns its final delta, with usage and latency phases."""
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.block_ids)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.block_ids = []
        req.num_inflight = req.num_pending = 0
        if req.adapter_slot:
            self.lora_slots.release(req.adapter_slot)
            req.adapter_slot = 0
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.timing.finished = time.monotonic()
        self.requests.pop(req.request_id, None)
        self.stats.finished += 1
        delta = delta or Delta(req.request_id, req.index, [], "", finish_reason=reason, error=error)
        delta.usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                       "cached_tokens": req.num_cached_prompt_tokens}
        delta.metrics = {**req.timing.phases(), "preemptions": req.num_preemptions}
        if self.on_finish is not None:
            self.on_finish(req, delta)
        return delta
