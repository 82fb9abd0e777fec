"""One GPU benchmark, one table: how Kiln uses a GPU, measured against the device itself and against
transformers/TRL on the same device, in one run of at most about 8 minutes.

- decode tok/s of the engine's step at 1, 32 and 128 rows in the weights' dtype (bfloat16 by default),
  and the host time per step that the device does not hide (the engine's step less the bare
  forward + sampler of the same rows; and the host's own work per step);
- the bytes a decode step reads (weights and the rows' KV cache) per second of its bare step,
  against the device's memory bandwidth as a streaming read+write measures it;
- prefill tok/s, and its matmul FLOPs per second against a large matmul's in the same dtype;
- the paged attention's Pallas kernel against XLA's gathers, at 32 rows;
- multi-LoRA: 32 rows decoding with 4 distinct adapters against none;
- an SFT step and a GRPO step (rollouts and training) against TRL on the same GPU and weights.

It installs nothing and never downloads: it needs JAX, Flax, Optax, orbax, torch, transformers and
peft, with Kiln's own dependencies installed beforehand (bench/gpu/prepare.py gathers the wheels),
and TRL with datasets for its peer columns (or --skip-trl), and stops naming what is missing. The
model is `--model` (an HF directory; default KILN_MODEL_PATH, else the default model converted).

    python bench/gpu.py [--model DIR] [--dtype bfloat16] [--skip-trl]
    python bench/gpu.py --dry-run     # the same code paths at tiny sizes, on any device (a CPU too)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REQUIRED = ("jax", "flax", "optax", "orbax.checkpoint", "torch", "transformers", "peft", "kiln", "litestar", "msgspec")
PEERS = ("trl", "datasets")  # the training steps' peer (not needed with --skip-trl)
HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Sizes:
    decode_rows: tuple[int, ...]
    context: int  # tokens of context each decoding row holds
    blocks: int  # timed blocks of decode steps (see common.engine_step_times)
    steps: int  # decode steps per block
    prefill_prompts: int
    prefill_tokens: int  # per prompt
    lora_rows: int
    stream_mib: int  # the array the bandwidth probe reads and writes
    matmul: int  # n of the n x n x n matmul of the FLOPs probe
    sft_batch: int
    sft_seq: int
    train_steps: int
    grpo_prompts: int
    grpo_generations: int
    grpo_tokens: int
    layers: int | None  # the dry run's random model keeps this many layers


FULL = Sizes(decode_rows=(1, 32, 128), context=512, blocks=3, steps=16, prefill_prompts=16, prefill_tokens=1024,
             lora_rows=32, stream_mib=1024, matmul=8192, sft_batch=8, sft_seq=512, train_steps=5, grpo_prompts=8,
             grpo_generations=8, grpo_tokens=128, layers=None)
DRY = Sizes(decode_rows=(1, 4), context=24, blocks=1, steps=2, prefill_prompts=2, prefill_tokens=40, lora_rows=4,
            stream_mib=4, matmul=128, sft_batch=2, sft_seq=128, train_steps=1, grpo_prompts=2, grpo_generations=2,
            grpo_tokens=4, layers=2)


def check_dependencies(skip_trl: bool) -> None:
    missing = []
    for name in REQUIRED + (() if skip_trl else PEERS):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        print("bench/gpu.py: missing: " + "; ".join(missing) + ". This bench installs nothing: install them first "
              "(bench/gpu/prepare.py gathers Kiln's wheels), or pass --skip-trl to leave out TRL.", file=sys.stderr)
        sys.exit(2)


def median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(mib: int) -> float:
    """Bytes per second of a streaming read and write of `mib` MiB (what a memory-bound step can reach)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib << 20) // 4, jnp.float32)
    scale = jax.jit(lambda x: x * 1.0001)
    return 2 * x.nbytes / median_seconds(lambda: scale(x).block_until_ready())


def matmul_flops(n: int, dtype) -> float:
    """FLOPs per second of an n x n x n matmul in `dtype` with float32 sums (the device's usable peak)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n)).astype(dtype)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / median_seconds(lambda: mm(a, a).block_until_ready())


def layer_flops(cfg) -> float:
    """Matmul FLOPs per token of the layers (the LM head apart)."""
    from kiln.models.lora import module_shapes

    return 2.0 * cfg.num_layers * sum(i * o for i, o in module_shapes(cfg).values())


def weight_bytes(params) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(params) if hasattr(x, "nbytes"))


def decode(model, rows: int, sizes: Sizes, attention: str = "auto") -> dict:
    """The engine's decode step at `rows` rows of `sizes.context` tokens: tok/s, host time, bytes read.
    `attention`: the paged attention's kernel ([engine] attention)."""
    from common import decoding_core, engine_step_times

    cfg = model.config
    buckets = tuple(2**i for i in range(int(math.log2(rows)) + 1))
    blocks_needed = rows * -(-(sizes.context + sizes.blocks * sizes.steps * 3 + 8) // 16)
    core = decoding_core(model, rows, sizes.context, num_kv_blocks=blocks_needed + 64, decode_row_buckets=buckets,
                         max_num_batched_tokens=max(512, rows), max_num_seqs=rows, attention=attention)
    times = engine_step_times(core, sizes.blocks, sizes.steps)
    kv_item = core.runner.kv.k.dtype.itemsize
    kv_bytes = rows * sizes.context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_item
    read = weight_bytes(core.runner.params) + kv_bytes
    return {"kernel": core.runner.attention, "tok_s": rows / times["engine"], "bare_tok_s": rows / times["bare"],
            "bytes": read, "bytes_s": read / times["bare"], "unhidden_ms": 1e3 * max(times["added"], 0.0),
            "host_ms": 1e3 * times["host"]}


def prefill(model, sizes: Sizes) -> dict:
    """Prompts of `sizes.prefill_tokens` tokens through the engine to their first token: tok/s and matmul
    FLOPs per second (layers over every token, the head over each prompt's last, attention's two
    products over the causal half)."""
    from kiln.engine.config import EngineConfig
    from kiln.engine.core import EngineCore
    from kiln.engine.params import SamplingParams
    from kiln.engine.warmup import build_step_set

    cfg, n, length = model.config, sizes.prefill_prompts, sizes.prefill_tokens
    core = EngineCore(model, EngineConfig(num_kv_blocks=n * (length // 16 + 2) + 16, max_num_seqs=n))
    build_step_set(core.runner, show_progress=False, defer_lora=True)  # every bucket, as a server has
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(round_: int) -> None:
        for i in range(n):
            prompt = [(7 * i + 13 * j + round_) % (cfg.vocab_size - 10) + 5 for j in range(length)]
            for req in core.make_requests(f"p{round_}-{i}", prompt, one):
                core.add_request(req)
        while core.scheduler.waiting or core.scheduler.running:
            core.step()
        core.flush()

    run(0)  # primes the steps (and caches nothing the timed rounds reuse: other prompts)
    seconds = statistics.median(_timed(lambda r=r: run(r)) for r in (1, 2, 3))
    tokens = n * length
    attention = n * 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * length / 2
    flops = layer_flops(cfg) * tokens + 2.0 * n * cfg.hidden_size * cfg.vocab_size + attention
    return {"tok_s": tokens / seconds, "flops_s": flops / seconds}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def multi_lora(model, sizes: Sizes) -> dict:
    from lora_decode import kiln_decode

    rates = kiln_decode(model, rank=16, rows=sizes.lora_rows, steps=sizes.steps, rounds=max(sizes.blocks, 1))
    return {"none": rates["no adapter"], "four": rates["4 adapters"]}


def sft_steps(model, model_dir: Path, sizes: Sizes, dtype: str, skip_trl: bool) -> dict:
    from train_sft import DATA, kiln_sft, trl_sft

    from kiln.train.data import load_examples

    args = argparse.Namespace(rank=16, batch_size=sizes.sft_batch, max_seq_len=sizes.sft_seq, warmup=1,
                              steps=sizes.train_steps)
    examples = load_examples(DATA, model.tokenizer, sizes.sft_seq)
    kiln = kiln_sft(model, examples, args)
    trl = None if skip_trl else trl_sft(examples, args, False, model_dir=model_dir, dtype=dtype)
    return {"kiln": kiln["tokens_per_second"], "trl": trl["tokens_per_second"] if trl else None}


def grpo_steps(model, model_dir: Path, sizes: Sizes, dtype: str, skip_trl: bool) -> dict:
    from train_grpo import kiln_grpo, questions, trl_grpo

    args = argparse.Namespace(new_tokens=sizes.grpo_tokens, warmup=1, steps=sizes.train_steps,
                              prompts=sizes.grpo_prompts, generations=sizes.grpo_generations, rank=16,
                              micro=min(16, sizes.grpo_prompts * sizes.grpo_generations))
    chats = questions(max(sizes.grpo_prompts * 4, 8))
    kiln = kiln_grpo(model, chats, args)
    trl = None if skip_trl else trl_grpo(chats, args, model_dir=model_dir, dtype=dtype)
    return {"kiln": kiln["step"], "trl": trl["step"] if trl else None}


def model_directory(args, out: Path) -> Path:
    """The HF directory both sides load: --model, KILN_MODEL_PATH, or the default model converted; in
    a dry run, a random model of its shape with `DRY.layers` layers (bench/random_model.py)."""
    from common import model_path

    from kiln.models.loader import convert_gguf

    path = Path(args.model) if args.model else model_path()
    if path.suffix == ".gguf":
        path = convert_gguf(path, show_progress=False)[0]
    if not args.dry_run:
        return path
    from random_model import write_random_model  # in this process: torch is imported already (the TRL side)

    write_random_model(path, out, DRY.layers)
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an HF directory or GGUF file (default: KILN_MODEL_PATH, else the default model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-trl", action="store_true", help="no TRL steps (their columns show -)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes and a random 2-layer model, on any device")
    args = ap.parse_args()
    check_dependencies(args.skip_trl)
    sys.path.insert(0, str(HERE))
    import jax
    import jax.numpy as jnp

    from kiln.models.loader import load_model

    sizes = DRY if args.dry_run else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_directory(args, Path(tmp) / "model")
        model = load_model(str(model_dir), dtype=args.dtype, show_progress=False)
        device = jax.devices()[0]
        print(f"bench/gpu.py on {device.platform} ({getattr(device, 'device_kind', '?')}), jax {jax.__version__}; "
              f"{model.model_id}: {model.config.num_layers} layers, {args.dtype}"
              f"{'; dry run at tiny sizes' if args.dry_run else ''}")
        bandwidth = memory_bandwidth(sizes.stream_mib)
        peak = matmul_flops(sizes.matmul, jnp.dtype(args.dtype))
        rows, at = {}, {}
        for n in sizes.decode_rows:
            d = at[n] = decode(model, n, sizes)
            rows[f"decode, {n} rows (tok/s)"] = (f"{d['tok_s']:.1f}", f"bare step {d['bare_tok_s']:.1f}",
                                                  ratio(d["tok_s"], d["bare_tok_s"]))
            rows[f"  host time not hidden / host work per step, {n} rows (ms)"] = (
                f"{d['unhidden_ms']:.2f} / {d['host_ms']:.2f}", "", "")
            rows[f"  bytes read per step, {n} rows (MB; GB/s)"] = (
                f"{d['bytes'] / 1e6:.1f}; {d['bytes_s'] / 1e9:.1f}", f"stream {bandwidth / 1e9:.1f} GB/s",
                ratio(d["bytes_s"], bandwidth))
        # each kernel at the adapter rows; the row loop's run there already timed the kernel `auto` chose
        done = at.get(sizes.lora_rows, {})
        kernels = {a: (done if done.get("kernel") == a else decode(model, sizes.lora_rows, sizes, a))["bare_tok_s"]
                   for a in ("xla", "pallas")}
        rows[f"decode bare step, {sizes.lora_rows} rows, Pallas attention (tok/s)"] = (
            f"{kernels['pallas']:.1f}", f"XLA attention {kernels['xla']:.1f}", ratio(kernels["pallas"], kernels["xla"]))
        p = prefill(model, sizes)
        prompts = f"{sizes.prefill_prompts} x {sizes.prefill_tokens} tokens"
        rows[f"prefill, {prompts} (tok/s)"] = (f"{p['tok_s']:.0f}", "", "")
        rows["  prefill matmul TFLOP/s"] = (f"{p['flops_s'] / 1e12:.3f}", f"matmul {peak / 1e12:.3f}",
                                            ratio(p["flops_s"], peak))
        lora = multi_lora(model, sizes)
        rows[f"decode, {sizes.lora_rows} rows, 4 adapters (tok/s)"] = (f"{lora['four']:.1f}",
                                                                     f"no adapter {lora['none']:.1f}",
                                                                     ratio(lora["four"], lora["none"]))
        sft = sft_steps(model, model_dir, sizes, args.dtype, args.skip_trl)
        rows[f"SFT, batch {sizes.sft_batch} x {sizes.sft_seq} (tok/s)"] = (
            f"{sft['kiln']:.0f}", f"TRL {sft['trl']:.0f}" if sft["trl"] else "TRL -", ratio(sft["kiln"], sft["trl"]))
        del model
        grpo = grpo_steps(load_model(str(model_dir), dtype=args.dtype, show_progress=False), model_dir, sizes,
                          args.dtype, args.skip_trl)
        rows[f"GRPO step, {sizes.grpo_prompts} x {sizes.grpo_generations} x {sizes.grpo_tokens} tokens (s)"] = (
            f"{grpo['kiln']:.2f}", f"TRL {grpo['trl']:.2f}" if grpo["trl"] else "TRL -",
            ratio(grpo["trl"], grpo["kiln"]) + (" faster" if grpo["trl"] else ""))
    width = max(map(len, rows))
    print(f"\n| {'measure'.ljust(width)} | kiln | reference | ratio |\n|{'-' * (width + 2)}|---|---|---|")
    for name, (kiln, reference, r) in rows.items():
        print(f"| {name.ljust(width)} | {kiln} | {reference} | {r} |")
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
