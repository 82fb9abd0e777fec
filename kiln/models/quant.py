"""Weight-only quantization: the layers' linear weights held as int8 or int4 in groups of 32 input
rows, each group with float32 scales per output channel (and, for int4, offsets), dequantized inside
the compiled step. GGUF's Q8_0, Q4_0 and Q4_1 blocks are exactly these groups, so a GGUF file's
layers load as stored (`gguf_loader.GGUFModel.stored_layers`).

A quantized weight is a pytree (`Int8Weight`, `Int4Weight`), so it stacks on the layer axis, slices
per layer and passes through `lax.scan` like the float array it replaces; `decoder.matmul`
multiplies any of them. The norms, biases, the embedding table and the LM head stay in the model's
float type (a tied head is the embedding table itself, so it costs nothing more).

Groups, not one scale per output channel: the default model's weights have outlier input rows, and
a channel's scale set by its largest weight left int8 agreeing with float32 on 68% of greedy picks
(bench/quantized_accuracy.py); per group it is the weights' own resolution.

On XLA:CPU this is a memory format and a speed-up for few rows (the default model's weights: 513
MiB as float32, 210 MiB with int8 layers, 184 MiB with int4; one row decodes about 1.3x faster with
int4 layers and 1.4x with int8, bench/model_step.py --quantization none,int8,int4), provided each
dequantization runs next to its multiply, which kiln.xla_flags asks of XLA's scheduler. Layers run
under `lax.scan` (loader): one layer's float32 copy at a time stays in cache, where unrolled
layers' copies are the whole model's temporaries. The LM head stays float: one matrix of the
vocabulary's size dequantizes into a temporary as large as the float32 head (mapped afresh at every
step). On GPUs XLA fuses the dequantize into the matrix multiply, where int8 and int4 read a quarter
and an eighth of float32's bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.errors import ConfigError

QUANTIZATIONS = ("none", "int8", "int4")  # and "auto" (kiln.models.loader): a GGUF file's own
GROUP = 32  # input rows per scale (and offset): GGUF's Q8_0/Q4_0/Q4_1 block
# the projections a layer multiplies by: what is quantized (norms, biases and q/k norms stay float)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Int8Weight(NamedTuple):
    """w [..., in, out] ≈ q * scale, one scale per group of `in` rows and output channel (a single
    group: one scale per output channel)."""

    q: jax.Array  # int8 [..., in, out]
    scale: jax.Array  # float32 [..., in / group, out]


def quantize_int8(w: np.ndarray, group: int = GROUP) -> Int8Weight:
    """Symmetric int8 per group of `group` input rows (all of them where `group` does not divide
    them): scale = the group's max|w| / 127, as GGUF's Q8_0."""
    w = np.asarray(w, np.float32)
    *lead, n_in, n_out = w.shape
    group = group if n_in % group == 0 else n_in
    g = w.reshape(*lead, n_in // group, group, n_out)
    scale = np.abs(g).max(axis=-2) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)  # an all-zero group stays zero
    q = np.clip(np.rint(g / scale[..., None, :]), -127, 127).astype(np.int8)
    return Int8Weight(q.reshape(w.shape), scale)


class Int4Weight(NamedTuple):
    """w [..., in, out] ≈ q * scale + offset, q in 0..15, one scale and offset per group of `in` rows
    and output channel; two q per byte along `in` (row 2j in the low nibble, 2j + 1 in the high)."""

    packed: jax.Array  # uint8 [..., in / 2, out]
    scale: jax.Array  # float32 [..., in / group, out]
    offset: jax.Array  # float32 [..., in / group, out]


def quantize_int4(w: np.ndarray, group: int = GROUP) -> Int4Weight:
    """Asymmetric int4 per group of `group` input rows (GGUF's Q4_1): the group's range over 15 steps."""
    w = np.asarray(w, np.float32)
    *lead, n_in, n_out = w.shape
    g = w.reshape(*lead, n_in // group, group, n_out)
    lo, hi = g.min(axis=-2), g.max(axis=-2)
    scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None, :]) / scale[..., None, :]), 0, 15).astype(np.uint8)
    return int4_from_levels(q.reshape(w.shape), scale, lo.astype(np.float32))


def int4_from_levels(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> Int4Weight:
    """Packs levels q [..., in, out] (0..15) with their group scales and offsets."""
    return Int4Weight(q[..., 0::2, :] | (q[..., 1::2, :] << 4), scale, offset)


def _int4_levels(packed: np.ndarray) -> np.ndarray:
    """The 0..15 levels [..., in, out] of packed nibbles."""
    both = np.stack([packed & 15, packed >> 4], axis=-2)  # [..., in / 2, 2, out]
    return both.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])


def _grouped(q, scale, offset=None):
    """float [..., in, out] of levels q (already float) by their groups' scales (and offsets)."""
    *lead, n_in, n_out = q.shape
    groups = scale.shape[-2]
    q = q.reshape(*lead, groups, n_in // groups, n_out) * scale[..., None, :]
    if offset is not None:
        q = q + offset[..., None, :]
    return q.reshape(*lead, n_in, n_out)


def dequantize(w: Int8Weight | Int4Weight) -> np.ndarray:
    w = jax.tree.map(np.asarray, w)
    if isinstance(w, Int4Weight):
        return _grouped(_int4_levels(w.packed).astype(np.float32), w.scale, w.offset)
    return _grouped(w.q.astype(np.float32), w.scale)


def matmul(x: jax.Array, w: Int8Weight | Int4Weight) -> jax.Array:
    """x [T, in] @ w in float32, the weight dequantized inside the step (an elementwise op XLA fuses).
    int8 with one group applies its scale to the product (one multiply per output, not per weight);
    int4 dequantizes each nibble's rows and multiplies them by the matching (even or odd) columns of
    x: unpacking both nibbles into one interleaved matrix first is 3x slower on XLA:CPU."""
    x = x.astype(jnp.float32)
    if isinstance(w, Int4Weight):
        even, odd = (_grouped(levels.astype(jnp.float32), w.scale, w.offset) for levels in
                     (w.packed & 15, w.packed >> 4))
        return _dot(x[:, 0::2], even) + _dot(x[:, 1::2], odd)
    if w.scale.shape[-2] == 1:
        return _dot(x, w.q.astype(jnp.float32)) * w.scale[0]
    return _dot(x, _grouped(w.q.astype(jnp.float32), w.scale))


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def quantize_params(params: dict, quantization: str) -> dict:
    """The host (numpy) param tree with its layers' linear weights in `quantization`'s format."""
    if quantization == "none":
        return params
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"model.quantization: unknown value {quantization!r}; choose one of {QUANTIZATIONS}")
    if quantization == "int4":
        for name, w in params["layers"].items():
            if name in LINEAR and not is_quantized(w) and (n_in := w.shape[-2]) % GROUP:
                raise ConfigError(f"model.quantization = int4: {name} has {n_in} input rows, which groups of "
                                  f"{GROUP} do not divide; use int8 or none")
    quantize = quantize_int4 if quantization == "int4" else quantize_int8
    layers = {name: quantize(w) if name in LINEAR and not is_quantized(w) else w
              for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def is_quantized(w) -> bool:
    return isinstance(w, (Int8Weight, Int4Weight))
