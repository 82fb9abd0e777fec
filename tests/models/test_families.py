"""Families beyond the Llama layout served end to end: the engine's batched greedy tokens equal
transformers' on the same random tiny weights (parity of logits is in test_model_parity)."""

import asyncio
import random

import numpy as np
import pytest
import torch
from tiny_models import make_hf_model, served_hf_dir

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.models.loader import load_model

SMALL = dict(block_size=16, decode_row_buckets=(1, 2, 4), prefill_token_buckets=(32, 64), max_num_seqs=4,
             max_num_batched_tokens=64, num_kv_blocks=32)


@pytest.mark.parametrize("variant", ["phi3", "phi3-longrope", "gemma3"])
def test_served_greedy_tokens_equal_transformers(variant, tiny_model, kiln_cache, tmp_path):
    """Phi-3 (fused projections split at load; a 24-token sliding window, or LongRoPE on half of
    each head's dims, crossing its 64-token pretraining length while decoding) and Gemma 3 (a
    windowed layer and a global one)."""
    hf = make_hf_model(variant, vocab_size=260, seed=11)
    model = load_model(served_hf_dir(variant, tmp_path / variant, kiln_cache, seed=11), show_progress=False)
    rng = np.random.RandomState(5)
    prompts = [list(rng.randint(3, 250, size=n)) for n in (9, 40, 30)]
    new = 40
    engine = AsyncEngine(model, EngineConfig(**SMALL))
    try:
        greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

        async def one(i, p):
            ids = []
            async for d in engine.generate(f"{variant}-{i}-{random.random()}", p, greedy):
                ids += d.token_ids
            return ids

        async def every():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        served = asyncio.run(every())
    finally:
        engine.shutdown()
    for p, ids in zip(prompts, served, strict=True):
        assert ids == reference_greedy(hf, p, new)


def reference_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' forward, one cached call per token. (Its `generate` drifts
    from its own forward by about 2e-3 in the logits a few tokens after LongRoPE switches to the
    long factors, in transformers 5.)"""
    out, ids = [], torch.tensor([prompt])
    cache = None
    with torch.no_grad():
        for _ in range(n):
            step = hf(ids, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out
