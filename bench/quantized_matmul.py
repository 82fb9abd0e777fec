"""One projection of the default model's shapes, float32 against the two int8 ways to multiply it.

- float32: `x @ w`, the weight as stored today;
- int8 weight-only (Kiln's `model.quantization = int8`): the int8 weight converted in the step,
  float32 accumulation, the per-channel scale applied to the product (kiln.models.quant.matmul);
- int8 x int8: the activations quantized per row as well, `lax.dot_general` of two int8 operands
  with `preferred_element_type=int32`, then both scales.

Then the LM head held as a quantized model's table (int8 and int4, a chunk of the vocabulary
dequantized and multiplied at a time) against float32 and against dequantizing it whole.

Weights are 30 layers deep under `lax.scan` (so that, as in a decode step, they do not stay in the
cache from one multiply to the next), except the LM head, which is one matrix. Times are per call,
best of three; ratios are float32's time over the int8 path's (above 1 = int8 is faster).

    python bench/quantized_matmul.py [--rows 1,32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.quant import (
    dequantize_rows,
    quantize_int4,
    quantize_int8,
    quantize_table,
    table_from_weight,
    table_logits,
)
from kiln.models.quant import matmul as int8_weight_matmul

LAYERS = 30
# (in, out) of SmolLM2-135M's projections and its (tied) LM head
SHAPES = {"gate/up_proj": (576, 1536), "down_proj": (1536, 576), "q/o_proj": (576, 576), "lm_head": (576, 49152)}


def int8_by_int8(x, w):
    x_scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    xq = jnp.round(x / x_scale).astype(jnp.int8)
    y = jax.lax.dot_general(xq, w.q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return y.astype(jnp.float32) * x_scale * w.scale


def over_layers(multiply):
    """`multiply(x, w)` for each stacked layer of w, summed so nothing is dropped."""

    def run(x, w):
        return jax.lax.scan(lambda total, wl: (total + multiply(x, wl).sum(), None), jnp.float32(0), w)[0]

    return jax.jit(run)


def best_ms(fn, *args, repeats=3, calls=10) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; ms per call (best of 3)")
    header = (f"{'shape':>22} | {'rows':>4} | {'float32':>8} | {'int8 weight':>11} | {'ratio':>6} | "
              f"{'int8 x int8':>11} | {'ratio':>6}")
    print(f"{header}\n{'-' * len(header)}")
    for name, (n_in, n_out) in SHAPES.items():
        depth = 1 if name == "lm_head" else LAYERS
        w = (rng.standard_normal((depth, n_in, n_out)) * 0.02).astype(np.float32)
        w_f32, w_q8 = jnp.asarray(w), jax.tree.map(jnp.asarray, quantize_int8(w))
        w_q8_channel = jax.tree.map(jnp.asarray, quantize_int8(w, group=n_in))  # int8 x int8 needs one scale
        for rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
            f32 = best_ms(over_layers(lambda x, wl: x @ wl), x, w_f32)
            weight_only = best_ms(over_layers(int8_weight_matmul), x, w_q8)
            both = best_ms(over_layers(int8_by_int8), x, w_q8_channel)
            shape = f"{name} {depth}x{n_in}x{n_out}"
            print(f"{shape:>22} | {rows:>4} | {f32:>8.2f} | {weight_only:>11.2f} | {f32 / weight_only:>5.2f}x | "
                  f"{both:>11.2f} | {f32 / both:>5.2f}x")
    head_as_table(rng, [int(r) for r in args.rows.split(",")])


def head_as_table(rng, row_counts):
    """The LM head held as Kiln holds a quantized model's embedding (a table [vocab, hidden] that the
    head multiplies a chunk of rows at a time, `kiln.models.quant.table_logits`), against the float32
    head and against dequantizing the whole table in one go."""
    n_in, vocab = SHAPES["lm_head"]
    table = (rng.standard_normal((vocab, n_in)) * 0.02).astype(np.float32)
    t8 = jax.tree.map(jnp.asarray, quantize_table(table))
    t4 = jax.tree.map(jnp.asarray, table_from_weight(quantize_int4(table.T)))
    f32 = jax.jit(lambda x, w: jnp.einsum("th,vh->tv", x, w))
    whole = jax.jit(lambda x, t: jnp.einsum("th,vh->tv", x, dequantize_rows(t)))
    chunked = jax.jit(table_logits)
    print(f"\nLM head as a table [{vocab}, {n_in}], ms per call (best of 3); ratio: float32's time over the table's")
    header = f"{'rows':>4} | {'float32':>8} | {'int8, whole':>11} | {'int8, chunks':>12} | {'ratio':>6} | " \
             f"{'int4, chunks':>12} | {'ratio':>6}"
    print(f"{header}\n{'-' * len(header)}")
    w = jnp.asarray(table)
    for rows in row_counts:
        x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
        base, one_go, c8, c4 = (best_ms(f, x, a) for f, a in ((f32, w), (whole, t8), (chunked, t8), (chunked, t4)))
        print(f"{rows:>4} | {base:>8.2f} | {one_go:>11.2f} | {c8:>12.2f} | {base / c8:>5.2f}x | {c4:>12.2f} | "
              f"{base / c4:>5.2f}x")


if __name__ == "__main__":
    main()
