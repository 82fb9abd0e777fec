"""How far quantized weights move the default model from float32: greedy agreement and logprob error.

For each format, the same chat prompts (bench/common.py) decode `--new-tokens` greedily; reported:
the prompts whose tokens equal float32's, the share of tokens before the first difference, and, on
float32's own continuation (teacher-forced), the top-1 agreement and the logprob error of the
tokens float32 picked (mean and max). Each format runs in each of `--dtypes` (`[model] dtype`: a
bfloat16 model's quantized multiplies of 8 rows or more take bfloat16 operands, see
kiln.models.quant.product_dtype: its prefill and the teacher-forced pass; one-row decode stays float32).

    python bench/quantized_accuracy.py [--quantization int8,int4] [--dtypes float32,bfloat16]
                                       [--prompts 8] [--new-tokens 32]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from common import chat_prompts

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import forward, init_kv_cache
from kiln.models.generate import greedy_generate
from kiln.models.loader import load_model

step = jax.jit(forward, static_argnames=("cfg", "unroll"))


def logprobs(model, ids: list[int]) -> np.ndarray:
    blocks = -(-len(ids) // 16) + 1
    kv = init_kv_cache(model.config, num_blocks=blocks + 1, block_size=16)
    inputs = build_step_inputs([RowWork(list(ids), 0, list(range(1, blocks + 1)))], -(-len(ids) // 16) * 16)
    out, _ = step(model.params, kv, inputs, model.config)
    return np.asarray(jax.nn.log_softmax(np.asarray(out, np.float32)[: len(ids)], axis=-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="int8,int4")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    ref = load_model(show_progress=False, layer_loop="scan")
    prompts = chat_prompts(ref.tokenizer, args.prompts)
    want = [greedy_generate(ref.params, ref.config, [p], args.new_tokens)[0] for p in prompts]
    want_lp = [logprobs(ref, p + w) for p, w in zip(prompts, want, strict=True)]
    print(f"{ref.model_id}: {args.prompts} chat prompts, {args.new_tokens} greedy tokens each, against float32")
    print(f"{'weights':>16} | {'same tokens':>11} | {'tokens before a difference':>26} | {'top-1 agreement':>15} | "
          f"{'logprob error mean':>18} | {'max':>6}")
    for q, dtype in [(q, d) for q in args.quantization.split(",") for d in args.dtypes.split(",")]:
        model = load_model(show_progress=False, layer_loop="scan", quantization=q, dtype=dtype)
        same = prefix = 0
        agree, errors = [], []
        for p, w, lp in zip(prompts, want, want_lp, strict=True):
            got = greedy_generate(model.params, model.config, [p], args.new_tokens)[0]
            same += got == w
            prefix += next((i for i, (a, b) in enumerate(zip(got, w, strict=True)) if a != b), len(w))
            glp = logprobs(model, p + w)
            span = slice(len(p) - 1, len(p) + len(w) - 1)  # the positions that predict float32's tokens
            agree.append(np.mean(glp[span].argmax(-1) == lp[span].argmax(-1)))
            errors.append(np.abs(glp[span][np.arange(len(w)), w] - lp[span][np.arange(len(w)), w]))
        err = np.concatenate(errors)
        before = prefix / (len(prompts) * args.new_tokens)
        print(f"{q + ', ' + dtype:>16} | {same:>5} of {len(prompts):<3} | {before:>25.0%} | "
              f"{np.mean(agree):>14.1%} | {err.mean():>18.3f} | {err.max():>6.3f}")


if __name__ == "__main__":
    main()
