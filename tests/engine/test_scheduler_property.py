"""Property: whatever mix of arrivals, lengths, aborts and preemptions, no KV block leaks.

Drives the real Scheduler and BlockPool; each step's 'model' output is a deterministic
token so the property is about bookkeeping only (the engine tests cover the numerics).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.engine.block_pool import BlockPool
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.engine.request import Request, Status
from kiln.engine.scheduler import Scheduler

BLOCK = 4


class DeterministicOutput:
    """Stands in for the model: row i samples a token from its output length."""

    def __init__(self, rows):
        self.rows = rows

    def token(self, i):
        return len(self.rows[i][0].output_ids) % 4, 0.0, []

    def prompt_logprobs(self, i):
        return []

request_st = st.tuples(
    st.integers(0, 6),  # arrival step
    st.lists(st.integers(0, 3), min_size=1, max_size=30),  # prompt (small alphabet: prefix hits)
    st.integers(1, 12),  # max new tokens
    st.one_of(st.none(), st.integers(0, 20)),  # abort at step
)


@settings(max_examples=150, deadline=None)
@given(st.lists(request_st, min_size=1, max_size=10), st.integers(6, 24), st.booleans(), st.integers(1, 6),
       st.integers(4, 40), st.booleans())
def test_no_block_leaks(tiny_model, reqs, num_blocks, caching, max_seqs, budget, ahead):
    """`ahead`: steps are planned as the engine's async scheduling plans them, one batch in flight
    (dispatched, its results applied only after the next batch is dispatched)."""
    pool = BlockPool(num_blocks, BLOCK, enable_caching=caching)
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_seqs,
                          max_num_batched_tokens=budget)
    sched = Scheduler(config, pool, None, max_model_len=64, tokenizer=tiny_model.tokenizer, eos_ids=(),
                      step_cost=len, fits=lambda rows: True)
    live: list[tuple[Request, int | None]] = []
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    inflight = None

    def apply(batch):
        sched.update_from_batch(batch, DeterministicOutput(batch.rows))

    for step in range(400):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_new, abort_at) = pending.pop(0)
            req = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=max_new), seed=i)
            if len(prompt) + max_new > (num_blocks - 1) * BLOCK:
                continue  # the engine rejects these at validation
            sched.add(req)
            live.append((req, abort_at))
        for req, abort_at in live:
            if abort_at is not None and abort_at <= step and req.status is not Status.FINISHED:
                sched.finish(req, "abort")
        if not sched.has_work() and inflight is None and not pending:
            break
        plan = sched.schedule(ahead=inflight is not None)
        if plan is None:  # planning would preempt a request in flight: its results first
            apply(inflight)
            inflight = None
            plan = sched.schedule()
        # invariant: referenced blocks are exactly those the running requests hold
        held = [b for r in sched.running for b in r.block_ids]
        assert len(held) == len(set(held)) or caching  # shared only through the prefix cache
        assert all(pool.blocks[b].ref_count > 0 for b in held)
        launched = False
        for batch in plan.batches:
            batch = batch.live()
            if batch is None:
                continue
            for r, n in batch.rows:
                assert r.num_scheduled + n <= r.num_tokens_ahead
                assert len(r.block_ids) * BLOCK >= r.num_scheduled + n
            sched.commit(batch)
            if inflight is not None:
                apply(inflight)
            inflight, launched = batch, True
        if inflight is not None and not (ahead and launched):
            apply(inflight)
            inflight = None
    for req, abort_at in live:
        if abort_at is None:  # liveness: every request that fits the pool completes
            assert req.finish_reason == "length", (req.request_id, req.status, req.num_computed)
        if req.status is not Status.FINISHED:
            sched.finish(req, "abort")
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not sched.running and not sched.waiting
