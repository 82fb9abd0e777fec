"""Decode throughput of Kiln's jitted step vs transformers' generate (and llama.cpp if installed).

Same weights (the default SmolLM2-135M GGUF, dequantized to float32), same prompts, greedy,
one run, printed as a table. Kiln's column times prefill + N decode steps exactly as
generate does; the 'step only' column times the decode steps alone.

    python bench/model_step.py [--new-tokens 32] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.generate import greedy_step
from kiln.models.loader import default_model_path, load_model

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "What is the capital of France?",
    "List three uses of copper.",
]
BLOCK = 16


def kiln_generate(model, prompts, new_tokens, unroll):
    """Returns (total seconds, decode-only seconds) for prefill + new_tokens greedy tokens."""
    cfg, n = model.config, len(prompts)
    per_row = math.ceil((max(map(len, prompts)) + new_tokens) / BLOCK)
    kv = init_kv_cache(cfg, n * per_row, BLOCK)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(n)]
    t0 = time.perf_counter()
    inputs = build_step_inputs([RowWork(p, 0, tables[i]) for i, p in enumerate(prompts)], BLOCK, n * per_row)
    nxt, kv = greedy_step(model.params, kv, inputs, cfg, None, unroll)
    last = np.asarray(nxt)
    t1 = time.perf_counter()
    for step in range(new_tokens - 1):
        rows = [RowWork([int(last[i])], len(prompts[i]) + step, tables[i]) for i in range(n)]
        nxt, kv = greedy_step(model.params, kv, build_step_inputs(rows, BLOCK, n * per_row), cfg, None, unroll)
        last = np.asarray(nxt)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def hf_generate(hf, prompts, new_tokens):
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def llama_cpp_generate(llm, prompt_ids, new_tokens):
    t0 = time.perf_counter()
    llm.reset()
    n = 0
    for _ in llm.generate(prompt_ids, top_k=1, temp=0.0):
        n += 1
        if n >= new_tokens:
            break
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--unroll", default="1", help="layer scan unroll factor (1 = scan, 'full' = unrolled)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    unroll = True if args.unroll == "full" else int(args.unroll)
    batches = [int(b) for b in args.batches.split(",")]

    model = load_model(show_progress=False)
    tok = model.tokenizer
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; model {model.model_id} float32; {args.new_tokens} new tokens")

    hf = None
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        print(f"transformers on torch {torch.__version__}, {torch.get_num_threads()} threads")
    llm = None
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=str(default_model_path()), n_ctx=512, n_batch=512, verbose=False)
    except ImportError:
        pass

    rows = []
    for b in batches:
        prompts = [chat[i % len(chat)] for i in range(b)]
        kiln_generate(model, prompts, args.new_tokens, unroll)  # compile these shapes
        total, decode = min(kiln_generate(model, prompts, args.new_tokens, unroll) for _ in range(2))
        kiln_tps = b * args.new_tokens / total
        step_tps = b * (args.new_tokens - 1) / decode
        hf_tps = hf_step_tps = None
        if hf is not None:
            hf_generate(hf, prompts[:1], 2)
            hf_total = min(hf_generate(hf, prompts, args.new_tokens) for _ in range(2))
            hf_first = min(hf_generate(hf, prompts, 1) for _ in range(2))  # prefill + first token
            hf_tps = b * args.new_tokens / hf_total
            hf_step_tps = b * (args.new_tokens - 1) / (hf_total - hf_first)
        cpp_tps = None
        if llm is not None and b == 1:
            cpp_tps = args.new_tokens / min(llama_cpp_generate(llm, prompts[0], args.new_tokens) for _ in range(2))
        rows.append((b, kiln_tps, hf_tps, step_tps, hf_step_tps, cpp_tps))

    header = (
        f"{'batch':>5} | {'kiln tok/s':>10} | {'hf tok/s':>9} | {'ratio':>6} | "
        f"{'kiln decode':>11} | {'hf decode':>9} | {'ratio':>6} | {'llama.cpp Q4_1':>14}"
    )
    print(header)
    print("-" * len(header))
    fmt = lambda x: f"{x:.1f}" if x else "n/a"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if b else "n/a"  # noqa: E731
    for b, k, h, ks, hs, c in rows:
        cpp = fmt(c) if llm is not None else "not installed"
        print(f"{b:>5} | {k:>10.1f} | {fmt(h):>9} | {ratio(k, h):>6} | {ks:>11.1f} | {fmt(hs):>9} | {ratio(ks, hs):>6} | {cpp:>14}")
    print("tok/s: prefill + all new tokens (what a user waits for); decode: the per-token steps after the first token")


if __name__ == "__main__":
    main()
