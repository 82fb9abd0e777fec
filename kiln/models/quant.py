"""Weight-only quantization: the layers' linear weights held as int8 or int4 in groups of 32 input
rows, each group with a scale per output channel (and, for int4, an offset), dequantized inside
the compiled step. Scales and offsets are float16, GGUF's own width for them, wherever that holds
them exactly (`compact`): in float32 they were a third of an int4 weight's bytes. GGUF's Q8_0,
Q4_0, Q4_1 and Q4_K blocks are exactly these groups, so a GGUF file's layers load as stored
(`gguf_loader.GGUFModel.stored_layers`).

A quantized weight is a pytree (`Int8Weight`, `Int4Weight`), so it stacks on the layer axis, slices
per layer and passes through `lax.scan` like the float array it replaces; `decoder.matmul`
multiplies any of them. The embedding table and an untied LM head are held as tables of rows
(`Int8Table`, or a GGUF file's Q4 blocks as `Int4Table`; a tied head is the embedding table
itself); norms and biases stay in the model's float type.

Groups, not one scale per output channel: the default model's weights have outlier input rows, and
a channel's scale set by its largest weight left int8 agreeing with float32 on 68% of greedy picks
(bench/quantized_accuracy.py); per group it is the weights' own resolution.

On XLA:CPU this is a memory format and a speed-up for few rows (the default model's weights: 513
MiB as float32, 210 MiB with int8 layers, 184 MiB with int4; one row decodes about 1.3x faster with
int4 layers and 1.4x with int8, bench/model_step.py --quantization none,int8,int4), provided each
dequantization runs next to its multiply, which kiln.xla_flags asks of XLA's scheduler. Layers run
under `lax.scan` (loader): one layer's float32 copy at a time stays in cache, where unrolled
layers' copies are the whole model's temporaries. For the same reason the head dequantizes a
chunk of the vocabulary at a time (`table_logits`). On GPUs XLA fuses the dequantize into the
matrix multiply, where int8 and int4 read a quarter and an eighth of float32's bytes. The products
are float32, or for a 16-bit model (`[model] dtype = bfloat16`) in its type from 8 rows, as its
float weights would be (`product_dtype`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.errors import ConfigError
from kiln.kernels import cpu as kernels

QUANTIZATIONS = ("none", "int8", "int4")  # and "auto" (kiln.models.loader): a GGUF file's own
GROUP = 32  # input rows per scale (and offset): GGUF's Q8_0/Q4_0/Q4_1 block
MIN_ROWS_16BIT = 8  # a 16-bit model's quantized multiplies of fewer rows stay float32 (`product_dtype`)
# the projections a layer multiplies by: what is quantized (norms, biases and q/k norms stay float)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# projections of the same input held as one weight, their outputs side by side (`fuse_projections`)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Int8Weight(NamedTuple):
    """w [..., in, out] ≈ q * scale, one scale per group of `in` rows and output channel (a single
    group: one scale per output channel)."""

    q: jax.Array  # int8 [..., in, out]
    scale: jax.Array  # float16 (float32, `compact`) [..., in / group, out]


def quantize_int8(w: np.ndarray, group: int = GROUP) -> Int8Weight:
    """Symmetric int8 per group of `group` input rows (all of them where `group` does not divide
    them): scale = the group's max|w| / 127, as GGUF's Q8_0."""
    w = np.asarray(w, np.float32)
    *lead, n_in, n_out = w.shape
    group = group if n_in % group == 0 else n_in
    g = w.reshape(*lead, n_in // group, group, n_out)
    scale = np.abs(g).max(axis=-2) / 127.0
    scale = _half_rounded(np.where(scale == 0, 1.0, scale).astype(np.float32))  # an all-zero group stays zero
    q = np.clip(np.rint(g / scale[..., None, :]), -127, 127).astype(np.int8)
    return Int8Weight(q.reshape(w.shape), compact(scale))


class Int4Weight(NamedTuple):
    """w [..., in, out] ≈ q * scale + offset, q in 0..15, one scale and offset per group of `in` rows
    and output channel; two q per byte, paired along `in` (row 2j in the low nibble, 2j + 1 in the
    high: packed [..., in / 2, out]) or, for a weight wider than it is deep once loaded
    (`for_matmul`), along `out` (column j in the low nibble, out / 2 + j in the high: packed
    [..., in, out / 2]). The shapes tell the two apart."""

    packed: jax.Array  # uint8 [..., in / 2, out] or [..., in, out / 2]
    scale: jax.Array  # float16 (float32, `compact`) [..., in / group, out]
    offset: jax.Array  # float16 (float32, `compact`) [..., in / group, out]


class LayerOf(NamedTuple):
    """Layer `index` of an int4 weight stacked on a leading layer axis, left in the stack until it is
    multiplied: Kiln's CPU kernel reads the layer in place, where XLA:CPU would first copy the layer's
    slice out of the stack for the custom call (every layer's weights, every step: about a third of a
    one-row decode step of the default model); XLA's path slices it where it multiplies."""

    weight: Int4Weight  # [L, ...]
    index: jax.Array  # int32 scalar

    def layer(self) -> Int4Weight:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.weight)


def _paired_along_out(w: Int4Weight) -> bool:
    return w.packed.shape[-1] != w.scale.shape[-1]


def for_matmul(w: Int4Weight) -> Int4Weight:
    """The layout `matmul` multiplies fastest. Each nibble multiplies apart (unpacking both into one
    matrix is 3x slower on XLA:CPU), as two products of half the weight: over half the input rows
    each (pairs along `in`), or into half the output columns each (pairs along `out`), whichever
    halves the longer side. On XLA:CPU pairs along `out` take a 576 x 1536 projection 1.4-1.5x faster
    at 8 and 32 rows and as fast at one row, while for 1536 x 576 and 576 x 576 pairs along `in`
    stay 1.1x faster at one row, the decode step of a single stream (bench/quantized_matmul.py).
    The default model's engine step, gate and up repacked: 1.04-1.05x at 1 and 8 rows, 1.01-1.04x
    at 32. A GGUF file's layers are kept repacked beside its conversion (loader)."""
    n_in, n_out = 2 * w.packed.shape[-2], w.packed.shape[-1]
    if _paired_along_out(w) or n_out <= n_in or n_out % 2:
        return w
    return pair_along_out(w)


def pair_along_out(w: Int4Weight) -> Int4Weight:
    """w (paired along `in`) with its nibbles paired along `out` instead: the same levels."""
    levels = _int4_levels(np.asarray(w.packed))
    half = levels.shape[-1] // 2
    return Int4Weight(levels[..., :half] | (levels[..., half:] << 4), w.scale, w.offset)


def quantize_int4(w: np.ndarray, group: int = GROUP) -> Int4Weight:
    """Asymmetric int4 per group of `group` input rows (GGUF's Q4_1): the group's range over 15 steps."""
    w = np.asarray(w, np.float32)
    *lead, n_in, n_out = w.shape
    g = w.reshape(*lead, n_in // group, group, n_out)
    lo, hi = g.min(axis=-2), g.max(axis=-2)
    scale = _half_rounded(np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32))
    lo = _half_rounded(lo.astype(np.float32))
    q = np.clip(np.rint((g - lo[..., None, :]) / scale[..., None, :]), 0, 15).astype(np.uint8)
    return int4_from_levels(q.reshape(w.shape), scale, lo)


def int4_from_levels(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> Int4Weight:
    """Packs levels q [..., in, out] (0..15) with their group scales and offsets."""
    return Int4Weight(q[..., 0::2, :] | (q[..., 1::2, :] << 4), compact(scale), compact(offset))


def compact(a: np.ndarray) -> np.ndarray:
    """Scales or offsets as float16 where every value is exactly a float16 (GGUF's Q8_0/Q4_0/Q4_1
    blocks, and what `quantize_int8`/`quantize_int4` make), else as float32 (Q4_K's products of a
    float16 and a 6-bit factor). They dequantize in float32 either way."""
    a = np.asarray(a, np.float32)
    half = a.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), a) else a


def compact_scales(w: Int8Weight | Int4Weight) -> Int8Weight | Int4Weight:
    """w with its scales (and offsets) `compact`."""
    return type(w)(w[0], *(compact(a) for a in w[1:]))


def _half_rounded(a: np.ndarray) -> np.ndarray:
    """float32 `a` rounded to the nearest float16 values, so that levels are computed against the
    scale (and offset) as stored; `a` itself where float16 would overflow or flush a value to 0."""
    half = a.astype(np.float16)
    if not np.all(np.isfinite(half)) or np.any((half == 0) & (a != 0)):
        return a
    return half.astype(np.float32)


def _int4_levels(packed: np.ndarray, along_out: bool = False) -> np.ndarray:
    """The 0..15 levels [..., in, out] of nibbles paired along `in` (or `along_out`)."""
    if along_out:
        return np.concatenate([packed & 15, packed >> 4], axis=-1)
    both = np.stack([packed & 15, packed >> 4], axis=-2)  # [..., in / 2, 2, out]
    return both.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])


def _grouped(q, scale, offset=None):
    """float [..., in, out] of levels q (already float) by their groups' scales (and offsets)."""
    *lead, n_in, n_out = q.shape
    groups = scale.shape[-2]
    q = q.reshape(*lead, groups, n_in // groups, n_out) * scale[..., None, :].astype(q.dtype)
    if offset is not None:
        q = q + offset[..., None, :].astype(q.dtype)
    return q.reshape(*lead, n_in, n_out)


def dequantize(w: Int8Weight | Int4Weight) -> np.ndarray:
    w = jax.tree.map(np.asarray, w)
    if isinstance(w, Int4Weight):
        return _grouped(_int4_levels(w.packed, _paired_along_out(w)).astype(np.float32), w.scale, w.offset)
    return _grouped(w.q.astype(np.float32), w.scale)


def product_dtype(rows: int, dtype=jnp.float32):
    """Serving's operand type for a quantized multiply of `rows` rows in a model of float type
    `dtype`: float32, or the model's 16-bit type from MIN_ROWS_16BIT rows (sums stay float32). A
    weight dequantizes in the step whatever the rows, and for a few rows that dominates the step:
    writing bfloat16 copies made a one-row step 0.8x slower on XLA:CPU, where from 8 rows the
    multiplies dominate (a 32-row step of the default model 1.15-1.2x faster on a CPU with
    AVX512-BF16). Training multiplies in the model's type whatever the rows, so that a step cut into
    slices computes what the whole step does."""
    return dtype if rows >= MIN_ROWS_16BIT and jnp.dtype(dtype).itemsize == 2 else jnp.float32


def matmul(x: jax.Array, w: Int8Weight | Int4Weight | LayerOf, dtype=jnp.float32,
           cpu_kernels: bool = False) -> jax.Array:
    """x [T, in] @ w with float32 sums and result, the weight dequantized inside the step (an
    elementwise op XLA fuses) in float32, then cast to the operands' type `dtype` (serving's is
    `product_dtype`).
    int8 with one group applies its scale to the product (one multiply per output, not per weight);
    int4 dequantizes each nibble's half of the weight and multiplies it apart (`for_matmul`): by the
    matching (even or odd) columns of x, or into its half of the output columns. With `cpu_kernels`
    (a step for the CPU, the kernel registered: kiln.kernels.cpu) an int4 product of float32 rows
    runs in Kiln's kernel instead (any number of rows with AVX-512, else a few), reading a `LayerOf`
    weight's layer in the stack."""
    if cpu_kernels:  # (the kernel takes a stack of layers: one weight is a stack of one)
        stacked = w if isinstance(w, LayerOf) else LayerOf(jax.tree.map(lambda a: a[None], w), jnp.int32(0))
        if _kernel_takes(x, stacked.weight, dtype):
            return _kernel_int4(x, stacked)
    return _dequantized_matmul(x, w.layer() if isinstance(w, LayerOf) else w, dtype)


def _kernel_rows(x: jax.Array, dtype, scale: jax.Array, panels: bool) -> bool:
    """Whether Kiln's CPU kernels take these rows: float32 ones against float16 or float32 scales, as
    many as the streaming loops take, or as their panels take where the weight's shape has panels."""
    max_rows = kernels.product_max_rows() if panels else kernels.STREAMING_MAX_ROWS
    return (x.ndim == 2 and 1 <= x.shape[0] <= (max_rows or x.shape[0]) and jnp.dtype(dtype) == jnp.float32
            and scale.dtype in (jnp.float16, jnp.float32))


def _kernel_takes(x: jax.Array, w, dtype) -> bool:
    """Whether the kernel multiplies x by `w`, an int4 weight stacked on a layer axis [L, ...]."""
    if not isinstance(w, Int4Weight):
        return False
    n_in, n_out = x.shape[-1], w.scale.shape[-1]
    columns = n_out // 2 if _paired_along_out(w) else n_out
    return (_kernel_rows(x, dtype, w.scale, panels=n_out % 32 == 0) and w.packed.ndim == 3  # (panels of 32 columns)
            and w.scale.dtype == w.offset.dtype and (n_in // w.scale.shape[-2]) % 2 == 0 and columns % 16 == 0)


def _differentiated_as(reference: Callable):
    """A kernel call f(x, w) made differentiable: its gradient with respect to x is `reference`'s
    (XLA's path), and a frozen quantized weight's cotangents are zeros (float0 for its levels)."""
    def wrap(kernel: Callable) -> Callable:
        def forward(x, w):
            return kernel(x, w), (x, w)

        def backward(saved, dy):
            x, w = saved
            dx = jax.vjp(lambda x: reference(x, w), x)[1](dy)[0]
            zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0)
                                 if jnp.issubdtype(a.dtype, jnp.integer) else jnp.zeros_like(a), w)
            return dx.astype(x.dtype), zeros

        differentiable = jax.custom_vjp(kernel)
        differentiable.defvjp(forward, backward)
        return differentiable

    return wrap


@_differentiated_as(lambda x, w: _dequantized_matmul(x, w.layer(), jnp.float32))
def _kernel_int4(x: jax.Array, w: LayerOf) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.weight.scale.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call(kernels.INT4_TARGET, out)(x.astype(jnp.float32), *w.weight,
                                                      jnp.asarray(w.index, jnp.int32).reshape(1))


def _dequantized_matmul(x: jax.Array, w: Int8Weight | Int4Weight, dtype) -> jax.Array:
    x = x.astype(dtype)
    if isinstance(w, Int4Weight) and _paired_along_out(w):
        half = w.packed.shape[-1]
        low, high = (_grouped(levels.astype(jnp.float32), w.scale[..., cols], w.offset[..., cols]).astype(dtype)
                     for levels, cols in ((w.packed & 15, slice(None, half)), (w.packed >> 4, slice(half, None))))
        return jnp.concatenate([_dot(x, low), _dot(x, high)], axis=-1)
    if isinstance(w, Int4Weight):
        even, odd = (_grouped(levels.astype(jnp.float32), w.scale, w.offset).astype(dtype) for levels in
                     (w.packed & 15, w.packed >> 4))
        return _dot(x[:, 0::2], even) + _dot(x[:, 1::2], odd)
    if w.scale.shape[-2] == 1:
        return _dot(x, w.q.astype(dtype)) * w.scale[0].astype(jnp.float32)  # int8 levels are exact in bfloat16
    return _dot(x, _grouped(w.q.astype(jnp.float32), w.scale).astype(dtype))


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
    layers = fuse_projections({name: for_matmul(w) if isinstance(w, Int4Weight) else w for name, w in layers.items()})
    embed = params["embed"]
    tables = {"embed": embed if is_table(embed) else quantize_table(embed)}
    if (head := params.get("lm_head")) is not None:  # [hidden, vocab]: its columns are the table's rows
        tables["lm_head"] = head if is_table(head) else quantize_table(np.asarray(head).T)
    return {**params, **tables, "layers": layers}


def is_quantized(w) -> bool:
    return isinstance(w, (Int8Weight, Int4Weight, LayerOf))


def fuse_projections(layers: dict) -> dict:
    """Host layers with each `FUSED` group of quantized projections in one format held as one weight,
    its members' output columns side by side (q, k, v; gate, up), in `for_matmul`'s layout.

    A step then dequantizes and multiplies once where it did two or three times, which XLA:CPU does
    faster: the default model's int4 decode step 1.2x at one row, 1.1x at 8 (bench/fused_projections.py).
    A group whose members differ in format (a Q4_K_M file's int8 v_proj beside int4 q and k) stays
    apart. `decoder.projected` splits the product and adds each member's LoRA delta."""
    def side_by_side(arrays, dtype=None):
        return np.concatenate([np.asarray(a, dtype) for a in arrays], axis=-1)

    for fused, names in FUSED.items():
        parts = [layers.get(name) for name in names]
        if (not all(is_quantized(w) for w in parts) or len({type(w) for w in parts}) > 1
                or len({w.scale.shape[-2] for w in parts}) > 1):
            continue
        scale = side_by_side([w.scale for w in parts], np.float32)
        if isinstance(parts[0], Int8Weight):
            weight = Int8Weight(side_by_side([w.q for w in parts]), compact(scale))
        else:
            levels = side_by_side([_int4_levels(np.asarray(w.packed), _paired_along_out(w)) for w in parts])
            weight = for_matmul(int4_from_levels(levels, scale, side_by_side([w.offset for w in parts], np.float32)))
        layers = {**{name: w for name, w in layers.items() if name not in names}, fused: weight}
    return layers


def unfused(w: Int8Weight | Int4Weight, widths: tuple[int, ...], part: int) -> Int8Weight | Int4Weight:
    """Member `part` of a fused weight whose members have `widths` output columns, as it would be held
    apart (on the host)."""
    lo, hi = sum(widths[:part]), sum(widths[: part + 1])
    w = jax.tree.map(np.asarray, w)
    if isinstance(w, Int8Weight):
        return Int8Weight(np.ascontiguousarray(w.q[..., lo:hi]), compact(w.scale[..., lo:hi]))
    levels = _int4_levels(w.packed, _paired_along_out(w))[..., lo:hi]
    return for_matmul(int4_from_levels(levels, w.scale[..., lo:hi], w.offset[..., lo:hi]))


def unfuse_projections(layers: dict, widths: dict[str, int]) -> dict:
    """The inverse of `fuse_projections`: host layers with each fused weight split back into its
    members (`unfused`), `widths` giving each member's output columns (ModelConfig.projection_widths)."""
    apart = {name: w for name, w in layers.items() if name not in FUSED}
    for fused, members in FUSED.items():
        if fused in layers:
            sizes = tuple(widths[m] for m in members)
            apart.update({m: unfused(layers[fused], sizes, i) for i, m in enumerate(members)})
    return apart


# ---- tables: the embedding and the LM head ------------------------------------------------------

HEAD_CHUNK = 2048  # at most this many vocabulary rows dequantize at a time in the head's loop


class Int8Table(NamedTuple):
    """A table of rows, the embedding [vocab, hidden] (and an untied LM head held the same way),
    ≈ q * scale with one scale per group of 32 columns of a row: GGUF's Q8_0 blocks along a row.
    Rows are padded with zeros to whole chunks of the head's loop (`table_chunks`)."""

    q: jax.Array  # int8 [rows, cols]
    scale: jax.Array  # float16 (float32, `compact`) [rows, cols / group]


class Int4Table(NamedTuple):
    """≈ q * scale + offset, levels q in 0..15; byte j of a row holds columns 2j (low nibble) and
    2j + 1 (high), so that the head multiplies the even and the odd columns apart (`Int4Weight`)."""

    packed: jax.Array  # uint8 [rows, cols / 2]
    scale: jax.Array  # float16 (float32, `compact`) [rows, cols / group]
    offset: jax.Array  # float16 (float32, `compact`) [rows, cols / group]


def is_table(w) -> bool:
    return isinstance(w, (Int8Table, Int4Table))


def table_chunks(rows: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of the head's loop over a table of `rows` rows: the fewest chunks of
    at most HEAD_CHUNK rows, each a multiple of 8."""
    chunks = -(-rows // HEAD_CHUNK)
    per_chunk = -(-rows // chunks)
    return chunks, (per_chunk + 7) // 8 * 8


def table_from_weight(w: Int8Weight | Int4Weight) -> Int8Table | Int4Table:
    """The table whose rows are the weight's output channels: w [cols, rows] (groups along cols, as
    `quantize_int8`/`quantize_int4` and GGUF's blocks make them), transposed, its rows padded."""
    if isinstance(w, Int4Weight) and _paired_along_out(w):
        raise ValueError("a table's weight pairs its nibbles along its input rows (not for_matmul's layout)")
    rows = w[0].shape[-1]
    chunks, per_chunk = table_chunks(rows)
    pad = chunks * per_chunk - rows
    kind = Int4Table if isinstance(w, Int4Weight) else Int8Table
    fields = [np.ascontiguousarray(np.asarray(a).T) for a in w]
    if pad:  # zero rows: levels 0, scale 1, offset 0 (logits 0, sliced off)
        fields = [np.pad(a, ((0, pad), (0, 0)), constant_values=1 if name == "scale" else 0)
                  for a, name in zip(fields, kind._fields, strict=True)]
    return kind(*fields)


def quantize_table(w: np.ndarray) -> Int8Table:
    """A float table [rows, cols] as int8 in groups of 32 columns per row (one group per row where 32
    does not divide the columns). int4 models hold their tables in int8 too: the head is the matrix
    whose rounding moves logits most (on the tiny test models int4 tables cut greedy agreement with
    float32 from 90% to 81%), which is why llama.cpp's 4-bit files keep theirs at 6 or 8 bits. A
    GGUF file's Q4_0/Q4_1 table is still served as stored (`Int4Table`)."""
    return table_from_weight(quantize_int8(np.asarray(w, np.float32).T))


def dequantize_rows(t: Int8Table | Int4Table, xp=jnp):
    """float32 [n, cols] of a table's (or a slice of its) rows."""
    if isinstance(t, Int4Table):
        n, half = t.packed.shape
        levels = xp.stack([t.packed & 15, t.packed >> 4], axis=-1).reshape(n, 2 * half).astype(xp.float32)
        groups = t.scale.shape[-1]
        scale, offset = (a[..., None].astype(xp.float32) for a in (t.scale, t.offset))
        g = levels.reshape(n, groups, -1) * scale + offset
        return g.reshape(n, 2 * half)
    n, cols = t.q.shape
    groups = t.scale.shape[-1]
    return (t.q.reshape(n, groups, -1).astype(xp.float32) * t.scale[..., None].astype(xp.float32)).reshape(n, cols)


def dequantize_table(t: Int8Table | Int4Table) -> np.ndarray:
    """float32 [rows, cols], padding rows included."""
    return dequantize_rows(type(t)(*(np.asarray(a) for a in t)), np)


def table_rows(t: Int8Table | Int4Table, ids: jax.Array) -> jax.Array:
    """float32 [..., cols]: the rows `ids` (an embedding lookup), dequantized in the step."""
    picked = type(t)(*(a[ids.reshape(-1)] for a in t))
    return dequantize_rows(picked).reshape(*ids.shape, -1)


def table_logits(x: jax.Array, t: Int8Table | Int4Table, dtype=jnp.float32, cpu_kernels: bool = False) -> jax.Array:
    """x [T, cols] against every row of the table: float32 [T, rows] (padding included), the
    operands in `dtype` (as `matmul`). With `cpu_kernels`, an int8 table against float32 rows runs
    in Kiln's CPU kernel (kiln.kernels.cpu; as `matmul`).

    A loop over chunks of rows, each dequantized and multiplied in turn: a whole vocabulary's float
    copy would be a temporary as large as the float32 head, written and read back at every step
    (on XLA:CPU 3.5x slower than the float head for 32 rows). Each chunk is rematerialized under
    differentiation, so training keeps no float copy of the head either."""
    if (cpu_kernels and isinstance(t, Int8Table)  # (panels: groups of 32 columns)
            and _kernel_rows(x, dtype, t.scale, panels=t.q.shape[-1] == 32 * t.scale.shape[-1])):
        return _kernel_table_logits(x, t)
    x = x.astype(dtype)
    rows = t[0].shape[0]
    chunks, per_chunk = table_chunks(rows)
    parts = type(t)(*(a.reshape(chunks, per_chunk, *a.shape[1:]) for a in t))
    if isinstance(t, Int4Table):
        even, odd = x[:, 0::2], x[:, 1::2]

        def chunk(part):
            groups = part.scale.shape[-1]

            def half(levels):
                g = levels.reshape(per_chunk, groups, -1).astype(jnp.float32)
                scale, offset = (a[..., None].astype(jnp.float32) for a in (part.scale, part.offset))
                return (g * scale + offset).reshape(per_chunk, -1).astype(dtype)

            return _rows_dot(even, half(part.packed & 15)) + _rows_dot(odd, half(part.packed >> 4))
    else:
        def chunk(part):
            return _rows_dot(x, dequantize_rows(part).astype(dtype))

    _, out = jax.lax.scan(lambda carry, part: (carry, jax.checkpoint(chunk)(part)), None, parts)
    return jnp.moveaxis(out, 0, 1).reshape(x.shape[0], chunks * per_chunk)


@_differentiated_as(lambda x, t: table_logits(x, t))
def _kernel_table_logits(x: jax.Array, t: Int8Table) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], t.q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(kernels.INT8_TABLE_TARGET, out)(x.astype(jnp.float32), t.q, t.scale)


def _rows_dot(x: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.einsum("th,vh->tv", x, rows, preferred_element_type=jnp.float32)
