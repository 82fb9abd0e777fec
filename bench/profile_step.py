"""Where a 32-row decode step of the default model spends its time.

Times, in one run and at the same rows and context:
  - the bare jitted step (inputs prepared once: device time only);
  - the engine's whole step (EngineCore.step: schedule, inputs, the jitted step, detokenize, update),
    with the engine's own settings (async scheduling: the host's work overlaps the device step);
  - a plain jitted chain of the step's matmuls (same shapes): the matmul peak the step is held to.
Then traces the bare step with jax.profiler (a Perfetto trace) and attributes XLA's thunk time
to the model's named scopes (qkv, attention, o_proj, mlp, lm_head, sampling, ...).

The weights are in the server's format unless told (`--quantization`: the default model's GGUF
layers are int4), and every timing runs at `--context` (the engine's own steps, timed in between,
lengthen the rows; the bare step is built before them).

    python bench/profile_step.py [--rows 32] [--context 64] [--quantization auto] [--trace-dir /tmp/kiln-trace]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import shutil

import jax
from common import bare_step, decode_step_args, decoding_core, engine_step_times, matmul_chain, step_flops, timed

from kiln.engine.steps import sample_step
from kiln.models.decoder import float_dtype
from kiln.models.loader import load_model

SCOPES = ("sampling", "lm_head", "attention", "kv_write", "qkv", "o_proj", "mlp")


def scope_of(op_name: str) -> str:
    return next((s for s in SCOPES if f"/{s}/" in op_name or op_name.endswith(f"/{s}")), "other")


def breakdown(hlo_text: str, run, trace_dir: str, steps: int = 5) -> tuple[dict[str, float], str]:
    """Thread-milliseconds per step by scope (threads overlap: the sum exceeds the wall time)."""
    op_scope, operands, module = {}, {}, ""
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):  # op names repeat across programs: key them by (module, op)
            module = line.split()[1].rstrip(",")
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ [\w\-]+\(([^)]*)\)", line)
        if m:
            operands[module, m.group(1)] = re.findall(r"%([\w.\-]+)", m.group(2))
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]*)\"", line)
        if m:
            op_scope[module, m.group(1)] = scope_of(m.group(2))
    for (module, op), args in operands.items():  # an op XLA left without metadata (a rewritten dot): its operands'
        if (module, op) not in op_scope:
            known = [op_scope[module, a] for a in args if op_scope.get((module, a), "other") != "other"]
            op_scope[module, op] = known[-1] if known else "other"
    shutil.rmtree(trace_dir, ignore_errors=True)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(steps):
        run()
    jax.profiler.stop_trace()
    path = sorted(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    data = json.load(gzip.open(path))
    totals: collections.Counter = collections.Counter()
    for e in data["traceEvents"] if isinstance(data, dict) else data:
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if e.get("ph") == "X" and op and not e["name"].startswith("end:") and not op.startswith("while"):
            # a while loop's event spans its body's, which are counted by their own scopes
            totals[op_scope.get((args.get("hlo_module"), op), "other")] += e["dur"] / steps / 1e3
    return dict(totals), path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=64, help="tokens of context per row when timed")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--trace-dir", default="/tmp/kiln-trace")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="the weights' format, as [model] quantization (auto: "
                    "the GGUF file's own, as the server loads it)")
    args = ap.parse_args()

    model = load_model(show_progress=False, dtype=args.dtype, quantization=args.quantization)
    cfg = model.config
    core = decoding_core(model, args.rows, args.context)
    run, shape = bare_step(core)  # at the rows' context now: the engine's steps below lengthen it
    _, step_args, rs = decode_step_args(core)
    steps = engine_step_times(core)
    chain = matmul_chain(cfg, args.rows, float_dtype(model.params))
    t = timed({"bare": run, "chain": chain}, args.repeats)  # round-robin: the step's share of the matmul peak
    bare = t["bare"]
    engine = bare + steps["added"]
    flops = step_flops(cfg, args.rows)
    peak = flops / t["chain"]
    runner = core.runner
    row_logits = jax.ShapeDtypeStruct((shape.rows, cfg.vocab_size), jax.numpy.float32)
    # the programs the step runs (their static arguments too: the attention kernel, Kiln's CPU kernels)
    hlo = (runner.lowered(*runner.forward_program(shape)).compile().as_text()
           + sample_step.lower(row_logits, rs, feed_rows=runner.layout.feed_rows).compile().as_text())
    scopes, trace = breakdown(hlo, run, args.trace_dir)
    core.close()

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {model.model_id} {model.dtype}, "
          f"{args.quantization} weights; {args.rows} rows at ~{args.context} tokens of context; "
          f"step bucket {shape.describe()}")
    print(f"{'':32} {'ms':>8} {'tok/s':>8}")
    print(f"{'bare jitted step':32} {bare * 1e3:8.1f} {args.rows / bare:8.1f}")
    print(f"{'engine step (host included)':32} {engine * 1e3:8.1f} {args.rows / engine:8.1f}")
    print(f"{'matmul chain (same shapes)':32} {flops / peak * 1e3:8.1f}")
    print(f"step FLOPs {flops / 1e9:.2f} G; matmul peak {peak / 1e9:.1f} GFLOP/s; bare step at "
          f"{flops / bare / 1e9:.1f} GFLOP/s = {flops / bare / peak:.0%} of the matmul peak (target >= 70%)")
    print(f"engine step = {bare / engine:.0%} of the bare step's throughput ({steps['host'] * 1e3:.1f} ms of host "
          f"work per step, {(engine - bare) * 1e3:.1f} ms of it not hidden behind the device step)")
    total = sum(scopes.values())
    print("XLA thread time per step by scope (both threads; shares of the total):")
    for name, ms in sorted(scopes.items(), key=lambda kv: -kv[1]):
        print(f"  {name:10} {ms:7.1f} ms  {ms / total:6.1%}")
    print(f"Perfetto trace: {trace}")


if __name__ == "__main__":
    main()
