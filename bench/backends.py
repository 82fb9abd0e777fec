"""Decode throughput per backend route (XLA, IREE llvm-cpu, IREE Vulkan) on the default model,
side by side in one run, with the bytes each decode step moves between host and device and
each route's first-compile time.

Each route gets its own engine (`AsyncEngine(backend=select_backend(...))`) on the same float32
weights, with small buckets so that few shapes compile: decode rows (1, 8), one prefill bucket
of 256 tokens, blocks of 128 tokens and max_model_len 128 (one block per row). IREE modules
compile into a fresh temporary cache, so the compile times are real compiles (and, on the IREE
routes, include each bucket's correctness gate against XLA, see kiln/engine/bucket_gate.py).

For each batch size (1, then 8 chat prompts), a warm-up run compiles the buckets it needs
(timed: "compile"), then an identical timed run: greedy, ignore_eos, --tokens new tokens each.
"decode tok/s" is the token rate of the run's pure-decode steps (from the first step after the
last prefill step to the end of the run: scheduling and delivery included, compiles excluded).
"H->D"/"D->H" are `route.bytes_moved()` deltas over those steps divided by their number. XLA
shows '-': its CPU device is host memory, the step's inputs and outputs are host arrays handed
to XLA without a bus in between, and JAX counts no transfers. The greedy tokens of every route
are compared with XLA's (or with the first route run).

    python bench/backends.py [--quick] [--routes xla,iree-cpu,vulkan] [--tokens 32] [--model PATH]

A full run of the three routes takes about 11 minutes on 2 CPU cores with lavapipe (most of it
compiling and gating the Vulkan and llvm-cpu buckets); --quick (12 new tokens) saves about a minute.
A request that fails inside the engine (e.g. 503 route_unsupported when no bucket passed its gate)
fails its row of the table with the engine's message, not the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from common import chat_prompts

import kiln.engine.runner as runner_module
from kiln.engine.backends import select_backend
from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.models.loader import load_model

ROUTES = ("xla", "iree-cpu", "vulkan")
BATCHES = (1, 8)
BLOCK = 128
CONFIG = dict(num_kv_blocks=16, block_size=BLOCK, max_model_len=BLOCK, max_num_seqs=8, max_num_batched_tokens=256,
              decode_row_buckets=(1, 8), prefill_token_buckets=(256,), enable_prefix_caching=False)


class RequestFailed(Exception):
    """A request ended with an error inside the engine (e.g. 503 route_unsupported)."""


class Recorder:
    """Wraps one engine's runner: every executed batch (kind, rows, start time, bytes moved so far)
    and the time spent compiling buckets (gates included) and in the gates alone."""

    def __init__(self, engine: AsyncEngine):
        self.route = engine._core.backend
        self.runner = engine._core.runner
        self.steps: list[tuple[str, int, float, int, int]] = []
        self.compile_s = 0.0
        self.compiles = 0
        self.gate_s = 0.0
        dispatch, compile_ = self.runner.dispatch, self.runner._build

        def recorded_dispatch(batch, feed=None):
            self.steps.append((batch.kind, len(batch.rows), time.perf_counter(), *self.route.bytes_moved()))
            return dispatch(batch, feed)

        def recorded_compile(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return compile_(*args, **kwargs)
            finally:
                self.compile_s += time.perf_counter() - t0
                self.compiles += 1

        self.runner.dispatch = recorded_dispatch
        self.runner._build = recorded_compile


_gate_clock = {"s": 0.0}
_check_bucket = runner_module.check_bucket


def _timed_check_bucket(*args, **kwargs):
    t0 = time.perf_counter()
    try:
        return _check_bucket(*args, **kwargs)
    finally:
        _gate_clock["s"] += time.perf_counter() - t0


runner_module.check_bucket = _timed_check_bucket


def generate(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[list[int]]:
    async def one(i, p):
        ids = []
        async for d in engine.generate(f"{tag}-{i}", p, params):
            ids += d.token_ids
            if d.error is not None:
                raise RequestFailed(f"{getattr(d.error, 'code', '')}: {d.error}")
        return ids

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def measure(engine: AsyncEngine, rec: Recorder, prompts, tokens: int, batch: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    c0, g0, t0 = rec.compile_s, _gate_clock["s"], time.perf_counter()
    n0 = rec.compiles
    warm = generate(engine, prompts, params, f"warm{batch}")
    warm_s = time.perf_counter() - t0
    compile_s, gate_s, buckets = rec.compile_s - c0, _gate_clock["s"] - g0, rec.compiles - n0
    first = len(rec.steps)
    n1 = rec.compiles
    out = generate(engine, prompts, params, f"timed{batch}")
    end, (up_end, down_end) = time.perf_counter(), rec.route.bytes_moved()
    steps = rec.steps[first:]
    last_other = max((i for i, s in enumerate(steps) if s[0] != "decode"), default=-1)
    decode = steps[last_other + 1:]
    result = {"tokens": out, "warm_equal": warm == out, "compile_s": compile_s, "gate_s": gate_s,
              "buckets": buckets, "warm_s": warm_s, "late_compiles": rec.compiles - n1, "decode_steps": len(decode)}
    if decode:
        span = end - decode[0][2]
        result["tok_s"] = sum(s[1] for s in decode) / span
        result["ms_step"] = 1e3 * span / len(decode)
        result["up"] = (up_end - decode[0][3]) / len(decode)
        result["down"] = (down_end - decode[0][4]) / len(decode)
    return result


def run_route(name: str, model, prompts: dict[int, list[list[int]]], tokens: int, cache_dir: Path) -> dict:
    t0 = time.perf_counter()
    try:
        route = select_backend(name, cache_dir / name, model_dtype="float32")
    except Exception as exc:  # BackendUnavailable, a missing compiler, a driver that fails to start
        return {"error": f"{type(exc).__name__}: {exc}"}
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = AsyncEngine(model, EngineConfig(**CONFIG), backend=route)
    setup_s = time.perf_counter() - t0
    try:
        rec = Recorder(engine)
        kv_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in engine._core.runner.abstract[1])
        out = {"open_s": open_s, "setup_s": setup_s, "kv_bytes": kv_bytes, "gates": route.choice.gates,
               "device": route.choice.capabilities.get("name", ""), "batches": {}}
        for batch in BATCHES:
            try:
                out["batches"][batch] = measure(engine, rec, prompts[batch], tokens, batch)
            except Exception as exc:  # e.g. 503 route_unsupported: no bucket passed its gate
                out["batches"][batch] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name} batch {batch}: {fmt_brief(out['batches'][batch])}", flush=True)
        out["gate_failed"] = {b.describe(): why for b, why in engine._core.runner.gate_failed.items()}
        return out
    finally:
        engine.shutdown()


def fmt_brief(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"{r.get('tok_s', 0):.2f} tok/s, {r['buckets']} bucket(s) compiled in {r['compile_s']:.1f}s "
            f"(gates {r['gate_s']:.1f}s)")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated subset of " + ", ".join(ROUTES))
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 32, --quick 12)")
    ap.add_argument("--quick", action="store_true", help="12 new tokens per request")
    ap.add_argument("--model", default=None, help="a GGUF or model directory (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    tokens = args.tokens or (12 if args.quick else 32)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    for r in routes:
        if r not in ROUTES:
            ap.error(f"unknown route {r!r}; routes: {', '.join(ROUTES)}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory():
        model = load_model(args.model, dtype="float32", show_progress=False)
    prompts = {b: chat_prompts(model.tokenizer, b) for b in BATCHES}
    longest = max(len(p) for p in prompts[max(BATCHES)])
    if longest + tokens > BLOCK:
        ap.error(f"a {longest}-token prompt + {tokens} new tokens exceeds the benchmark's {BLOCK}-token rows")
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}); {model.model_id} float32; {os.cpu_count()} CPUs "
          f"({platform.machine()}); {tokens} new tokens per request, greedy, ignore_eos; prompts "
          f"{min(len(p) for p in prompts[max(BATCHES)])}-{longest} tokens", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for name in routes:
            print(f"route {name} ...", flush=True)
            results[name] = run_route(name, model, prompts, tokens, Path(cache))
    print_table(results, routes)
    print(f"total wall time {time.perf_counter() - t_start:.0f}s")


def print_table(results: dict, routes: list[str]) -> None:
    base_name = "xla" if "error" not in results.get("xla", {"error": 1}) else next(
        (r for r in routes if "error" not in results[r]), None)
    base = results.get(base_name, {}).get("batches", {})
    header = (f"{'route':>8} | {'batch':>5} | {'decode tok/s':>12} | {'vs xla':>6} | {'ms/step':>8} | "
              f"{'H->D /step':>10} | {'D->H /step':>10} | {'first compile':>22} | {'greedy = ' + str(base_name):>13}")
    print()
    print(header)
    print("-" * len(header))
    for name in routes:
        res = results[name]
        if "error" in res:
            print(f"{name:>8} | {'':>5} | not available: {res['error']}")
            continue
        for batch in BATCHES:
            r = res["batches"][batch]
            if "error" in r:
                print(f"{name:>8} | {batch:>5} | failed: {r['error'][:100]}")
                continue
            b = base.get(batch, {})
            ratio = f"{r['tok_s'] / b['tok_s']:.2f}x" if "tok_s" in r and "tok_s" in b else "-"
            if name != "xla" and "up" in r:
                up, down = human(r["up"]), human(r["down"])
            else:
                up = down = "-"
            compiled = f"{r['compile_s']:.1f}s ({r['buckets']} bucket{'s' * (r['buckets'] != 1)})"
            if name != "xla":
                compiled = f"{r['compile_s']:.1f}s ({r['buckets']}, gates {r['gate_s']:.0f}s)"
            same = "yes" if "tokens" in b and r["tokens"] == b["tokens"] else "NO" if "tokens" in b else "-"
            print(f"{name:>8} | {batch:>5} | {r.get('tok_s', 0):>12.2f} | {ratio:>6} | {r.get('ms_step', 0):>8.1f} | "
                  f"{up:>10} | {down:>10} | {compiled:>22} | {same:>13}")
    print()
    for name in routes:
        res = results[name]
        if "error" in res:
            continue
        notes = [f"route opened in {res['open_s']:.1f}s (device gates {res['gates'] or 'none'})",
                 f"engine built in {res['setup_s']:.1f}s", f"KV pool {human(res['kv_bytes'])}"]
        if res["device"]:
            notes.append(f"device {res['device']!r}")
        for batch in BATCHES:
            if "error" in res["batches"][batch]:
                notes.append(f"batch {batch} failed: {res['batches'][batch]['error']}")
        if res.get("gate_failed"):
            notes.append(f"buckets that failed their gate: {res['gate_failed']}")
        for batch in BATCHES:
            r = res["batches"][batch]
            if r.get("late_compiles"):
                notes.append(f"batch {batch}: {r['late_compiles']} bucket(s) compiled during the timed run")
            if "tokens" in r and not r["warm_equal"]:
                notes.append(f"batch {batch}: warm-up and timed greedy tokens differ")
        print(f"{name}: " + "; ".join(notes))
    if "xla" in results and "error" not in results["xla"]:
        print("xla: '-' bytes: its CPU device is host memory; step inputs/outputs are host arrays, no bus, "
              "and JAX counts no transfers")
    ran = [(name, b) for name in routes if "error" not in results[name] for b in BATCHES
           if "tokens" in results[name]["batches"][b]]
    same_all = all(results[name]["batches"][b]["tokens"] == base.get(b, {}).get("tokens") for name, b in ran)
    missing = [f"{name} batch {b}" for name in routes for b in BATCHES if (name, b) not in ran]
    print(f"greedy tokens equal across the routes and batches that ran: {'yes' if same_all else 'NO'}"
          + (f" (not run: {', '.join(missing)})" if missing else ""))


if __name__ == "__main__":
    main()
