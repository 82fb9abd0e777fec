"""Serving throughput of Kiln's engine vs transformers' batched generate, one table, one run.

Same weights on both sides (the default SmolLM2-135M GGUF, dequantized to float32). Measures:
  1. offline throughput of a fixed mixed workload (chat-templated prompts of 32-256 tokens,
     16-64 new tokens each, greedy, ignore_eos) keeping `concurrency` requests in flight;
  2. TTFT of a prompt whose first 1,024 tokens are a shared prefix: cold vs prefix-cache hit;
  3. host (scheduler + Python) time per decode step at 32 rows vs the device computation;
  4. transformers' generate on the same prompts in batches (left-padded, max_new_tokens = the
     batch's largest request; only each request's own requested tokens are counted).
Every engine shape is compiled by an untimed pass of the identical workload first (the prefix
cache is reset before each pass, so both passes schedule identically).

    python bench/serve_throughput.py [--quick] [--skip-hf] [--concurrency 1,8,32,64]
"""

from __future__ import annotations

import argparse
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
    "Summarize the following text in two sentences.",
    "List the three most important facts in this passage.",
    "Translate the first sentence below into French.",
    "Write a haiku inspired by the text below.",
    "What questions would a curious student ask after reading this?",
    "Explain the passage below to a ten-year-old.",
    "Rewrite the text below in a formal tone.",
    "Give this passage a short, catchy title.",
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
    "The library opened in an old railway station after the trains stopped running. Reading rooms now "
    "fill the former waiting halls, the ticket office lends out tools and musical instruments, and on "
    "Saturday mornings the platform hosts a market where local growers sell fruit and bread.",
    "Bees communicate the location of flowers with a dance. The angle of the dance relative to vertical "
    "tells the others the direction of the food relative to the sun, and the length of the waggling run "
    "tells them how far away it is, so a whole hive can find a new field within an hour.",
]
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFIX = 1024


def chat_parts(tok):
    head, tail = tok.apply_chat_template([{"role": "user", "content": "XYZPLACE"}]).split("XYZPLACE")
    return tok.encode(head), tok.encode(tail, add_special_tokens=False)


def make_workload(tok, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens): prompts 32-256 tokens, an instruction then passage text."""
    rng = np.random.default_rng(seed)
    head, tail = chat_parts(tok)
    body = tok.encode(" ".join(PASSAGES), add_special_tokens=False)
    out = []
    for i in range(n):
        length, new = int(rng.integers(32, 257)), int(rng.integers(16, 65))
        instr = tok.encode(INSTRUCTIONS[i % len(INSTRUCTIONS)] + "\n\n", add_special_tokens=False)
        off = int(rng.integers(len(body)))
        content = (instr + body[off:] + body * 2)[: length - len(head) - len(tail)]
        out.append((head + content + tail, new))
    return out


def reset_prefix_cache(engine: Engine) -> None:
    done = threading.Event()
    engine.at_boundary(lambda: (engine.pool.reset_prefix_cache(), done.set()))
    done.wait()


def run_kiln(engine: Engine, work, concurrency: int, tag: str) -> tuple[float, float]:
    """Keeps `concurrency` requests in flight (the next is submitted from the finishing one's sink).
    Returns (generated tokens/s, requests/s) over the whole workload."""
    lock, done, finals = threading.Lock(), threading.Event(), []
    pending = iter(enumerate(work))

    def submit():
        with lock:
            item = next(pending, None)
        if item is not None:
            i, (ids, new) = item
            engine.add_request(f"{tag}-{i}", ids, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), sink)

    def sink(delta):
        if delta.finish_reason is None:
            return
        finals.append(delta)
        if len(finals) == len(work):
            done.set()
        submit()

    reset_prefix_cache(engine)
    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit()
    done.wait()
    wall = time.perf_counter() - t0
    bad = [d for d in finals if d.finish_reason != "length" or d.usage["completion_tokens"] != work[int(d.request_id.rsplit("-", 1)[1])][1]]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not run to max_tokens: {bad[0]}")
    return sum(d.usage["completion_tokens"] for d in finals) / wall, len(work) / wall


def ttft(engine: Engine, ids: list[int], rid: str) -> tuple[float, int]:
    box, done = [], threading.Event()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0),
                       lambda d: (box.append(d), done.set()) if d.finish_reason else None)
    done.wait()
    return box[0].metrics["ttft_s"], box[0].usage["cached_tokens"]


def prefix_ttft(engine: Engine, tok, reps: int = 3) -> tuple[float, float, int]:
    """Best-of cold vs hit TTFT; the first repetition only compiles the shapes and is discarded."""
    head, tail = chat_parts(tok)
    body = tok.encode(" ".join(PASSAGES), add_special_tokens=False)
    prefix = (head + tok.encode("Answer questions about this document.\n\n", add_special_tokens=False) + body * 20)[:PREFIX]
    suffixes = [tok.encode(f"\n\nQuestion {i}: {INSTRUCTIONS[i % len(INSTRUCTIONS)]}", add_special_tokens=False) + tail
                for i in range(2 * reps)]
    cold, hit, cached = [], [], 0
    for r in range(reps):
        reset_prefix_cache(engine)
        cold.append(ttft(engine, prefix + suffixes[2 * r], f"cold-{r}")[0])
        t, cached = ttft(engine, prefix + suffixes[2 * r + 1], f"hit-{r}")
        hit.append(t)
    return min(cold[1:]), min(hit[1:]), cached


def host_overhead(engine: Engine, work) -> dict:
    """Times each engine iteration at 32 decode rows, split at the device computation.

    device = end of input building (model_step dispatch) .. outputs ready (so JAX's dispatch and
    the host-to-device copy of the inputs count as device); host = the rest of the iteration:
    scheduling, input building, result conversion, detokenization, sinks, inbox."""
    runner, marks, recs = engine.runner, {}, []
    run, sampling_arrays, results = runner.run, runner._sampling_arrays, runner._results

    def timed_run(rows):
        marks.clear()
        t0 = time.perf_counter()
        out = run(rows)
        recs.append((t0, marks["dispatch"], marks["ready"], time.perf_counter(), len(rows) == 32 and all(n == 1 for _, n in rows)))
        return out

    def timed_sampling(*args):
        out = sampling_arrays(*args)
        marks["dispatch"] = time.perf_counter()
        return out

    def timed_results(rows, shape, sampled, *args):
        jax.block_until_ready(sampled.tokens)
        marks["ready"] = time.perf_counter()
        return results(rows, shape, sampled, *args)

    runner.run, runner._sampling_arrays, runner._results = timed_run, timed_sampling, timed_results
    try:
        run_kiln(engine, [(ids, 64) for ids, _ in work], 32, "host")
    finally:
        del runner.run, runner._sampling_arrays, runner._results  # back to the class methods
    pairs = [(a, b) for a, b in zip(recs, recs[1:]) if a[4] and b[4]]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {
        "steps": len(pairs),
        "step_ms": med([b[0] - a[0] for a, b in pairs]),
        "device_ms": med([a[2] - a[1] for a, _ in pairs]),
        "host_ms": med([(b[0] - a[0]) - (a[2] - a[1]) for a, b in pairs]),
        "build_ms": med([a[1] - a[0] for a, _ in pairs]),  # shape, block tables, sampling arrays
        "results_ms": med([a[3] - a[2] for a, _ in pairs]),  # device -> python ints
        "between_ms": med([b[0] - a[3] for a, b in pairs]),  # after_step, outputs, sinks, schedule
    }


def run_hf(hf, work, batch: int) -> float:
    import torch

    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        tokens += sum(n for _, n in chunk)
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--hf-max-batch", type=int, default=64, help="larger transformers batches print n/a")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = concurrency (at least 4) requests")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    configure_compilation_cache(cache_dir() / "jax")

    model = load_model(show_progress=False)
    tok = model.tokenizer
    engine = Engine(model, EngineConfig(num_kv_blocks=2048, block_size=16, max_num_seqs=max(ROW_BUCKETS),
                                        max_num_batched_tokens=512, row_buckets=ROW_BUCKETS))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; model {model.model_id} float32; "
          f"engine: 2048 KV blocks x 16, max_num_seqs 64, 512 batched tokens, prefix caching on")
    workloads = {c: make_workload(tok, max(c, 4) if args.quick else max(c, 16)) for c in levels}
    kiln = {}
    try:
        for c in levels:
            work = workloads[c]
            c0, t0 = COUNTER.compiled, time.perf_counter()
            run_kiln(engine, work, c, f"warm{c}")
            c1, t1 = COUNTER.compiled, time.perf_counter()
            tps, rps = run_kiln(engine, work, c, f"c{c}")
            kiln[c] = (tps, rps, len(work), c1 - c0, COUNTER.compiled - c1, t1 - t0, time.perf_counter() - t1)
            print(f"  kiln c={c}: {len(work)} requests, warm pass {t1 - t0:.1f}s ({c1 - c0} compiled), "
                  f"timed {kiln[c][6]:.1f}s ({kiln[c][4]} compiled)", flush=True)
        c0 = COUNTER.compiled
        cold, hit, cached = prefix_ttft(engine, tok)
        print(f"  prefix TTFT done ({COUNTER.compiled - c0} compiled)", flush=True)
        c0 = COUNTER.compiled
        host = host_overhead(engine, make_workload(tok, 32))
        print(f"  host overhead done: {host['steps']} step pairs at 32 decode rows ({COUNTER.compiled - c0} compiled)", flush=True)
    finally:
        engine.shutdown()

    hf_tps: dict[int, float | None] = {}
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        print(f"transformers on torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        run_hf(hf, workloads[levels[0]][:1], 1)  # warm
        for c in levels:
            if c <= args.hf_max_batch:
                t0 = time.perf_counter()
                hf_tps[c] = run_hf(hf, workloads[c], c)
                print(f"  transformers batch {c}: {time.perf_counter() - t0:.1f}s", flush=True)

    header = f"{'concurrency':>11} | {'requests':>8} | {'kiln tok/s':>10} | {'kiln req/s':>10} | {'transformers tok/s':>18} | {'ratio':>6} | {'compiled warm/timed':>19}"
    print()
    print(header)
    print("-" * len(header))
    for c in levels:
        tps, rps, n, cw, ct = kiln[c][:5]
        h = hf_tps.get(c)
        hs = f"{h:.1f}" if h else ("skipped" if args.skip_hf else f"n/a (> {args.hf_max_batch})")
        print(f"{c:>11} | {n:>8} | {tps:>10.1f} | {rps:>10.2f} | {hs:>18} | {(f'{tps / h:.2f}x' if h else 'n/a'):>6} | {f'{cw}/{ct}':>19}")
    print()

    def line(label, value, target, ok):
        print(f"{label:<44} {value:<28} target {target:<8} {'met' if ok else 'MISSED'}")

    if 1 in kiln and 32 in kiln:
        r = kiln[32][0] / kiln[1][0]
        line("32-concurrent vs single-stream tok/s", f"{r:.1f}x", ">= 8x", r >= 8)
    if 32 in kiln and hf_tps.get(32):
        r = kiln[32][0] / hf_tps[32]
        line("kiln vs transformers at 32", f"{r:.2f}x", ">= 2x", r >= 2)
    line(f"prefix-hit TTFT vs cold ({PREFIX}-token prefix)", f"{hit * 1e3:.0f} / {cold * 1e3:.0f} ms = {hit / cold:.3f}x", "<= 0.2x", hit <= 0.2 * cold)
    share = host["host_ms"] / host["step_ms"]
    line("host overhead share at 32 decode rows", f"{host['host_ms']:.1f} / {host['step_ms']:.1f} ms = {share:.1%}", "<= 10%", share <= 0.10)
    print(f"  (hit reused {cached} cached prompt tokens; medians over {host['steps']} steps: device {host['device_ms']:.1f} ms, "
          f"input build {host['build_ms']:.2f} ms, result fetch {host['results_ms']:.2f} ms, "
          f"between steps {host['between_ms']:.2f} ms)")
    print("tok/s: generated tokens / wall time of the whole workload, prefill included; transformers runs the same "
          "requests in consecutive batches of `concurrency`")


if __name__ == "__main__":
    main()
