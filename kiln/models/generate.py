"""Jitted prefill/decode steps and a small batched greedy generator over the paged cache.

The serving engine builds on the same step; this module is what tests and benchmarks
use to drive the model directly. Only the sampled ids leave the device each step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.config import ModelConfig
from kiln.models.decoder import KVCache, StepInputs, float_dtype, forward_hidden, init_kv_cache, logits


@functools.partial(jax.jit, static_argnames=("cfg", "unroll"), donate_argnames=("kv",))
def greedy_step(params, kv: KVCache, inputs: StepInputs, cfg: ModelConfig, lora=None, unroll=1):
    """One step (one tile per row): writes the new tokens' K/V and returns each row's greedy next token."""
    hidden, kv = forward_hidden(params, kv, inputs, cfg, lora, unroll)
    T = inputs.tokens.shape[0]
    # the last new token of each row (one tile per row): the largest valid query index
    last = jnp.max(jnp.where(inputs.tile_tokens < T, inputs.tile_tokens, -1), axis=1)
    row_logits = logits(params, hidden[jnp.maximum(last, 0)], cfg)
    return jnp.argmax(row_logits, axis=-1).astype(jnp.int32), kv


def greedy_generate(
    params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    lora=None,
    adapter_slots: list[int] | None = None,
    unroll: int | bool = 1,
) -> list[list[int]]:
    """Greedy continuation of each prompt (no early stop): prefill all rows, then batched decode."""
    n = len(prompts)
    blocks_per_row = math.ceil((max(map(len, prompts)) + max_new_tokens) / block_size)
    num_blocks = n * blocks_per_row
    dtype = float_dtype(params)
    kv = init_kv_cache(cfg, num_blocks, block_size, dtype)
    tables = [list(range(i * blocks_per_row, (i + 1) * blocks_per_row)) for i in range(n)]
    slots = adapter_slots or [0] * n
    rows = [RowWork(list(p), 0, tables[i], slots[i]) for i, p in enumerate(prompts)]
    inputs = build_step_inputs(rows, block_size)
    nxt, kv = greedy_step(params, kv, inputs, cfg, lora, unroll)
    out = [[int(t)] for t in np.asarray(nxt)]
    lengths = [len(p) for p in prompts]
    for _ in range(max_new_tokens - 1):
        rows = [RowWork([out[i][-1]], lengths[i] + len(out[i]) - 1, tables[i], slots[i]) for i in range(n)]
        nxt, kv = greedy_step(params, kv, build_step_inputs(rows, block_size), cfg, lora, unroll)
        for i, t in enumerate(np.asarray(nxt)):
            out[i].append(int(t))
    return out
