"""Served throughput: the real server streaming chat completions, side by side with Kiln's bare
model step and with transformers' batched generate, same weights and prompts, one run.

Phases (one at a time, so they never share the CPU):
  1. the bare jitted decode step at each concurrency's row count, mid-generation context, and
     (for the largest) a plain jitted chain of the same matmuls: the matmul peak;
  2. `python -m kiln.server` with the default model; at each concurrency c, c streaming chat
     requests (short prompts, --new-tokens each, greedy, ignore_eos) go out at once. A first
     round is untimed (it compiles the step buckets it needs); then --rounds timed rounds, each
     with new questions (only the chat template's system block is shared across prompts).
     "served decode" is the token rate while every stream is decoding: the window from the
     last stream's first token to the first stream's last token. Then a long shared-prefix
     prompt: TTFT cold vs prefix-cache hit;
  3. the largest concurrency again with every other stream constrained by a JSON Schema
     (response_format json_schema; a string field long enough that no stream can finish
     early), against the unconstrained rounds of the same server;
  4. transformers' generate on the first timed round's prompts, batch = c.

    python bench/serve_throughput.py [--concurrency 1,32] [--new-tokens 48] [--rounds 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import time

import httpx
import jax
from common import (
    bare_step,
    decoding_core,
    hf_generate,
    load_transformers,
    matmul_chain,
    start_server,
    step_flops,
    timed,
)

from kiln.models.loader import DEFAULT_MODEL_ID, load_model

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


async def stream_chat(client: httpx.AsyncClient, content: str, new_tokens: int, constrained: bool = False) -> dict:
    body = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = JSON_FORMAT
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


async def served_round(url: str, contents: list[str], new_tokens: int, half_constrained: bool = False) -> dict:
    limits = httpx.Limits(max_connections=len(contents) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_chat(client, c, new_tokens, half_constrained and i % 2 == 1)
                                         for i, c in enumerate(contents)))
        wall = time.perf_counter() - t0
    start, end = max(s["stamps"][0] for s in streams), min(s["stamps"][-1] for s in streams)
    in_window = sum(sum(start < t <= end for t in s["stamps"]) for s in streams)
    decode = in_window / (end - start) if end > start else float("nan")
    return {"tps": sum(s["tokens"] for s in streams) / wall, "decode_tps": decode, "wall": wall,
            "ttft": statistics.median(s["ttft"] for s in streams)}


def start_kiln(max_rows: int, dtype: str, log_level: str = "warning") -> tuple[subprocess.Popen, str]:
    return start_server({"KILN_ENGINE_MAX_NUM_SEQS": str(max_rows), "KILN_SERVER_LOG_LEVEL": log_level,
                         "KILN_MODEL_DTYPE": dtype})


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def warm_up(url: str, c: int, new_tokens: int, limit: int = 5, half_constrained: bool = False) -> int:
    """Untimed rounds (new questions each) until one neither compiles a step bucket nor runs a
    step padded while its bucket compiles; returns how many ran."""
    for n in range(1, limit + 1):
        before = metric(url, "kiln:compiled_step_buckets"), metric(url, "kiln:padded_steps_total")
        asyncio.run(served_round(url, questions(n, c), new_tokens, half_constrained))
        while metric(url, "kiln:capturing_step_buckets") > 0:  # let background compiles land
            time.sleep(0.5)
        if (metric(url, "kiln:compiled_step_buckets"), metric(url, "kiln:padded_steps_total")) == before:
            return n
    return limit


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

    for doc in ("Document 0. ", "Document 1. "):  # the first pair compiles the cold and the hit buckets
        cold = ttft(doc + text + "\n\nWhich paragraph mentions tea?")
        hit = ttft(doc + text + "\n\nWhich paragraph mentions glass?")
    return cold, hit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="Kiln's weights and KV (transformers stays float32)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--server-log-level", default="warning", help="info shows every step bucket the server compiles")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    new = args.new_tokens

    model = load_model(show_progress=False, dtype=args.dtype)
    tok = model.tokenizer
    render = lambda q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),  # noqa: E731
                                  add_special_tokens=False)
    prompt_len = statistics.median(len(render(q)) for q in questions(1, max(levels)))
    context = int(prompt_len + new // 2)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus); {model.model_id} "
          f"{model.dtype}; chat prompts of ~{prompt_len:.0f} tokens, {new} new tokens, greedy", flush=True)

    step, fraction = {}, None
    for c in levels:
        core = decoding_core(model, c, context)
        run, _ = bare_step(core)
        fns = {"step": run}
        if c == max(levels):
            fns["chain"] = matmul_chain(model.config, c, model.params["embed"].dtype)
        t = timed(fns, 10)
        step[c] = c / t["step"]
        if "chain" in t:
            fraction = t["chain"] / t["step"]
        core.close()
        del core, run
    print(f"  bare step measured at {context} tokens of context", flush=True)

    proc, url = start_kiln(max(levels), args.dtype, args.server_log_level)
    served, cold = {}, {}
    try:
        for c in levels:
            first = asyncio.run(served_round(url, questions(0, c), new))
            warm_rounds = warm_up(url, c, new)
            rounds = [asyncio.run(served_round(url, questions(r, c), new))
                      for r in range(warm_rounds + 1, warm_rounds + args.rounds + 1)]
            cold[c] = first
            served[c] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(f"  served c={c}: first round {first['wall']:.1f}s, then {warm_rounds} untimed rounds until no "
                  f"step compiled, then {served[c]['wall']:.1f}s per round", flush=True)
        prefix_cold, prefix_hit = prefix_ttft(url, tok)
        big = max(levels)
        warm = warm_up(url, big, new, half_constrained=True)
        mixed = [asyncio.run(served_round(url, questions(r, big), new, half_constrained=True))
                 for r in range(warm + 1, warm + args.rounds + 1)]
        constrained = {k: statistics.median(r[k] for r in mixed) for k in mixed[0]}
    finally:
        proc.terminate()
        proc.wait(60)

    hf_tps = {}
    if not args.skip_hf:
        import torch

        hf = load_transformers()
        print(f"transformers on torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        for c in levels:
            hf_tps[c] = c * new / timed({"hf": hf_generate(hf, [render(q) for q in questions(1, c)], new)},
                                        args.rounds)["hf"]

    header = (f"{'streams':>7} | {'served tok/s':>12} | {'transformers tok/s':>18} | {'served/hf':>9} | "
              f"{'served decode':>13} | {'model step':>10} | {'served vs step':>14} | {'TTFT':>7} | "
              f"{'first round':>11}")
    print(f"\n{header}\n{'-' * len(header)}")
    for c in levels:
        s, h = served[c], hf_tps.get(c)
        ratio = f"{s['tps'] / h:.2f}x" if h else "n/a"
        hs = f"{h:.1f}" if h else "skipped"
        decode = s["decode_tps"] if c > 1 else s["tps"]
        print(f"{c:>7} | {s['tps']:>12.1f} | {hs:>18} | {ratio:>9} | {decode:>13.1f} | {step[c]:>10.1f} | "
              f"{decode / step[c]:>13.2f}x | {s['ttft'] * 1e3:>5.0f}ms | {cold[c]['tps']:>7.1f} tok/s")
    print("served tok/s: output tokens / wall time of a warm round (prefill and HTTP included); served decode: "
          "token rate while all streams decode (c=1: the whole round); model step: rows / bare jitted step time; "
          "first round: the same workload on the fresh server, compiling its step buckets")
    print(f"bare {big}-row step: {step_flops(model.config, big) * step[big] / big / 1e9:.1f} GFLOP/s = "
          f"{fraction:.0%} of a plain jitted chain of the same matmuls")
    print(f"prefix-cache TTFT (~1,000-token shared prefix): cold {prefix_cold * 1e3:.0f} ms, "
          f"hit {prefix_hit * 1e3:.0f} ms ({prefix_hit / prefix_cold:.2f}x)")
    plain = served[big]
    print(f"{big} streams, half constrained by a JSON Schema: {constrained['tps']:.1f} tok/s served "
          f"({constrained['tps'] / plain['tps']:.2f}x the unconstrained {plain['tps']:.1f}), decode "
          f"{constrained['decode_tps']:.1f} tok/s ({constrained['decode_tps'] / plain['decode_tps']:.2f}x)")


if __name__ == "__main__":
    main()
