"""Weight-only quantization: the layers' linear weights held as int8 with one float32 scale per output
channel, dequantized inside the compiled step.

A quantized weight is a pytree (`Int8Weight`), so it stacks on the layer axis, slices per layer and
passes through `lax.scan` like the float array it replaces; `decoder.matmul` multiplies either. The
norms, biases, the embedding table and the LM head stay in the model's float type (a tied head is
the embedding table itself, so it costs nothing more).

On XLA:CPU this is a memory format first (the default model's weights: 513 MiB as float32, 210 MiB
with int8 layers); its decode speed is float32's within this machine's noise (bench/model_step.py
--quantization none,int8). XLA:CPU converts an int8 operand inside a step well only for matrices
sliced out of a stacked layer axis: a single large matrix is pathologically slow (the LM head, 16x
slower than float32 for one row, bench/quantized_matmul.py), and so are unrolled layers (7x), which
is why the head stays float and a quantized model's layers run under `lax.scan` (loader). On GPUs
XLA fuses the conversion into the matrix multiply, where int8 reads a quarter of float32's bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.errors import ConfigError

QUANTIZATIONS = ("none", "int8")
# the projections a layer multiplies by: what int8 quantizes (norms, biases and q/k norms stay float)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Int8Weight(NamedTuple):
    """w [..., in, out] ≈ q * scale, scale per output channel (over the `in` axis)."""

    q: jax.Array  # int8 [..., in, out]
    scale: jax.Array  # float32 [..., out]


def quantize_int8(w: np.ndarray) -> Int8Weight:
    """Symmetric int8 per output channel: scale = max|w| / 127 over the input axis (-2)."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=-2) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)  # an all-zero channel stays zero
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return Int8Weight(q, scale)


def dequantize(w: Int8Weight) -> np.ndarray:
    return np.asarray(w.q, np.float32) * np.asarray(w.scale)[..., None, :]


def matmul(x: jax.Array, w: Int8Weight) -> jax.Array:
    """x [T, in] @ w in float32: the int8 operand converted inside the step, the scale applied to the
    product (one multiply per output instead of one per weight)."""
    return jnp.matmul(x.astype(jnp.float32), w.q.astype(jnp.float32), preferred_element_type=jnp.float32) * w.scale


def quantize_params(params: dict, quantization: str) -> dict:
    """The host (numpy) param tree with its layers' linear weights in `quantization`'s format."""
    if quantization == "none":
        return params
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"model.quantization: unknown value {quantization!r}; choose one of {QUANTIZATIONS}")
    layers = {name: quantize_int8(w) if name in LINEAR else w for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def is_quantized(w) -> bool:
    return isinstance(w, Int8Weight)
