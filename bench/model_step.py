"""Decode throughput of Kiln's jitted step vs transformers' generate (and llama.cpp if installed).

Same weights (the default SmolLM2-135M GGUF, dequantized), same prompts, greedy, one run,
printed as a table. Kiln's column times prefill + N decode steps exactly as generate does;
the 'decode' columns time the decode steps alone. `--layer-loop` compares the two ways the
decoder can run its layers (see kiln.models.loader.default_layer_loop); `--quantization none,int8`
runs each weight format in turn, in the same run (kiln.models.quant).

    python bench/model_step.py [--new-tokens 32] [--batches 1,8,32] [--layer-loop unrolled|scan] [--dtype auto]
                               [--quantization none,int8]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import numpy as np
from common import chat_prompts, hf_generate, load_transformers

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import float_dtype, init_kv_cache
from kiln.models.generate import greedy_step
from kiln.models.loader import default_model_path, load_model

BLOCK = 16


def kiln_generate(model, prompts, new_tokens):
    """Returns (total seconds, decode-only seconds) for prefill + new_tokens greedy tokens."""
    cfg, n = model.config, len(prompts)
    per_row = math.ceil((max(map(len, prompts)) + new_tokens) / BLOCK)
    kv = init_kv_cache(cfg, n * per_row, BLOCK, float_dtype(model.params))
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(n)]
    t0 = time.perf_counter()
    inputs = build_step_inputs([RowWork(p, 0, tables[i]) for i, p in enumerate(prompts)], BLOCK)
    nxt, kv = greedy_step(model.params, kv, inputs, cfg)
    last = np.asarray(nxt)
    t1 = time.perf_counter()
    for step in range(new_tokens - 1):
        rows = [RowWork([int(last[i])], len(prompts[i]) + step, tables[i]) for i in range(n)]
        nxt, kv = greedy_step(model.params, kv, build_step_inputs(rows, BLOCK), cfg)
        last = np.asarray(nxt)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


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
    ap.add_argument("--layer-loop", choices=("unrolled", "scan"), default=None, help="default: per backend")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none", help="weight formats to run, comma-separated: none,int8,int4")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    new = args.new_tokens

    models = [load_model(os.environ.get("KILN_MODEL_PATH") or None, show_progress=False, layer_loop=args.layer_loop,
                         dtype=args.dtype, quantization=q)
              for q in args.quantization.split(",")]
    model = models[0]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {model.model_id} {model.dtype}; {new} new tokens")
    for m in models:
        weights = sum(x.nbytes for x in jax.tree.leaves(m.params)) / 2**20
        layout = "unrolled" if isinstance(m.params["layers"], list) else "scan"
        print(f"weights {m.quantization}: {weights:.0f} MiB on the device, layers {layout}")
    hf = None if args.skip_hf else load_transformers("float32" if jax.default_backend() == "cpu" else model.dtype)
    llm = None
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=str(default_model_path()), n_ctx=512, n_batch=512, verbose=False)
    except ImportError:
        pass

    rows = []
    for model, b in ((m, b) for b in batches for m in models):
        prompts = chat_prompts(model.tokenizer, b)
        kiln_generate(model, prompts, new)  # compile these shapes
        total, decode = min(kiln_generate(model, prompts, new) for _ in range(2))
        hf_tps = hf_step_tps = cpp_tps = None
        if hf is not None:
            hf_generate(hf, prompts[:1], 2)()
            hf_total = min(_seconds(hf_generate(hf, prompts, new)) for _ in range(2))
            hf_first = min(_seconds(hf_generate(hf, prompts, 1)) for _ in range(2))  # prefill + first token
            hf_tps, hf_step_tps = b * new / hf_total, b * (new - 1) / (hf_total - hf_first)
        if llm is not None and b == 1:
            cpp_tps = new / min(llama_cpp_generate(llm, prompts[0], new) for _ in range(2))
        rows.append((model.quantization, b, b * new / total, hf_tps, b * (new - 1) / decode, hf_step_tps, cpp_tps))

    header = (f"{'weights':>7} | {'batch':>5} | {'kiln tok/s':>10} | {'hf tok/s':>9} | {'ratio':>6} | "
              f"{'kiln decode':>11} | {'hf decode':>9} | {'ratio':>6} | {'llama.cpp Q4_1':>14}")
    print(f"{header}\n{'-' * len(header)}")
    fmt = lambda x: f"{x:.1f}" if x else "n/a"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if b else "n/a"  # noqa: E731
    for q, b, k, h, ks, hs, c in rows:
        cpp = fmt(c) if llm is not None else "not installed"
        print(f"{q:>7} | {b:>5} | {k:>10.1f} | {fmt(h):>9} | {ratio(k, h):>6} | {ks:>11.1f} | {fmt(hs):>9} | "
              f"{ratio(ks, hs):>6} | {cpp:>14}")
    print("tok/s: prefill + all new tokens (what a user waits for); decode: the per-token steps after the first token")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
