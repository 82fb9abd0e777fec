"""The functional Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Everything here is a pure function of pytrees. Layer params are either stacked on a leading
layer axis, run under `lax.scan` (compile time flat in depth), or one dict per layer, run
unrolled (see `loader.default_layer_loop`). `decoder_layer` is the one layer both serving
(here, over the paged pool) and training (`kiln.train.forward`, dense) run.

One step takes a flat batch of T tokens that belong to S rows (sequences). Each row
brings new tokens (one for decode, a chunk for prefill) whose K/V are scattered into
the paged pool; attention then reads the row's blocks through its block table and
masks keys by position, so prefill chunks and decode rows share one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kiln.models import rope
from kiln.models.config import ModelConfig
from kiln.models.lora import active_lora, active_weights, lora_delta

Params = dict


class KVCache(NamedTuple):
    """Paged K/V pool: [layers, num_blocks, block_size, kv_heads, head_dim] each.

    A 16-bit float pool is held as its uint16 bits: XLA:CPU widens the whole operand of a
    16-bit float scatter to float32 and back (every layer, every step), while an integer
    scatter updates in place. Its float type is the model's (`kv_float_dtype`)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


class StepInputs(NamedTuple):
    """Fixed-shape inputs of one step; the engine pads each field to a shape bucket.

    tokens, positions, slots, token_rows: [T]. slots is the flat pool slot
    (block * block_size + offset) each token's K/V goes to; padding tokens use slot 0,
    in block 0, which the block pool never hands out (every index stays in bounds: IREE's
    scatters do not drop out-of-range updates).
    query_index: [S, Q] flat token index of each row's q-th new token (T for padding).
    block_tables: [S, max_blocks]. adapter_slots: [S] (0 = no adapter).
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    token_rows: jax.Array
    query_index: jax.Array
    block_tables: jax.Array
    adapter_slots: jax.Array


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    storage = jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else dtype  # zero bits are 0.0
    return KVCache(jnp.zeros(shape, storage), jnp.zeros(shape, storage))


def kv_float_dtype(kv: KVCache, params: Params):
    """The float type of the pool's values: its own, or for uint16 bits the model's 16-bit type."""
    return params["embed"].dtype if kv.k.dtype == jnp.uint16 else kv.k.dtype


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _as_operand(x: jax.Array, w: jax.Array) -> jax.Array:
    """x cast to w's dtype; a single row against a 16-bit weight gets a zero second row, because
    XLA:CPU multiplies one 16-bit row several times slower than two."""
    if x.shape[0] == 1 and w.dtype.itemsize == 2:
        x = jnp.pad(x, ((0, 1), (0, 0)))
    return x.astype(w.dtype)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in w's dtype with float32 accumulation and result: activations stay float32 and a
    bfloat16 weight is read as is (XLA:CPU multiplies bfloat16 operands into float32 fast, while
    mixed or all-bfloat16 products take slow paths)."""
    return jnp.matmul(_as_operand(x, w), w, preferred_element_type=jnp.float32)[: x.shape[0]]


def project(x, layer, lora_layer, name, token_weight):
    """x @ layer[name], plus the LoRA delta of the active adapters (see `lora.lora_delta`)."""
    out = matmul(x, layer[name])
    if lora_layer is not None and name in lora_layer:
        out = out + lora_delta(x, lora_layer[name], token_weight)
    return out


def _write_kv(pool: jax.Array, layer_idx, blocks: jax.Array, offsets: jax.Array, new: jax.Array, dtype) -> jax.Array:
    """pool[layer, block, offset] = new, in place (as bits for a uint16 pool of `dtype` values)."""
    new = new.astype(dtype)
    if pool.dtype == jnp.uint16:
        new = jax.lax.bitcast_convert_type(new, jnp.uint16)
    return pool.at[layer_idx, blocks, offsets].set(new, mode="drop")


class _AttentionPlan(NamedTuple):
    """Per-step attention indexing, shared by all layers."""

    query_gather: jax.Array  # [S, Q] token index to read each row's queries from
    query_scatter: jax.Array  # [S*Q] token index to write outputs to (T = dropped)
    valid_query: jax.Array  # [S, Q]
    visible: jax.Array  # [S, Q, C] key visibility (causal by position, sliding window)


def _attention_plan(inputs: StepInputs, block_size: int, cfg: ModelConfig) -> _AttentionPlan:
    T = inputs.tokens.shape[0]
    valid = inputs.query_index < T
    gather = jnp.where(valid, inputs.query_index, 0)
    q_pos = jnp.where(valid, inputs.positions[gather], -1)
    key_pos = jnp.arange(inputs.block_tables.shape[1] * block_size)
    visible = key_pos[None, None, :] <= q_pos[:, :, None]
    if cfg.sliding_window:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - cfg.sliding_window
    scatter = jnp.where(valid, inputs.query_index, T).reshape(-1)
    return _AttentionPlan(gather, scatter, valid, visible)


def _gather_blocks(pool: jax.Array, layer_idx, block_tables: jax.Array, dtype) -> jax.Array:
    """pool[layer_idx][block_tables] as a row gather of flattened blocks (measured ~2x faster on XLA:CPU)."""
    L, N = pool.shape[:2]
    layer = jax.lax.dynamic_index_in_dim(pool.reshape(L, N, -1), layer_idx, keepdims=False)
    blocks = jnp.take(layer, block_tables, axis=0, mode="clip")
    return jax.lax.bitcast_convert_type(blocks, dtype) if pool.dtype == jnp.uint16 else blocks


def _attention(q, k_all, v_all, layer_idx, inputs: StepInputs, plan: _AttentionPlan, cfg: ModelConfig, kv_dtype):
    """Portable XLA paged attention. q: [T, H, D]; caches: [L, N, B, KH, D]. Returns [T, H, D].

    Gathers only the rows' blocks of this layer (one gather, no copy of the layer's pool).
    """
    T = q.shape[0]
    S, Q = inputs.query_index.shape
    KH, D = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // KH
    C = inputs.block_tables.shape[1] * k_all.shape[2]
    # batched matmuls over (row, kv head); the G query heads of a group share K/V (GQA)
    q_rows = q[plan.query_gather].reshape(S, Q, KH, G, D).transpose(0, 2, 3, 1, 4).reshape(S * KH, G * Q, D)
    k = _gather_blocks(k_all, layer_idx, inputs.block_tables, kv_dtype).reshape(S, C, KH, D)
    v = _gather_blocks(v_all, layer_idx, inputs.block_tables, kv_dtype).reshape(S, C, KH, D)
    k = k.transpose(0, 2, 3, 1).reshape(S * KH, D, C)
    v = v.transpose(0, 2, 1, 3).reshape(S * KH, C, D)
    scores = jax.lax.batch_matmul(q_rows, k.astype(q_rows.dtype), precision=None).astype(jnp.float32)
    scores = scores.reshape(S, KH, G, Q, C) * (D**-0.5)
    scores = jnp.where(plan.visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(plan.valid_query[:, None, None, :, None], probs, 0.0).astype(q.dtype)
    out = jax.lax.batch_matmul(probs.reshape(S * KH, G * Q, C), v.astype(q.dtype))  # [S*KH, G*Q, D]
    out = out.reshape(S, KH, G, Q, D).transpose(0, 3, 1, 2, 4).reshape(S * Q, KH * G, D)
    # padding queries land in an extra row T, cut off after: every scatter index stays in bounds
    return jnp.zeros((T + 1, KH * G, D), q.dtype).at[plan.query_scatter].set(out.astype(q.dtype))[:T]


def decoder_layer(h: jax.Array, layer: dict, proj: Callable, cos, sin, attend: Callable, cfg: ModelConfig):
    """One pre-norm transformer layer over the float32 residual stream h [T, hidden].

    proj(x, name) applies the layer's projection `name` (with any LoRA); attend(q, k, v), given
    roped q [T, H, D] and k, v [T, KH, D], returns (attention output [T, H, D], aux). Serving
    attends through the paged KV pool (aux: the updated pool), training attends densely.
    Returns (h, aux)."""
    T = h.shape[0]
    H, KH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    with jax.named_scope("qkv"):
        x = rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps)
        q, k, v = proj(x, "q_proj"), proj(x, "k_proj"), proj(x, "v_proj")
        if cfg.attention_bias:
            q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
        q, k, v = q.reshape(T, H, D), k.reshape(T, KH, D), v.reshape(T, KH, D)
        if cfg.qk_norm:
            q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    attn, aux = attend(q, k, v)
    with jax.named_scope("o_proj"):
        h = h + proj(attn.astype(h.dtype).reshape(T, H * D), "o_proj")
    with jax.named_scope("mlp"):
        x = rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps)
        gated = jax.nn.silu(proj(x, "gate_proj")) * proj(x, "up_proj")
        h = h + proj(gated, "down_proj")
    return h, aux


def forward_hidden(
    params: Params,
    kv: KVCache,
    inputs: StepInputs,
    cfg: ModelConfig,
    lora: dict | None = None,
    unroll: int | bool = 1,
) -> tuple[jax.Array, KVCache]:
    """Runs the decoder; returns final-normed hidden states [T, hidden] and the updated cache."""
    inputs = StepInputs(*(jnp.asarray(x) for x in inputs))
    block_size = kv.block_size
    kv_dtype = kv_float_dtype(kv, params)
    plan = _attention_plan(inputs, block_size, cfg)
    h = params["embed"][inputs.tokens].astype(jnp.float32)  # the residual stream is float32 whatever the weights
    inv_freq, rope_scale = rope.inv_freq_and_scale(cfg)
    cos, sin = rope.cos_sin(inputs.positions, jnp.asarray(inv_freq), rope_scale)
    blocks = inputs.slots // block_size  # out-of-range slots give block >= num_blocks: dropped
    offsets = inputs.slots % block_size

    token_weight = lora_index = None
    if lora is not None:
        token_weight, lora_index = active_lora(lora, inputs.adapter_slots[inputs.token_rows], h.dtype)

    def layer_fn(carry, xs):
        h, k_all, v_all, idx = carry
        layer, lora_layer = xs

        def paged_attention(q, k, v):
            with jax.named_scope("kv_write"):
                k_pool = _write_kv(k_all, idx, blocks, offsets, k, kv_dtype)
                v_pool = _write_kv(v_all, idx, blocks, offsets, v, kv_dtype)
            with jax.named_scope("attention"):
                return _attention(q, k_pool, v_pool, idx, inputs, plan, cfg, kv_dtype), (k_pool, v_pool)

        proj = lambda x, name: project(x, layer, lora_layer, name, token_weight)  # noqa: E731
        h, (k_all, v_all) = decoder_layer(h, layer, proj, cos, sin, paged_attention, cfg)
        return (h, k_all, v_all, idx + 1), None

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):  # one array per layer: unrolled, no per-layer weight slicing
        carry = (h, kv.k, kv.v, 0)
        for i, layer in enumerate(layers):
            lora_layer = None if lora is None else active_weights(lora["layers"], lora_index, i)
            carry, _ = layer_fn(carry, (layer, lora_layer))
        h, k_all, v_all, _ = carry
    else:
        lora_layers = None if lora is None else active_weights(lora["layers"], lora_index)
        (h, k_all, v_all, _), _ = jax.lax.scan(layer_fn, (h, kv.k, kv.v, jnp.int32(0)), (layers, lora_layers),
                                               unroll=unroll)
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), KVCache(k_all, v_all)


def logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Vocabulary logits in float32 for hidden states [T, hidden]."""
    head = params.get("lm_head")
    if head is not None:
        return matmul(hidden, head)
    embed = params["embed"]
    out = jnp.einsum("th,vh->tv", _as_operand(hidden, embed), embed, preferred_element_type=jnp.float32)
    return out[: hidden.shape[0]]


def forward(params, kv, inputs, cfg, lora=None, unroll=1):
    """Logits for every token [T, vocab] and the updated cache (tests, prompt logprobs)."""
    hidden, kv = forward_hidden(params, kv, inputs, cfg, lora, unroll)
    return logits(params, hidden), kv
