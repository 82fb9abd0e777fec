"""Rotary position embeddings: inverse frequencies for the rope_scaling types HF models use.

Rotation uses the HF ("rotate half") layout; GGUF's interleaved layout is undone at load time.
With a partial_rotary_factor below 1 only the first `rotary_dim` dims of each head rotate.

LongRoPE (Phi-3) has two sets of frequencies: short ones for positions before the pretraining
length (original_max_position_embeddings) and long ones from there on, chosen per token. That
is what transformers computes for every sequence that stays within that length and for every
token decoded past it; a single forward pass over a prompt that crosses it rotates the whole
prompt with the long set there, and here the tokens before that length keep the short set (as
a cached prefix of the prompt would have them).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig


def inv_freq_and_scale(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inverse frequencies [rotary_dim/2], cos/sin scaling factor); LongRoPE's short set.
    A GGUF file's per-frequency factors (rope_freqs) divide the frequencies, as llama.cpp applies them."""
    inv_freq, scale = _scaled_inv_freq(cfg)
    if cfg.rope_freq_factors:
        inv_freq = (inv_freq / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    return inv_freq, scale


def _scaled_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    rs = cfg.rope_scaling_dict
    if rs is None:
        return inv_freq, 1.0
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / float(rs["factor"]), 1.0
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(cfg, rs, dim, base)
    if kind == "longrope":
        return _longrope(cfg, rs, long=False)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn, longrope")


def _longrope(cfg: ModelConfig, rs: dict, long: bool) -> tuple[np.ndarray, float]:
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or cfg.max_position_embeddings / original
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rs["long_factor" if long else "short_factor"], np.float32)
    dim = cfg.rotary_dim
    inv = 1.0 / (ext * cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    return inv.astype(np.float32), float(attention_factor)


def layer_tables(cfg: ModelConfig, positions: jnp.ndarray):
    """What every layer's rotary embedding is chosen from: one (cos, sin) pair, or for models whose
    windowed layers have a RoPE base of their own (Gemma 3) the (global, local) pairs."""
    if cfg.sliding_layers is None:
        return tables(cfg, positions)
    if cfg.local_rope_theta is None:  # windowed layers rotate as the global ones (Gemma 2, gpt-oss)
        pair = tables(cfg, positions)
        return pair, pair
    local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta or cfg.rope_theta, rope_scaling=None)
    return tables(cfg, positions), tables(local, positions)


def tables(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables [..., rotary_dim] of the model's rotary embedding at these positions."""
    inv_freq, scale = inv_freq_and_scale(cfg)
    cos, sin = cos_sin(positions, jnp.asarray(inv_freq), scale)
    rs = cfg.rope_scaling_dict
    if rs and rs["rope_type"] == "longrope":
        long_freq, _ = _longrope(cfg, rs, long=True)
        long_cos, long_sin = cos_sin(positions, jnp.asarray(long_freq), scale)
        past = (positions >= rs["original_max_position_embeddings"])[..., None]
        cos, sin = jnp.where(past, long_cos, cos), jnp.where(past, long_sin, sin)
    return cos, sin


def _yarn(cfg: ModelConfig, rs: dict, dim: int, base: float) -> tuple[np.ndarray, float]:
    orig_len = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = rs.get("factor") or cfg.max_position_embeddings / orig_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attention_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def cos_sin(positions: jnp.ndarray, inv_freq: jnp.ndarray, scale: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables [..., head_dim] for integer positions, computed in float32."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim] (the dims past it pass unrotated)."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]
    return out.astype(x.dtype)
