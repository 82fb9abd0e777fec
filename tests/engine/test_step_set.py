"""The bounded step set: the executables of the default settings are few and known in advance, and
once they are built no request of any shape makes the engine compile another."""

import asyncio
import os
import random

import numpy as np
import pytest

from kiln.engine.buckets import BucketSet
from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.grammar import GrammarSpec
from kiln.engine.lora_slots import AdapterWeights
from kiln.engine.params import SamplingParams
from kiln.engine.runner import COUNTER
from kiln.models.lora import module_shapes


def test_the_default_settings_enumerate_at_most_48_executables():
    defaults = EngineConfig()
    buckets = BucketSet(defaults.decode_row_buckets, defaults.prefill_token_buckets, defaults.max_num_seqs,
                        defaults.max_num_batched_tokens)
    assert len(buckets) <= 48
    kinds = {(b.kind, b.lora) for b in buckets.forwards}
    assert kinds == {("decode", False), ("decode", True), ("prefill", False), ("prefill", True)}
    # every row count a forward step samples has its sampler
    assert {b.rows for b in buckets.forwards} == set(buckets.sampler_rows)
    # the largest buckets hold the configured limits
    assert max(b.rows for b in buckets.forwards if b.kind == "decode") == defaults.max_num_seqs
    assert max(b.tokens for b in buckets.forwards) == defaults.max_num_batched_tokens


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, kiln_cache):
    """The tiny llama with room for 2,048 positions."""
    from tiny_models import make_hf_model, write_gguf

    from kiln.models.loader import load_model

    hf = make_hf_model("llama", vocab_size=260, seed=3, max_position_embeddings=2048)
    return load_model(write_gguf(hf, tmp_path_factory.mktemp("long") / "long.gguf"), show_progress=False,
                      model_id="tiny-long")


def _adapter(cfg, seed: int) -> AdapterWeights:
    rng = np.random.default_rng(seed)
    weights = {m: {"a": (0.3 * rng.standard_normal((cfg.num_layers, i, 8))).astype(np.float32),
                   "b": (0.3 * rng.standard_normal((cfg.num_layers, 8, o))).astype(np.float32)}
               for m, (i, o) in module_shapes(cfg).items()}
    return AdapterWeights(f"random-{seed}", "v1", weights, 2.0, 8)


def _random_request(rng: random.Random, model, grammars, adapters):
    """One request as a client could send it: a chat or a plain prompt of 1 to 1,500 tokens and a
    random mix of the sampling features."""
    tok = model.tokenizer
    length = rng.choice([1, 3, 17, 40, 90, 200, 511, 513, 900, 1500])
    if rng.random() < 0.5 and length > 30:  # a chat: the template around user text
        text = "".join(rng.choice("abcdefghij ") for _ in range(length - 25))
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    else:
        prompt = [rng.randrange(3, 250) for _ in range(length)]
    params = SamplingParams(max_tokens=rng.choice([1, 2, 5, 12]), temperature=rng.choice([0.0, 0.0, 0.7, 1.3]),
                            seed=rng.randrange(1 << 30), n=rng.choice([1, 1, 1, 2, 4]))
    if rng.random() < 0.3:
        params.logprobs = rng.choice([0, 1, 5, 20])
    if rng.random() < 0.15:
        params.prompt_logprobs = rng.choice([0, 3, 20])
    if rng.random() < 0.25:
        params.top_k, params.top_p = rng.choice([0, 5, 40]), rng.choice([1.0, 0.9])
        params.min_p = rng.choice([0.0, 0.1])
    if rng.random() < 0.25:
        params.presence_penalty, params.frequency_penalty = rng.choice([0.0, 0.5]), rng.choice([0.0, -0.3])
        params.repetition_penalty = rng.choice([1.0, 1.2])
    if rng.random() < 0.2:
        params.logit_bias = {rng.randrange(260): rng.uniform(-100, 100) for _ in range(rng.choice([1, 7, 300]))}
    if rng.random() < 0.2:
        params.min_tokens = min(params.max_tokens, 3)
        params.stop_token_ids = [rng.randrange(260) for _ in range(rng.choice([1, 128]))]
    if rng.random() < 0.15:
        params.stop = ["ab", "j"]
    if rng.random() < 0.2:
        params.grammar = rng.choice(grammars)
    adapter = rng.choice(adapters) if rng.random() < 0.3 else None
    return prompt, params, adapter


def test_a_random_mix_of_requests_compiles_nothing_outside_the_enumerated_set(long_model):
    """The default engine settings on a tiny model: the whole enumerated set is built first; then a
    seeded random mix of requests (chat and plain prompts of 1 to 1,500 tokens, n up to 4, logprobs
    and top logprobs up to 20, prompt logprobs, penalties, logit bias, banned ids, stop strings,
    JSON Schema and regex constraints, adapter and base rows in one batch, 1 to 24 at a time)
    compiles nothing: no XLA backend compile happens and no step waits for one."""
    eng = AsyncEngine(long_model, EngineConfig())
    try:
        runner = eng._core.runner
        enumerated = runner.executable_set()
        assert len(enumerated) <= 48
        eng.at_boundary(lambda: runner.warm(workers=os.cpu_count() or 1)).result()  # as a server start builds it
        assert set(runner.executables) == set(enumerated)
        grammars = [eng._core.grammars.compile(GrammarSpec("json", {"type": "object", "properties": {
                        "a": {"type": "integer"}}, "required": ["a"]})),
                    eng._core.grammars.compile(GrammarSpec("regex", "[ab]{2,6}c?"))]
        adapters = [_adapter(long_model.config, seed) for seed in (1, 2)]
        rng = random.Random(7)
        # the adapters' slots are written once before counting: a slot write is a writer operation
        # with its own small executable, not a step
        asyncio.run(_send(eng, [([5, 6, 7], SamplingParams(max_tokens=1), a) for a in adapters]))
        builds = COUNTER.builds
        for _ in range(6):
            wave = [_random_request(rng, long_model, grammars, adapters) for _ in range(rng.choice([1, 5, 24]))]
            finals = asyncio.run(_send(eng, wave))
            assert all(f.finish_reason in ("length", "stop") for f in finals), [f.error for f in finals if f.error]
        assert COUNTER.builds == builds, "an executable outside the built set was compiled"
        assert runner.compile_waits == 0 and set(runner.executables) == set(enumerated)
    finally:
        eng.shutdown()


async def _send(eng, requests):
    async def one(i, prompt, params, adapter):
        finals = []
        async for d in eng.generate(f"mix-{i}-{random.random()}", prompt, params, adapter=adapter):
            if d.finished:
                finals.append(d)
        return finals

    results = await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    return [f for fs in results for f in fs]
