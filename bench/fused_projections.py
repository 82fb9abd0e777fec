"""The engine's decode step with a quantized model's q/k/v and gate/up held fused (as Kiln loads
them, kiln.models.quant.fuse_projections) against the same weights held apart, in one process.

The default model (its GGUF's own int4 layers, `quantization = auto`) is loaded once; the apart
copy is its fused weights split back into their members (`quant.unfuse_projections`), so both multiply the
same levels. Each step is the bare decode step (forward and sampler executables, inputs built once)
of `rows` requests at about 200 tokens of context, timed round-robin; the median of the repeats.

    python bench/fused_projections.py [--rows 1,8,32] [--dtype float32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
from common import bare_step, decoding_core, timed

from kiln.models.loader import load_model
from kiln.models.quant import unfuse_projections


def held_apart(model):
    """The model with each fused weight split back into its members."""
    apart = unfuse_projections(model.params["layers"], model.config.projection_widths)
    return dataclasses.replace(model, params=jax.device_put({**model.params, "layers": apart}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    fused = load_model(None, show_progress=False, quantization="auto", dtype=args.dtype)
    apart = held_apart(fused)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {fused.quantization} layers, dtype {args.dtype}; "
          f"ms per decode step (median of {args.repeats})")
    print(f"{'rows':>4} | {'apart':>8} | {'fused':>8} | fused speed-up")
    for rows in (int(r) for r in args.rows.split(",")):
        steps = {label: bare_step(decoding_core(m, rows, 200))[0] for label, m in (("apart", apart), ("fused", fused))}
        t = timed(steps, args.repeats)
        print(f"{rows:>4} | {t['apart'] * 1e3:>8.2f} | {t['fused'] * 1e3:>8.2f} | {t['apart'] / t['fused']:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
