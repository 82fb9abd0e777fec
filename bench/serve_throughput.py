"""Serving throughput of Kiln's engine vs transformers' batched generate, one table, one run.

Same weights on both sides (the default SmolLM2-135M GGUF, dequantized to float32):
  1. offline throughput of a fixed mixed workload (chat-templated prompts of 32-256 tokens, 16-64
     new tokens, greedy, ignore_eos) keeping `concurrency` requests in flight;
  2. TTFT of a prompt whose first 1,024 tokens are a shared prefix: cold vs prefix-cache hit;
  3. host (scheduler + Python) time per 32-row decode step, from the concurrency-32 run;
  4. transformers' generate on the same requests in consecutive batches of `concurrency`
     (left-padded, max_new_tokens = the batch's largest; only requested tokens are counted).
Compilation is not timed: the engine thread compiles new step shapes synchronously, and those
spans (trace + lower + XLA compile, from jax.monitoring) are subtracted from each run's wall
time (`--warm-pass` runs the identical workload once untimed instead: exact, twice as long).

    python bench/serve_throughput.py [--quick] [--skip-hf] [--warm-pass] [--concurrency 1,8,32,64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import jax
import numpy as np

from kiln.engine.engine import Engine, EngineConfig
from kiln.engine.runner import COUNTER
from kiln.engine.sampling import SamplingParams
from kiln.engine.setup import configure_compilation_cache
from kiln.models.loader import cache_dir, default_model_path, load_model

INSTRUCTIONS = [
    "Summarize the following text in two sentences.", "List the three most important facts in this passage.",
    "Translate the first sentence below into French.", "Write a haiku inspired by the text below.",
    "What questions would a curious student ask after reading this?", "Explain the passage below to a ten-year-old.",
    "Rewrite the text below in a formal tone.", "Give this passage a short, catchy title.",
]
PASSAGES = [
    "The river rises in the northern hills, where snowmelt feeds a dozen small streams that join in a "
    "narrow valley. For most of its length it runs slowly through farmland, and in the spring it floods "
    "the low meadows, leaving behind a layer of silt that makes the soil unusually fertile.",
    "A bicycle converts the rider's pedalling into forward motion through a chain that links the crank "
    "to the rear wheel. Gears change how far the wheel turns for each stroke, so a rider can climb a "
    "steep hill slowly or ride fast on flat ground without changing how hard they push.",
    "Copper has been worked by people for more than ten thousand years. It conducts heat and electricity "
    "very well, resists corrosion, and can be drawn into thin wires, which is why it is found in power "
    "cables, cooking pots, plumbing, and the windings of nearly every electric motor.",
]
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFIX = 1024
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration"}
COMPILE_SPANS: list[tuple[float, float]] = []  # time.time() spans; nested traces overlap, so they are merged
jax.monitoring.register_event_time_span_listener(
    lambda event, start, end, **_: COMPILE_SPANS.append((start, end)) if event in COMPILE_EVENTS else None)


def compile_seconds(t0: float, t1: float) -> float:
    """Length of the union of compile spans within [t0, t1] (time.time() clock)."""
    total, reach = 0.0, t0
    for a, b in sorted((max(a, t0), min(b, t1)) for a, b in COMPILE_SPANS if b > t0 and a < t1):
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


def chat_parts(tok):
    head, tail = tok.apply_chat_template([{"role": "user", "content": "XYZPLACE"}]).split("XYZPLACE")
    return tok.encode(head), tok.encode(tail, add_special_tokens=False)


def make_workload(tok, n: int, prompt=(32, 256), new=(16, 64), seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens): an instruction then passage text, chat-templated, exact lengths."""
    rng = np.random.default_rng(seed)
    head, tail = chat_parts(tok)
    body = tok.encode(" ".join(PASSAGES), add_special_tokens=False)
    out = []
    for i in range(n):
        length, m = int(rng.integers(prompt[0], prompt[1] + 1)), int(rng.integers(new[0], new[1] + 1))
        instr = tok.encode(INSTRUCTIONS[i % len(INSTRUCTIONS)] + "\n\n", add_special_tokens=False)
        off = int(rng.integers(len(body)))
        out.append((head + (instr + body[off:] + body * 2)[: length - len(head) - len(tail)] + tail, m))
    return out


def reset_prefix_cache(engine: Engine) -> None:
    done = threading.Event()
    engine.at_boundary(lambda: (engine.pool.reset_prefix_cache(), done.set()))
    done.wait()


def run_kiln(engine: Engine, work, concurrency: int, tag: str) -> dict:
    """Keeps `concurrency` requests in flight: the next is submitted from the finishing one's sink,
    in the engine thread, so a rerun schedules identically. The prefix cache starts empty."""
    lock, done, finals = threading.Lock(), threading.Event(), []
    pending = iter(enumerate(work))

    def submit():
        with lock:
            item = next(pending, None)
        if item is not None:
            i, (ids, m) = item
            engine.add_request(f"{tag}-{i}", ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), sink)

    def sink(delta):
        if delta.finish_reason is not None:
            finals.append(delta)
            done.set() if len(finals) == len(work) else submit()

    reset_prefix_cache(engine)
    builds, t0, w0 = COUNTER.builds, time.perf_counter(), time.time()
    engine.at_boundary(lambda: [submit() for _ in range(concurrency)])  # first batch lands whole, in one drain
    done.wait()
    wall, compile_s = time.perf_counter() - t0, compile_seconds(w0, time.time())
    if sum(d.usage["completion_tokens"] for d in finals if d.finish_reason == "length") != sum(m for _, m in work):
        raise RuntimeError(f"requests did not run to max_tokens: {[d for d in finals if d.finish_reason != 'length'][:1]}")
    timed = wall - compile_s
    return {"tps": sum(m for _, m in work) / timed, "rps": len(work) / timed, "wall": wall,
            "compile_s": compile_s, "compiles": COUNTER.builds - builds}


class StepTimer:
    """Wraps the runner's instance attributes (kiln itself is untouched) to time every iteration.

    device = end of input building (the model_step dispatch) .. sampled ids ready, so JAX's
    dispatch and the host-to-device copy of the inputs count as device time; host = the rest
    of the iteration: scheduling, input building, result fetch, detokenization, sinks, inbox."""

    def __init__(self, runner):
        self.runner, self.marks, self.recs = runner, {}, []

    def __enter__(self):
        r, run, sampling_arrays, results = self.runner, self.runner.run, self.runner._sampling_arrays, self.runner._results

        def timed_run(rows):
            b, t0 = COUNTER.builds, time.perf_counter()
            out = run(rows)
            prefill = any(n > 1 or req.in_prefill for req, n in rows)  # checked before after_step
            self.recs.append((t0, self.marks["dispatch"], self.marks["ready"], time.perf_counter(), len(rows), prefill, COUNTER.builds > b))
            return out

        def timed_sampling(*args):
            out = sampling_arrays(*args)
            self.marks["dispatch"] = time.perf_counter()
            return out

        def timed_results(rows, shape, sampled, *args):
            jax.block_until_ready(sampled.tokens)
            self.marks["ready"] = time.perf_counter()
            return results(rows, shape, sampled, *args)

        r.run, r._sampling_arrays, r._results = timed_run, timed_sampling, timed_results
        return self

    def __exit__(self, *exc):
        del self.runner.run, self.runner._sampling_arrays, self.runner._results  # back to the class methods

    def prefill_share(self) -> float:
        """Share of device time (compiling steps left out) spent in steps that carry prompt tokens."""
        recs = [r for r in self.recs if not r[6]]
        return sum(r[2] - r[1] for r in recs if r[5]) / max(sum(r[2] - r[1] for r in recs), 1e-9)

    def decode_steps(self, rows: int) -> dict:
        """Medians over consecutive pure-decode steps of `rows` rows (neither one compiling)."""
        ok = lambda r: r[4] == rows and not r[5] and not r[6]  # noqa: E731
        pairs = [(a, b) for a, b in zip(self.recs, self.recs[1:], strict=False) if ok(a) and ok(b)]
        if not pairs:
            return {"steps": 0}
        med = lambda f: statistics.median(f(a, b) for a, b in pairs) * 1e3  # noqa: E731
        return {"steps": len(pairs), "step_ms": med(lambda a, b: b[0] - a[0]), "device_ms": med(lambda a, b: a[2] - a[1]),
                "host_ms": med(lambda a, b: (b[0] - a[0]) - (a[2] - a[1])), "build_ms": med(lambda a, b: a[1] - a[0]),
                "fetch_ms": med(lambda a, b: a[3] - a[2]), "between_ms": med(lambda a, b: b[0] - a[3])}


def prefix_ttft(engine: Engine, tok, reps: int = 3) -> tuple[float, float, int]:
    """Best cold vs best hit TTFT; the first repetition compiles the shapes and is discarded."""
    head, tail = chat_parts(tok)
    body = tok.encode(" ".join(PASSAGES), add_special_tokens=False)
    prefix = (head + tok.encode("Answer questions about this document.\n\n", add_special_tokens=False) + body * 20)[:PREFIX]
    finals = []
    for i in range(2 * reps):  # even i: cold (empty prefix cache); odd i: hit (same prefix, new question)
        if i % 2 == 0:
            reset_prefix_cache(engine)
        done = threading.Event()
        question = tok.encode(f"\n\nQuestion {i}: {INSTRUCTIONS[i % len(INSTRUCTIONS)]}", add_special_tokens=False)
        engine.add_request(f"ttft-{i}", prefix + question + tail, SamplingParams(max_tokens=1, temperature=0.0),
                           lambda d, done=done: (finals.append(d), done.set()) if d.finish_reason else None)
        done.wait()
    ttfts = [d.metrics["ttft_s"] for d in finals]
    return min(ttfts[2::2]), min(ttfts[3::2]), finals[-1].usage["cached_tokens"]


def run_hf(hf, work, batch: int) -> float:
    import torch

    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width, new = max(len(p) for p, _ in chunk), max(m for _, m in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return sum(m for _, m in work) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--hf-max-batch", type=int, default=64, help="larger transformers batches print n/a")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = concurrency, short prompts and outputs")
    ap.add_argument("--warm-pass", action="store_true", help="run each workload once untimed first")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    configure_compilation_cache(cache_dir() / "jax")
    load0 = os.getloadavg()[0]

    model = load_model(show_progress=False)
    tok = model.tokenizer
    engine = Engine(model, EngineConfig(num_kv_blocks=2048, block_size=16, max_num_seqs=max(ROW_BUCKETS),
                                        max_num_batched_tokens=512, row_buckets=ROW_BUCKETS))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus); model {model.model_id} float32; "
          f"engine: 2048 KV blocks x 16, max_num_seqs 64, 512 batched tokens, prefix caching on", flush=True)
    sizes = {1: 8, 8: 16}  # requests per level (at least the concurrency)
    workloads = {c: make_workload(tok, max(c, 2), (32, 96), (8, 16)) if args.quick else make_workload(tok, max(c, sizes.get(c, 0)))
                 for c in levels}
    kiln, host = {}, {"steps": 0}
    try:
        for c in levels:
            warm = run_kiln(engine, workloads[c], c, f"warm{c}") if args.warm_pass else None
            with StepTimer(engine.runner) as timer:
                kiln[c] = run_kiln(engine, workloads[c], c, f"c{c}")
            kiln[c]["prefill_share"] = timer.prefill_share()
            if c == 32:
                host = timer.decode_steps(32)
            k = kiln[c]
            print(f"  kiln c={c}: {len(workloads[c])} requests in {k['wall']:.1f}s, {k['compiles']} step executables "
                  f"built/loaded taking {k['compile_s']:.1f}s (excluded)"
                  + (f"; untimed warm pass, compile excluded: {warm['tps']:.1f} tok/s" if warm else ""), flush=True)
        c0 = COUNTER.builds
        cold, hit, cached = prefix_ttft(engine, tok)
        print(f"  prefix TTFT done ({COUNTER.builds - c0} executables, in the discarded first repetition)", flush=True)
    finally:
        engine.shutdown()

    hf_tps: dict[int, float] = {}
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        print(f"transformers on torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        run_hf(hf, workloads[levels[0]][:1], 1)  # warm
        for c in (c for c in levels if c <= args.hf_max_batch):
            t0 = time.perf_counter()
            hf_tps[c] = run_hf(hf, workloads[c], c)
            print(f"  transformers batch {c}: {time.perf_counter() - t0:.1f}s", flush=True)

    header = (f"{'concurrency':>11} | {'requests':>8} | {'kiln tok/s':>10} | {'kiln req/s':>10} | {'transformers tok/s':>18} | "
              f"{'ratio':>6} | {'kiln prefill-step share':>23}")
    print(f"\n{header}\n{'-' * len(header)}")
    for c in levels:
        k, h = kiln[c], hf_tps.get(c)
        ratio = f"{k['tps'] / h:.2f}x" if h else "n/a"
        hs = f"{h:.1f}" if h else ("skipped" if args.skip_hf else f"n/a (> {args.hf_max_batch})")
        print(f"{c:>11} | {len(workloads[c]):>8} | {k['tps']:>10.1f} | {k['rps']:>10.2f} | {hs:>18} | {ratio:>6} | {k['prefill_share']:>23.0%}")
    print()

    def line(label, value, target, ok):
        print(f"{label:<44} {value:<30} target {target:<7} {'met' if ok else 'MISSED'}")

    if 1 in kiln and 32 in kiln:
        r = kiln[32]["tps"] / kiln[1]["tps"]
        line("32-concurrent vs single-stream tok/s", f"{r:.1f}x", ">= 8x", r >= 8)
    if 32 in kiln and hf_tps.get(32):
        r = kiln[32]["tps"] / hf_tps[32]
        line("kiln vs transformers at 32", f"{r:.2f}x", ">= 2x", r >= 2)
    line(f"prefix-hit TTFT vs cold ({PREFIX}-token prefix)", f"{hit * 1e3:.0f} / {cold * 1e3:.0f} ms = {hit / cold:.3f}x",
         "<= 0.2x", hit <= 0.2 * cold)
    if host["steps"]:
        share = host["host_ms"] / host["step_ms"]
        line("host overhead share at 32 decode rows", f"{host['host_ms']:.1f} / {host['step_ms']:.1f} ms = {share:.1%}",
             "<= 10%", share <= 0.10)
        print(f"  medians over {host['steps']} consecutive 32-row decode steps of the c=32 run: device {host['device_ms']:.1f} ms; "
              f"host: input build {host['build_ms']:.2f}, result fetch {host['fetch_ms']:.2f}, between steps {host['between_ms']:.2f} ms")
    print(f"  prefix hit reused {cached} cached prompt tokens; TTFT is best of 2 after a compiling repetition")
    print("prefill-step share: the part of kiln's device time spent in steps that carry prompt tokens (chunked prefill, "
          "alone or mixed with decode rows)")
    print("tok/s: requested (= generated) tokens / (wall time - compile time) for the whole workload, prefill included; "
          f"load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end ({os.cpu_count()} cpus)")


if __name__ == "__main__":
    main()
