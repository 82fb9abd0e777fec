"""The engine end to end on a tiny model: batching, prefix cache, preemption, sampling, stops."""

import asyncio
import os
import random

import numpy as np
import pytest
from conftest import jit_forward

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.errors import GraphCaptureDisabled, InvalidRequest
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.generate import greedy_generate

SMALL = dict(block_size=16, decode_row_buckets=(1, 2, 4, 8), prefill_token_buckets=(16, 32, 64), max_num_seqs=8,
             max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, async_scheduling="on", **SMALL))
    yield eng
    eng.shutdown()


def run(eng, prompts, params, **kw):
    """Submits all prompts concurrently; returns (token ids, text, final delta) per prompt."""

    async def one(i, p):
        ids, text, last = [], "", None
        p_i = params if isinstance(params, SamplingParams) else params[i]
        async for d in eng.generate(f"req-{i}-{random.random()}", p, p_i, **kw):
            ids += d.token_ids
            text += d.text
            last = d
        return ids, text, last

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def prompts_of(n, seed=0, lo=5, hi=60):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, 250, size=rng.randint(lo, hi))) for _ in range(n)]


def pool_state(eng):
    """(has work, free blocks, usable blocks, referenced blocks), read in the engine thread."""
    core = eng._core
    return eng.at_boundary(lambda: (core.has_work(), core.pool.num_free, core.pool.num_blocks,
                                    sum(b.ref_count > 0 for b in core.pool.blocks))).result(10)


def assert_pool_idle(eng):
    for _ in range(200):
        if not pool_state(eng)[0]:
            break
        asyncio.run(asyncio.sleep(0.01))
    _, free, total, referenced = pool_state(eng)
    assert free == total
    assert referenced == 0


def test_batched_greedy_equals_single_request_greedy(engine, tiny_model):
    prompts = prompts_of(6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = run(engine, prompts, greedy)
    for p, (ids, _, last) in zip(prompts, outs, strict=True):
        assert ids == greedy_generate(tiny_model.params, tiny_model.config, [p], 12)[0]
        assert last.finish_reason == "length" and last.usage["completion_tokens"] == 12
    assert_pool_idle(engine)


def test_prefix_hit_reuses_blocks_and_matches_cold_run(engine):
    prompt = prompts_of(1, seed=5, lo=50, hi=51)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = engine.snapshot["prefix_hits"]
    (cold, _, cold_last), = run(engine, [prompt], greedy)
    (warm, _, warm_last), = run(engine, [prompt], greedy)
    assert warm == cold
    assert cold_last.usage["cached_tokens"] == 0 and warm_last.usage["cached_tokens"] == 48
    assert engine.snapshot["prefix_hits"] - before == 48
    # a different cache salt never shares KV
    (_, _, salted), = run(engine, [prompt], greedy, cache_salt="tenant-b")
    assert salted.usage["cached_tokens"] == 0


def test_a_warmed_prefix_is_cached_and_counted_nowhere(engine, tiny_model):
    """What a server's start does with the chat template's opening: its whole blocks go into the
    prefix cache, and no statistic counts that prefill."""
    prefix = prompts_of(1, seed=11, lo=40, hi=41)[0]
    before = {k: engine.snapshot[k] for k in ("prompt_tokens", "generation_tokens", "finished", "prefix_queries")}
    assert engine.warm_prefix(prefix).result(timeout=120) == 32  # two whole blocks of 16
    engine.at_boundary(lambda: None).result(timeout=30)  # (a snapshot taken after it)
    assert {k: engine.snapshot[k] for k in before} == before
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (_, _, last), = run(engine, [prefix + [7, 8, 9]], greedy)
    assert last.usage["cached_tokens"] == 32
    assert engine.warm_prefix(prefix[:15]).result(timeout=30) == 0  # less than a block: nothing to keep
    off = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=16, enable_prefix_caching=False, **SMALL))
    try:
        assert off.warm_prefix(prefix).result(timeout=120) == 0
    finally:
        off.shutdown()
    assert_pool_idle(engine)


def test_preemption_recomputes_and_frees_everything(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=12, enable_prefix_caching=False, **SMALL))
    try:
        prompts = prompts_of(6, seed=2, lo=20, hi=40)
        greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outs = run(eng, prompts, greedy)
        assert eng.snapshot["preemptions"] > 0  # 11 usable blocks cannot hold 6 rows of up to 70 tokens
        for p, (ids, _, _) in zip(prompts, outs, strict=True):
            assert ids == greedy_generate(tiny_model.params, tiny_model.config, [p], 30)[0]
        assert_pool_idle(eng)
    finally:
        eng.shutdown()


def test_seeded_sampling_is_independent_of_the_batch(engine):
    prompt = prompts_of(1, seed=9)[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    (alone, _, _), = run(engine, [prompt], seeded)
    others = prompts_of(5, seed=10)
    params = [seeded] + [SamplingParams(max_tokens=7, temperature=0.7, ignore_eos=True)] * 5
    mixed = run(engine, [prompt, *others], params)
    assert mixed[0][0] == alone
    reseeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    (other_seed, _, _), = run(engine, [prompt], reseeded)
    assert other_seed != alone


def test_n_siblings_share_prompt_blocks(engine):
    prompt = prompts_of(1, seed=11, lo=40, hi=41)[0]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3, ignore_eos=True)

    async def main():
        by_index = {}
        async for d in engine.generate("group", prompt, params):
            by_index.setdefault(d.index, []).append(d)
        return by_index

    by_index = asyncio.run(main())
    assert sorted(by_index) == [0, 1, 2]
    finals = [ds[-1] for ds in by_index.values()]
    assert sum(f.usage["cached_tokens"] for f in finals) >= 2 * 32  # two siblings reuse 2 full blocks
    samples = {tuple(t for d in ds for t in d.token_ids) for ds in by_index.values()}
    assert len(samples) > 1
    assert_pool_idle(engine)


def test_logprobs_and_prompt_logprobs_match_the_model(engine, tiny_model):
    prompt = prompts_of(1, seed=12, lo=20, hi=21)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, prompt_logprobs=2, ignore_eos=True)
    (ids, _, _), = run(engine, [prompt], params)

    async def first_delta():
        async for d in engine.generate("lp", prompt, params):
            return d

    first = asyncio.run(first_delta())
    full = prompt + ids
    kv = init_kv_cache(tiny_model.config, 4, 16)
    step = build_step_inputs([RowWork(full, 0, [1, 2])], 16)
    logits, _ = jit_forward(tiny_model.params, kv, step, tiny_model.config)
    lp = np.asarray(logits) - np.log(np.exp(np.asarray(logits, np.float64)).sum(-1, keepdims=True))
    tok = first.logprobs[0]
    assert tok.token_id == ids[0]
    np.testing.assert_allclose(tok.logprob, lp[len(prompt) - 1, ids[0]], atol=1e-4)
    assert [t for t, _ in tok.top] == list(np.argsort(-lp[len(prompt) - 1])[:5])
    pl = first.prompt_logprobs
    assert pl[0] is None and len(pl) == len(prompt)
    for pos in range(1, len(prompt)):
        assert pl[pos].token_id == prompt[pos]
        np.testing.assert_allclose(pl[pos].logprob, lp[pos - 1, prompt[pos]], atol=1e-4)
        assert len(pl[pos].top) == 2


def test_stop_strings_are_held_back_and_cut(engine, tiny_model):
    prompt = prompts_of(1, seed=13)[0]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, skip_special_tokens=False)
    (_, text, _), = run(engine, [prompt], greedy)
    assert len(text) > 6
    stop = text[4:7]
    stopped = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, skip_special_tokens=False, stop=[stop])

    async def stream():
        return [d async for d in engine.generate("stop", prompt, stopped)]

    deltas = asyncio.run(stream())
    streamed = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert streamed == text[: text.index(stop)]
    assert all(stop not in d.text for d in deltas)


def test_logit_bias_min_tokens_and_stop_token_ids(engine):
    prompt = prompts_of(1, seed=14)[0]
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={65: 100.0}, stop_token_ids=[65], min_tokens=3,
                            ignore_eos=True)
    (ids, _, last), = run(engine, [prompt], forced)
    assert 65 not in ids[:3] and ids[3] == 65 and len(ids) == 4
    assert last.finish_reason == "stop" and last.stop_reason == 65


def test_abort_frees_blocks(engine):
    prompt = prompts_of(1, seed=15)[0]

    async def main():
        gen = engine.generate("to-abort", prompt, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()  # a client going away

    asyncio.run(main())
    assert_pool_idle(engine)


def test_a_request_is_counted_from_submit_through_its_first_step(engine):
    """num_requests never reads 0 between a request's submission and its first delta, the window
    where the engine has taken it from the inbox and runs its first step (a drain that read 0 there
    ended the server under running streams)."""
    import threading
    seen = []

    def watch(first_delta: threading.Event):
        while not first_delta.is_set():
            seen.append(engine.num_requests())

    async def one(i, prompt):
        first_delta = threading.Event()
        watcher = threading.Thread(target=watch, args=(first_delta,))
        # long enough that it is still running when its caller sees the first delta; closed then
        stream = engine.submit(f"counted-{i}", prompt, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
        watcher.start()  # from the submission on
        try:
            async for _ in stream:
                first_delta.set()
                watcher.join()
                break
        finally:
            stream.close()

    async def main():
        for i, prompt in enumerate(prompts_of(4, seed=21, lo=40, hi=60)):
            await one(i, prompt)

    asyncio.run(main())
    assert seen and min(seen) >= 1, sorted(set(seen))


def test_validation_errors(engine):
    with pytest.raises(InvalidRequest, match="maximum context length"):
        engine._core.validate([5] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(InvalidRequest):
        engine._core.validate([], SamplingParams())
    with pytest.raises(InvalidRequest):
        engine._core.validate([999999], SamplingParams())


def test_live_capture_disabled_uses_compiled_buckets_or_refuses(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=32, allow_live_compile=False, **SMALL))
    try:
        prompt = prompts_of(1, seed=16, lo=20, hi=21)[0]
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        (_, _, last), = run(eng, [prompt], greedy)
        assert last.finish_reason == "error" and isinstance(last.error, GraphCaptureDisabled)
        assert last.error.status == 503 and last.error.code == "graph_capture_disabled"
        runner = eng._core.runner
        # what a server start builds: the plain steps and samplers (the LoRA steps wait for an adapter)
        eng.at_boundary(lambda: runner.warm(runner.startup_set(defer_lora=True), workers=os.cpu_count() or 1)).result()
        compiled = set(runner.compiled)
        outs = run(eng, prompts_of(3, seed=17, lo=10, hi=30), greedy)  # mixed batches split into warm buckets
        assert all(o[2].finish_reason == "length" for o in outs)
        assert runner.compiled == compiled
    finally:
        eng.shutdown()


def test_kv_pool_shrinks_under_running_requests_and_grows_back(tiny_model):
    """Dynamic KV resize at an iteration boundary: cached blocks are evicted, the blocks of
    running requests move below the cut (their K/V copied), and generation goes on exactly."""
    from kiln.engine.core import EngineCore

    core = EngineCore(tiny_model, EngineConfig(num_kv_blocks=64, max_model_len=128, **SMALL))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    early, late = prompts_of(3, seed=30, lo=40, hi=50), prompts_of(3, seed=31, lo=30, hi=40)
    outputs: dict[str, list[int]] = {}

    def add(name, prompts):
        for i, p in enumerate(prompts):
            [req] = core.make_requests(f"{name}-{i}", p, greedy)
            core.add_request(req)

    def step():
        for d in core.step():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)

    add("early", early)
    for _ in range(4):
        step()
    add("late", late)  # takes the blocks after the early requests'
    for _ in range(6):
        step()
    for i in range(len(early)):
        core.abort(f"early-{i}")
    held = {b for r in core.scheduler.running for b in r.block_ids}
    assert max(held) >= 16  # the late requests hold blocks beyond the cut
    assert core.resize_kv(16)
    assert core.runner.kv.num_blocks == 16 and core.pool.num_blocks == 15
    assert all(b < 16 for r in core.scheduler.running for b in r.block_ids)
    for _ in range(3):
        step()
    assert core.resize_kv(64)
    assert core.runner.kv.num_blocks == 64 and core.pool.num_blocks == 63
    while core.has_work():
        step()
    for i, p in enumerate(late):
        assert outputs[f"late-{i}"] == greedy_generate(tiny_model.params, tiny_model.config, [p], 24)[0]
    assert core.pool.num_free == core.pool.num_blocks
    core.close()


def test_kv_pool_shrink_waits_while_requests_hold_too_many_blocks(tiny_model):
    from kiln.engine.core import EngineCore

    core = EngineCore(tiny_model, EngineConfig(num_kv_blocks=64, max_model_len=128, **SMALL))
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts_of(6, seed=32, lo=50, hi=60)):
        [req] = core.make_requests(f"r{i}", p, greedy)
        core.add_request(req)
    for _ in range(8):
        core.step()
    in_use = core.pool.num_blocks - core.pool.num_free
    assert in_use > 12
    assert core.resize_kv(12) is False  # never drops a running request's blocks
    assert core.runner.kv.num_blocks == 64 and core.pool.num_blocks == 63
    with pytest.raises(ValueError):
        core.resize_kv(4)  # cannot hold one max_model_len sequence
    core.close()


def _async_workload(core, grammar):
    """Requests of every kind the engine plans ahead for or not, arriving over the first steps of
    `core`, run to the end; returns each request's deltas (tokens, text, logprobs, finish) by id."""
    prompts = prompts_of(9, seed=40, lo=5, hi=70)
    kinds = [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, n=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=6, stop=["a", "b"]),
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, seed=7, min_tokens=6, stop_token_ids=[40, 41, 42, 43]),
        SamplingParams(max_tokens=11, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                       ignore_eos=True),  # penalties: the engine waits for its tokens on the host
        SamplingParams(max_tokens=16, temperature=0.0, grammar=grammar),  # a grammar: the same
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=25, temperature=1.0, seed=8, top_k=20, ignore_eos=True),
    ]
    seen: dict[str, list] = {}
    step = 0
    while step < 4 or core.has_work():
        if step < len(prompts):  # one new request per step, the rest running
            for req in core.make_requests(f"r{step}", prompts[step], kinds[step]):
                core.add_request(req)
        for d in core.step():
            lps = [(lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top])
                   for lp in d.logprobs or []]
            seen.setdefault(d.request_id, []).append((d.token_ids, d.text, lps, d.finish_reason, d.usage))
        step += 1
    return seen


def test_async_scheduling_gives_the_tokens_sync_scheduling_gives(tiny_model):
    """Planning each step while the one before runs (rows taking their last token from the step in
    flight on the device) changes no request's tokens, text, logprobs, finish or usage: greedy, seeded
    sampling with n=2, stop strings, min_tokens with stop ids, logprobs and prompt logprobs, penalties
    and a grammar (which wait for their tokens on the host), a one-token request, and preemption in a
    pool too small for all of them. Every block comes back."""
    from kiln.engine.core import EngineCore
    from kiln.engine.grammar import GrammarSpec

    runs = {}
    for mode in ("on", "off"):
        core = EngineCore(tiny_model, EngineConfig(num_kv_blocks=24, async_scheduling=mode, **SMALL))
        grammar = core.grammars.compile(GrammarSpec("regex", "[a-f]{3,12}"))
        runs[mode] = _async_workload(core, grammar), core.steps_ahead, core.scheduler.stats.preemptions
        assert core.pool.num_free == core.pool.num_blocks and not core.scheduler.requests
        core.close()
    (on, ahead, preempted), (off, not_ahead, _) = runs["on"], runs["off"]
    assert ahead > 10 and not_ahead == 0  # it did plan ahead, and only when on
    assert preempted > 0  # the pool was too small: requests were preempted and recomputed
    assert on.keys() == off.keys() and len(on) == 10
    for rid in off:
        assert on[rid] == off[rid], rid


def test_step_clock_plans_ahead_only_where_the_host_work_is_worth_hiding():
    from kiln.engine.buckets import StepBucket
    from kiln.engine.pacing import StepClock

    decode, prefill = StepBucket("decode", 32, 32, 1, 32), StepBucket("prefill", 512, 32, 32, 32)
    clock = StepClock("auto")
    assert not clock.runs_ahead(decode)  # nothing measured yet: it measures a step first
    clock.host(0.004)
    clock.fetched(decode, dispatched_at=10.0, waited_from=10.001, done=10.021, was_ready=False)
    assert clock.device_s[decode] == pytest.approx(0.021) and clock.runs_ahead(decode)  # 4 ms of 21
    # a prefill queued behind that decode step: its device time starts when the decode step ended
    clock.fetched(prefill, dispatched_at=10.005, waited_from=10.03, done=10.321, was_ready=False)
    assert clock.device_s[prefill] == pytest.approx(0.3) and not clock.runs_ahead(prefill)  # 4 ms of 300
    clock.fetched(decode, dispatched_at=11.0, waited_from=11.5, done=11.5, was_ready=True)  # no sample
    assert clock.device_s[decode] == pytest.approx(0.021)
    for t in range(20, 50):  # the step slows down: the moving average follows
        clock.fetched(decode, dispatched_at=t, waited_from=t, done=t + 0.2, was_ready=False)
    assert not clock.runs_ahead(decode)
    assert StepClock("on").runs_ahead(prefill) and not StepClock("off").runs_ahead(decode)


def test_priming_runs_the_first_contact_steps_once_and_changes_no_tokens(tiny_model):
    """A start primes the 1-row decode step and the prefill steps of up to 64 tokens (each run once on
    a padding token, its K/V written to padding's block); a step's first real run counts as its
    priming; requests served afterwards get the tokens a fresh engine gives."""
    from kiln.engine.warmup import prime_first_contact

    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, **SMALL))
    try:
        runner = eng._core.runner
        done = eng.at_boundary(lambda: (runner.warm(runner.startup_set(defer_lora=True)),
                                        prime_first_contact(runner))[1]).result(300)
        primed = {b.describe() for b in runner.forwards if b not in runner.unprimed}
        assert done["primed"] == 4 and primed == {"decode rows=1", "prefill tokens=16 tiles=2x16 rows=2",
                                                  "prefill tokens=32 tiles=2x32 rows=2",
                                                  "prefill tokens=64 tiles=4x32 rows=4"}
        prompts = prompts_of(2, seed=50, lo=5, hi=10)  # they decode together: the 2-row step runs
        outs = run(eng, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        for p, (ids, _, _) in zip(prompts, outs, strict=True):
            assert ids == greedy_generate(tiny_model.params, tiny_model.config, [p], 8)[0]
        assert {b.describe() for b in runner.unprimed} == {"decode rows=4", "decode rows=8"}
        assert_pool_idle(eng)
    finally:
        eng.shutdown()
