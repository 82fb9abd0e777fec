"""Scheduler: one rule, as in vLLM v1. Each request has computed and known tokens, and each
step advances them under a token budget, so continuous batching of decodes with chunked
prefills falls out. It owns admission, batch assembly, preemption and cancellation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque

from kiln.engine.kv_cache import BlockPool, block_hashes
from kiln.engine.request import Request, Status


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048


@dataclasses.dataclass
class ScheduledBatch:
    rows: list[tuple[Request, int]]  # (request, number of new tokens this step)
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request, upto: int) -> int:
        return max(0, math.ceil(upto / self.block_size) - len(req.block_ids))

    def preempt(self, req: Request) -> None:
        """Free and recompute later: the request returns to the front of the queue."""
        self.running.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids, req.block_hashes, req.num_computed = [], [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        rows: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        # 1. running requests, oldest first; preempt the newest when blocks run out
        for req in list(self.running):
            if req not in self.running:  # preempted below to make room
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                continue
            need = self._blocks_needed(req, req.num_computed + n)
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
        # 2. admit waiting requests FCFS while blocks, rows and budget allow
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            if self._sibling_prefilling(req):
                deferred.append(self.waiting.popleft())  # wait for the shared prompt blocks
                continue
            hits = self._prefix_hits(req)
            self.pool.touch(hits)
            num_computed = len(hits) * self.block_size
            n = min(req.num_tokens - num_computed, budget)
            need = max(0, math.ceil((num_computed + n) / self.block_size) - len(hits))
            if need > self.pool.num_free:
                self.pool.release(hits)
                break
            self.waiting.popleft()
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
            rows.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return ScheduledBatch(rows, preempted)

    def _queried_tokens(self, req: Request) -> int:
        return ((req.num_tokens - 1) // self.block_size) * self.block_size

    def _prefix_hits(self, req: Request) -> list[int]:
        if req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        # leave at least one token to compute, so the step yields logits to sample from
        usable = (req.num_tokens - 1) // self.block_size
        if req.lookup_hashes is None or req.lookup_hashes[0] != usable:  # a blocked head retries every step
            tokens = req.all_ids[: usable * self.block_size]
            req.lookup_hashes = (usable, block_hashes(tokens, self.block_size, req.hash_extra))
        return self.pool.lookup(req.lookup_hashes[1])

    def _sibling_prefilling(self, req: Request) -> bool:
        if req.group_id is None or req.num_preemptions:
            return False
        return any(r.group_id == req.group_id and r.in_prefill for r in self.running)

    def after_step(self, batch: ScheduledBatch) -> list[Request]:
        """Advances progress and caches newly full blocks; returns rows that produced a token."""
        sampled = []
        B = self.block_size
        for req, n in batch.rows:
            req.num_computed += n
            full = req.num_computed // B
            if full > len(req.block_hashes):
                start = len(req.block_hashes)
                ids = req.all_ids
                parent = req.block_hashes[-1] if req.block_hashes else None
                new = block_hashes(ids[: full * B], B, req.hash_extra, start=start, parent=parent)
                self.pool.cache_blocks(req.block_ids[start:full], new, ids[start * B : full * B], parent, req.adapter_name)
                req.block_hashes += new
            if req.num_computed == req.num_tokens:
                sampled.append(req)
        return sampled

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request (stop, length, abort) and frees its blocks."""
        if req.status is Status.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.block_ids)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.block_ids = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.timing.finished = time.monotonic()
