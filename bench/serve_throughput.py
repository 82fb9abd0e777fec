"""Served throughput: the real server streaming chat completions, side by side with Kiln's bare
model step and with transformers' batched generate, same weights and prompts, one run.

Phases (one at a time, so they never share the CPU):
  1. the bare decode step (forward and sampler executables) at each concurrency's row count,
     mid-generation context, and (for the largest) a plain jitted chain of the same matmuls: the
     matmul peak; prefill of 32 short chat prompts through the engine against a chain at prefill
     shapes, as a fraction of that peak (FLOPs per token times tokens, over time); the host time
     of an engine decode step, and how much of it the device step does not hide, with async
     scheduling on and off, for the model and for its first two layers (an accelerator-sized step);
  2. startup: `python -m kiln.server` on an empty executable cache (cold: the step set is built)
     and again on the filled one (warm: loaded), each timed until /health says ready;
  3. for each concurrency c, a freshly started server: the first round of c streaming chat
     requests (short prompts, --new-tokens each, greedy, ignore_eos) is its first contact, then
     --rounds timed rounds with new questions (only the chat template's system block is shared).
     "served decode" is the token rate while every stream is decoding: the window from the last
     stream's first token to the first stream's last token. Then a long shared-prefix prompt:
     TTFT cold vs prefix-cache hit; then the largest concurrency with every other stream
     constrained by a JSON Schema (a string field long enough that no stream finishes early), and
     with every other stream sampled with top_p (the others greedy);
  4. transformers' generate on the same prompts, batch = c.
Every server reports how many steps waited for a compile (`kiln:step_compile_waits_total`): 0 is the
promise of the bounded step set.

    python bench/serve_throughput.py [--concurrency 1,32] [--new-tokens 48] [--rounds 2] [--skip-hf] [--skip-cold]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import httpx
import jax
import jax.numpy as jnp
from common import (
    bare_step,
    chat_prompts,
    decoding_core,
    engine_step_times,
    first_layers,
    hf_generate,
    load_transformers,
    matmul_chain,
    start_server,
    step_flops,
    timed,
)

from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.params import SamplingParams
from kiln.engine.warmup import build_step_set
from kiln.models.decoder import float_dtype
from kiln.models.loader import DEFAULT_MODEL_ID, load_model

MODEL_ID = DEFAULT_MODEL_ID  # the served model's id (main sets it from the loaded model)

TOPICS = ["the sea", "copper", "bicycles", "the moon", "bread", "rivers", "glass", "owls", "volcanoes", "tea",
          "trains", "honey", "clocks", "maps", "snow", "silk"]
FORMS = ["Write two sentences about {}.", "What is interesting about {}?", "Explain {} to a child.",
         "Give three facts about {}."]


def questions(round_: int, n: int) -> list[str]:
    return [f"({round_}.{i}) " + FORMS[i % len(FORMS)].format(TOPICS[(i + round_) % len(TOPICS)]) for i in range(n)]


# what the constrained streams follow: the answer cannot be complete within the benchmark's tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "answer"],
          "properties": {"topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "minLength": 600}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
# what every other stream of the mixed rounds adds to its request
HALVES = {"constrained by a JSON Schema": {"response_format": JSON_FORMAT},
          "sampled with top_p 0.9 at temperature 0.8": {"temperature": 0.8, "top_p": 0.9, "seed": 7}}


async def stream_chat(client: httpx.AsyncClient, content: str, new_tokens: int, extra: dict | None = None) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    t0, stamps, usage = time.perf_counter(), [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            usage = event.get("usage") or usage
    return {"t0": t0, "stamps": stamps, "tokens": usage["completion_tokens"], "ttft": stamps[0] - t0}


async def served_round(url: str, contents: list[str], new_tokens: int, half: dict | None = None) -> dict:
    """Every stream of `contents` at once; every other one with `half` added to its request."""
    limits = httpx.Limits(max_connections=len(contents) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_chat(client, c, new_tokens, half if i % 2 else None)
                                         for i, c in enumerate(contents)))
        wall = time.perf_counter() - t0
    start, end = max(s["stamps"][0] for s in streams), min(s["stamps"][-1] for s in streams)
    in_window = sum(sum(start < t <= end for t in s["stamps"]) for s in streams)
    decode = in_window / (end - start) if end > start else float("nan")
    return {"tps": sum(s["tokens"] for s in streams) / wall, "decode_tps": decode, "wall": wall,
            "ttft": statistics.median(s["ttft"] for s in streams)}


def start_kiln(max_rows: int, dtype: str, log_level: str = "warning", **env) -> tuple[subprocess.Popen, str, float]:
    """A server and the seconds it took to report ready."""
    t0 = time.perf_counter()
    proc, url = start_server({"KILN_ENGINE_MAX_NUM_SEQS": str(max_rows), "KILN_SERVER_LOG_LEVEL": log_level,
                              "KILN_MODEL_DTYPE": dtype, **env})
    return proc, url, time.perf_counter() - t0


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def startup(url: str) -> dict:
    return httpx.get(url + "/v1/config", timeout=30).json()["step_set"]["startup"]


def prefix_ttft(url: str, tok) -> tuple[float, float]:
    """TTFT of a ~1,000-token document plus a question: cold, then with the same document and a
    new question (its blocks come from the prefix cache)."""
    text = " ".join(f"Paragraph {i}: " + FORMS[i % 4].format(TOPICS[i % len(TOPICS)]) for i in range(120))
    text = tok.decode(tok.encode(text, add_special_tokens=False)[:1000])

    def ttft(content: str) -> float:
        async def go():
            async with httpx.AsyncClient(base_url=url, timeout=900) as client:
                return (await stream_chat(client, content, 1))["ttft"]

        return asyncio.run(go())

    cold = ttft("Document 0. " + text + "\n\nWhich paragraph mentions tea?")
    hit = ttft("Document 0. " + text + "\n\nWhich paragraph mentions glass?")
    return cold, hit


def prefill_fraction(model, n: int = 32) -> tuple[float, float, float]:
    """Prefill of n short chat prompts through an engine core (default settings, no prefix cache):
    (GFLOP/s of the prompts' FLOPs per token, the matmul peak at prefill shapes, seconds). The core
    builds its step set first, as a server does before it is ready: without it the first steps would
    build only the buckets they need, and the last chunk, which a smaller bucket serves, would run
    padded in the largest one already built."""
    core = EngineCore(model, EngineConfig(enable_prefix_caching=False))
    build_step_set(core.runner, show_progress=False, defer_lora=True)
    prompts = chat_prompts(model.tokenizer, n)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run():
        for i, p in enumerate(prompts):
            for req in core.make_requests(f"p{i}-{time.perf_counter()}", p, greedy):
                core.add_request(req)
        while core.has_work():
            core.step()

    seconds = timed({"prefill": run}, 3)["prefill"]  # its untimed first call builds the buckets it uses
    flops = sum(map(len, prompts)) * core.runner.flops_per_token + n * 2 * model.config.hidden_size * \
        model.config.vocab_size
    chain = matmul_chain(model.config, 512, float_dtype(model.params))
    peak = step_flops(model.config, 512) / timed({"chain": chain}, 5)["chain"]
    core.close()
    return flops / seconds / 1e9, peak / 1e9, seconds


def host_time(model, rows: int, context: int) -> dict[tuple[int, str], dict[str, float]]:
    """A `rows`-row decode step inside the engine against the bare step, with async scheduling on and
    off (the engine adds scheduling, inputs, detokenizing and the update: `engine_step_times`), for the
    model and for its first two layers (a step of a few milliseconds: an accelerator's step size)."""
    times = {}
    for layers in (model.config.num_layers, 2):
        cut = model if layers == model.config.num_layers else first_layers(model, layers)
        for mode in ("on", "off"):
            core = decoding_core(cut, rows, context, async_scheduling=mode)
            times[layers, mode] = engine_step_times(core)
            core.close()
    return times


def served(args, c: int, new: int, url: str) -> dict:
    first = asyncio.run(served_round(url, questions(0, c), new))
    rounds = [asyncio.run(served_round(url, questions(r, c), new)) for r in range(1, args.rounds + 1)]
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out["first"] = first
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto",
                    help="Kiln's weights and KV; transformers runs in the same dtype (auto: float32 on a CPU)")
    ap.add_argument("--kv-cache-dtype", default=os.environ.get("KILN_ENGINE_KV_CACHE_DTYPE", "auto"),
                    help="Kiln's [engine] kv_cache_dtype (auto: the model's; bfloat16: half the KV bytes)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-cold", action="store_true", help="skip the cold start (an empty executable cache)")
    ap.add_argument("--server-log-level", default="warning", help="info shows the server's startup and steps")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    new = args.new_tokens
    big = max(levels)
    os.environ["KILN_ENGINE_KV_CACHE_DTYPE"] = args.kv_cache_dtype  # every server this bench starts

    global MODEL_ID
    model = load_model(os.environ.get("KILN_MODEL_PATH") or None, show_progress=False, dtype=args.dtype)
    MODEL_ID, tok = model.model_id, model.tokenizer
    render = lambda q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),  # noqa: E731
                                  add_special_tokens=False)
    prompt_len = statistics.median(len(render(q)) for q in questions(1, big))
    context = int(prompt_len + new // 2)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus); {model.model_id} "
          f"{model.dtype}, KV pool {args.kv_cache_dtype}; chat prompts of ~{prompt_len:.0f} tokens, {new} new tokens, "
          "greedy", flush=True)

    step, fraction = {}, None
    for c in levels:
        core = decoding_core(model, c, context, kv_cache_dtype=args.kv_cache_dtype)
        run, _ = bare_step(core)
        fns = {"step": run}
        if c == big:
            fns["chain"] = matmul_chain(model.config, c, float_dtype(model.params))
        t = timed(fns, 10)
        step[c] = c / t["step"]
        if "chain" in t:
            fraction = t["chain"] / t["step"]
        core.close()
        del core, run
    print(f"  bare step at {context} tokens of context: " + ", ".join(f"{c} rows {step[c]:.1f} tok/s" for c in levels),
          flush=True)
    prefill_gflops, prefill_peak, prefill_s = prefill_fraction(model, 32)
    steps = host_time(model, big, context)
    print(f"  prefill of 32 short chat prompts: {prefill_s:.2f}s, {prefill_gflops:.1f} GFLOP/s = "
          f"{prefill_gflops / prefill_peak:.0%} of the matmul peak at prefill shapes ({prefill_peak:.1f} GFLOP/s)")
    for layers in (model.config.num_layers, 2):
        on, off = steps[layers, "on"], steps[layers, "off"]
        print(f"  host time of a {big}-row decode step ({layers} layers): {on['host'] * 1e3:.1f} ms; not hidden behind "
              f"the device step: {on['added'] * 1e3:.1f} ms with async scheduling on (engine step "
              f"{on['engine'] * 1e3:.1f} ms vs bare {on['bare'] * 1e3:.1f} ms), {off['added'] * 1e3:.1f} ms with it "
              f"off (engine step {off['engine'] * 1e3:.1f} ms vs bare {off['bare'] * 1e3:.1f} ms)")

    starts = {}
    if not args.skip_cold:
        with tempfile.TemporaryDirectory() as cold_dir:
            for name in ("cold", "warm"):
                proc, url, ready = start_kiln(big, args.dtype, args.server_log_level,
                                              KILN_CACHE_COMPILATION_DIR=cold_dir)
                starts[name] = (ready, startup(url))
                stop(proc)
                print(f"  {name} start: ready in {ready:.1f}s", flush=True)

    results, waits, halves = {}, {}, {}
    for c in levels:
        proc, url, ready = start_kiln(big, args.dtype, args.server_log_level)
        info = startup(url)  # with --skip-cold on an empty cache, the first of these builds the set
        starts.setdefault("cold" if info["built"] else "warm", (ready, info))
        print(f"  start: ready in {ready:.1f}s ({info['built']} built, {info['loaded']} loaded)", flush=True)
        try:
            results[c] = served(args, c, new, url)
            print(f"  served c={c}: first contact {results[c]['first']['wall']:.1f}s, then "
                  f"{results[c]['wall']:.1f}s per round ({results[c]['tps']:.1f} tok/s, TTFT "
                  f"{results[c]['ttft'] * 1e3:.0f} ms)", flush=True)
            if c == big:
                prefix_cold, prefix_hit = prefix_ttft(url, tok)
                # a first constrained round compiles its grammar
                asyncio.run(served_round(url, questions(90, big), new, HALVES["constrained by a JSON Schema"]))
                for name, half in HALVES.items():
                    mixed = [asyncio.run(served_round(url, questions(r, big), new, half))
                             for r in range(91, 91 + args.rounds)]
                    halves[name] = {k: statistics.median(r[k] for r in mixed) for k in mixed[0]}
            waits[c] = metric(url, "kiln:step_compile_waits_total")
        finally:
            stop(proc)

    hf_tps = {}
    if not args.skip_hf:
        import torch

        hf = load_transformers(jnp.dtype(model.dtype).name)
        print(f"transformers on torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        for c in levels:
            hf_tps[c] = c * new / timed({"hf": hf_generate(hf, [render(q) for q in questions(1, c)], new)},
                                        args.rounds)["hf"]

    header = (f"{'streams':>7} | {'served tok/s':>12} | {'transformers tok/s':>18} | {'served/hf':>9} | "
              f"{'served decode':>13} | {'model step':>10} | {'served vs step':>14} | {'TTFT':>7} | "
              f"{'first contact':>13} | {'first/later':>11}")
    print(f"\n{header}\n{'-' * len(header)}")
    for c in levels:
        s, h = results[c], hf_tps.get(c)
        ratio = f"{s['tps'] / h:.2f}x" if h else "n/a"
        hs = f"{h:.1f}" if h else "skipped"
        decode = s["decode_tps"] if c > 1 else s["tps"]
        first = s["first"]["tps"]
        print(f"{c:>7} | {s['tps']:>12.1f} | {hs:>18} | {ratio:>9} | {decode:>13.1f} | {step[c]:>10.1f} | "
              f"{decode / step[c]:>13.2f}x | {s['ttft'] * 1e3:>5.0f}ms | {first:>7.1f} tok/s | "
              f"{first / s['tps']:>10.2f}x")
    print("served tok/s: output tokens / wall time of a later round (prefill and HTTP included); served decode: "
          "token rate while all streams decode (c=1: the whole round); model step: rows / bare step time; "
          "first contact: the same workload as the first round a freshly started server sees")
    print(f"steps that waited for a compile: {', '.join(f'c={c}: {int(w)}' for c, w in waits.items())}")
    print(f"bare {big}-row step: {step_flops(model.config, big) * step[big] / big / 1e9:.1f} GFLOP/s = "
          f"{fraction:.0%} of a plain jitted chain of the same matmuls")
    for name, (ready, info) in starts.items():
        print(f"{name} start: ready in {ready:.1f}s; step set {info['executables']} executables, "
              f"{info['built']} built, {info['loaded']} loaded, in {info['seconds']:.1f}s; "
              f"{info['memory_mappings']} memory mappings with the set resident")
    print(f"prefix-cache TTFT (~1,000-token shared prefix): cold {prefix_cold * 1e3:.0f} ms, "
          f"hit {prefix_hit * 1e3:.0f} ms ({prefix_hit / prefix_cold:.2f}x)")
    plain = results[big]
    for name, mixed in halves.items():
        print(f"{big} streams, half {name}: {mixed['tps']:.1f} tok/s served ({mixed['tps'] / plain['tps']:.2f}x the "
              f"all-greedy {plain['tps']:.1f}), decode {mixed['decode_tps']:.1f} tok/s "
              f"({mixed['decode_tps'] / plain['decode_tps']:.2f}x)")


if __name__ == "__main__":
    main()
