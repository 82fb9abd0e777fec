"""Rotary position embeddings: inverse frequencies for the rope_scaling types HF models use.

Rotation uses the HF ("rotate half") layout; GGUF's interleaved layout is undone at load time.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig


def inv_freq_and_scale(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inverse frequencies [head_dim/2], cos/sin scaling factor)."""
    dim = cfg.head_dim
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
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")


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
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]
    return out.astype(x.dtype)
