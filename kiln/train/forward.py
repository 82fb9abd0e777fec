"""The training forward: the decoder's own layer over dense causal batches, no KV pool.

Serving runs `decoder.decoder_layer` over the paged pool; training runs the same function
with dense causal attention over right-padded rows [B, S]. LoRA params are the trainable
pytree {module: {"a": [L, in, r], "b": [L, r, out]}} (Kiln's adapter layout, the one the
store and the serving slots use) applied to the frozen base params, which are the very arrays
the server holds: nothing is copied.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models import rope
from kiln.models.config import ModelConfig
from kiln.models.decoder import (
    decoder_layer,
    embed_tokens,
    experts_mlp,
    layer_dtype,
    logits,
    matmul,
    rms_norm,
    router_top_k,
    softcap,
)
from kiln.models.lora import TARGET_MODULES, experts_axis, lora_delta, module_shapes

_MASKED = -1e30  # finite, so a fully masked (padding) row gives uniform weights, never NaN


def init_lora(cfg: ModelConfig, rank: int, modules=TARGET_MODULES, seed: int = 0) -> dict:
    """Fresh LoRA params as PEFT initialises them: A ~ U(+-1/sqrt(in)) (Kaiming-uniform with
    a = sqrt(5)), B = 0, so training starts from the base model exactly. float32."""
    key = jax.random.PRNGKey(seed)
    params = {}
    shapes = module_shapes(cfg)
    for i, module in enumerate(modules):
        if module not in shapes:  # e.g. the MLP's projections of a mixture of experts
            continue
        fan_in, fan_out = shapes[module]
        lead = (cfg.num_layers, *experts_axis(cfg, module))  # an expert's A as PEFT initialises each
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (*lead, fan_in, rank), jnp.float32, -bound, bound)
        params[module] = {"a": a, "b": jnp.zeros((*lead, rank, fan_out), jnp.float32)}
    return params


def lora_to_numpy(lora: dict) -> dict[str, dict[str, np.ndarray]]:
    """The LoRA params whole on the host; of arrays split over processes, gathered from every process
    (a collective: each process calls this)."""
    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x, np.float32)

    return {m: {k: host(v) for k, v in parts.items()} for m, parts in lora.items()}


def _dense_attention(q, k, v, visible, cfg: ModelConfig, sinks=None):
    """q: [B*S, H, D]; k, v: [B*S, KH, D]; visible: [B, S, S] (query, key); sinks: [H] or None (see
    decoder._attention). Returns [B*S, H, D]."""
    B, S = visible.shape[:2]
    KH, D = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // KH
    q = q.reshape(B, S, KH, G, D)
    k, v = k.reshape(B, S, KH, D), v.reshape(B, S, KH, D)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * cfg.attention_scale
    scores = softcap(scores, cfg.attn_logit_softcapping)
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    if sinks is not None:  # one more logit per head, whose probability is dropped
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, KH, G, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B * S, KH * G, D)


class LayerContext(NamedTuple):
    """What every layer of a dense causal batch [B, S] reads besides its weights."""

    tables: Any  # the layers' RoPE tables (decoder.layer_rope picks a layer's)
    visible: jax.Array  # [B, S, S] (query, key): causal, windowed where every layer is
    windowed: jax.Array | None  # [B, S, S]: the windowed layers' where layers differ (Gemma 3)
    token_weight: jax.Array  # [T, 1]: the LoRA scale of every token (one adapter)
    valid: jax.Array  # [T]: real tokens (not padding)


def layer_context(valid: jax.Array, cfg: ModelConfig, scale: float) -> LayerContext:
    B, S = valid.shape
    positions = jnp.tile(jnp.arange(S, dtype=jnp.int32), B)
    tables = rope.layer_tables(cfg, positions)
    q_pos, k_pos = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    causal = k_pos <= q_pos
    window = (k_pos > q_pos - cfg.sliding_window) if cfg.sliding_window else None
    windowed = None
    if window is not None and cfg.sliding_layers is None:
        causal &= window
    elif window is not None:
        windowed = (causal & window)[None] & valid[:, None, :]
    return LayerContext(tables, causal[None] & valid[:, None, :], windowed,
                        jnp.full((B * S, 1), scale, jnp.float32), valid.reshape(-1))


def embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The float32 residual stream [B*S, hidden] of token rows [B, S]."""
    return embed_tokens(params, tokens.reshape(-1), cfg)


def train_layer(h: jax.Array, layer: dict, lora_layer: dict | None, ctx: LayerContext, cfg: ModelConfig,
                base=None, router_stats: bool = False):
    """One decoder layer (the serving layer, attending densely). `base(x, w, name)` computes a
    projection's frozen part x @ w; the LoRA delta is added to it (kiln.train.slices replays
    saved base products through it). With `router_stats` (a mixture of experts) it returns
    (h, the layer's `router_statistics`)."""
    lora_g1 = None if lora_layer is None else {m: {k: w[None] for k, w in p.items()} for m, p in lora_layer.items()}

    def frozen(x, name):
        return matmul(x, layer[name], layer_dtype(layer)) if base is None else base(x, layer[name], name)

    def delta(x, name):
        return None if lora_g1 is None or name not in lora_g1 else lora_delta(x, lora_g1[name], ctx.token_weight)

    def attend(q, k, v, sliding):
        visible = ctx.visible if sliding is None else jnp.where(sliding, ctx.windowed, ctx.visible)
        with jax.named_scope("attention"):
            return _dense_attention(q, k, v, visible, cfg, layer.get("sinks")), None

    seen = []

    def experts(x, layer, cfg):
        if router_stats:
            seen.append(router_statistics(x, layer, ctx.valid, cfg))
        return experts_mlp(x, layer, cfg, lora=lora_g1, token_weight=ctx.token_weight)

    h = decoder_layer(h, layer, frozen, delta, ctx.tables, attend, cfg, experts)[0]
    return (h, seen[0]) if router_stats else h


def router_statistics(x: jax.Array, layer: dict, valid: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[2, experts]: how many real tokens picked each expert among their top k, and the sum of the
    router's probabilities for each expert over real tokens (what the load-balancing loss reads)."""
    probs, _, chosen = router_top_k(x, layer, cfg)
    mask = valid.astype(jnp.float32)[:, None]
    picks = jax.nn.one_hot(chosen, cfg.num_experts, dtype=jnp.float32).sum(axis=1)
    return jnp.stack([jnp.sum(picks * mask, axis=0), jnp.sum(probs * mask, axis=0)])


def load_balancing_loss(stats: jax.Array, valid_tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The Switch Transformer's auxiliary loss as transformers computes it for Mixtral and Qwen3-MoE
    over all layers' real tokens together: experts x sum over experts of (the fraction of picks
    that went to it) x (its mean router probability). `stats`: the layers' `router_statistics`
    summed; `valid_tokens`: real tokens in the batch."""
    n = jnp.maximum(valid_tokens * cfg.num_layers, 1.0)
    return cfg.num_experts * jnp.sum((stats[0] / n) * (stats[1] / n))


def forward_hidden(params: dict, lora: dict | None, tokens: jax.Array, valid: jax.Array, cfg: ModelConfig,
                   scale: float = 1.0, remat: bool = False, router_stats: bool = False):
    """Final-normed hidden states [B*S, hidden] of right-padded rows tokens [B, S] (valid: [B, S]).

    `remat` recomputes each layer's activations in the backward pass (`jax.checkpoint`):
    activation memory of one layer instead of all of them. With `router_stats` (a mixture of
    experts) it returns (hidden, the layers' router statistics summed, see `load_balancing_loss`)."""
    h = embed(params, tokens, cfg)
    ctx = layer_context(valid, cfg, scale)

    def layer_fn(h, layer, lora_layer):  # -> (h, the layer's router statistics or None)
        out = train_layer(h, layer, lora_layer, ctx, cfg, router_stats=router_stats)
        return out if router_stats else (out, None)

    if remat:
        layer_fn = jax.checkpoint(layer_fn)
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        stats = []
        for i, layer in enumerate(layers):
            lora_layer = None if lora is None else jax.tree.map(lambda w, i=i: w[i], lora)
            h, s = layer_fn(h, layer, lora_layer)
            stats.append(s)
        stats = sum(stats) if router_stats else None
    else:
        h, stats = jax.lax.scan(lambda h, xs: layer_fn(h, *xs), h, (layers, lora))
        stats = stats.sum(axis=0) if router_stats else None
    hidden = rms_norm(h, params["final_norm"], cfg)
    return (hidden, stats) if router_stats else hidden


def forward_logits(params: dict, lora: dict | None, tokens: jax.Array, valid: jax.Array, cfg: ModelConfig,
                   scale: float = 1.0, remat: bool = False) -> jax.Array:
    """float32 logits [B, S, vocab]."""
    B, S = tokens.shape
    hidden = forward_hidden(params, lora, tokens, valid, cfg, scale, remat)
    return logits(params, hidden, cfg, training=True).reshape(B, S, -1)
