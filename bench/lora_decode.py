"""Decode throughput of a 32-row batch with 0, 1 and 4 distinct LoRA adapters, Kiln vs
transformers + peft (mixed-adapter batches via `adapter_names`), same weights, one run.

Kiln runs its engine's real decode step (runner + LoRA slots) on 32 rows at a fixed
context; the configurations are timed round-robin so machine noise hits all of them
alike, and the median per configuration is reported. "1 adapter, 16 slots" repeats the
one-adapter batch with four times the slots: LoRA work follows the adapters in the batch,
not the number of slots.

On a mixture of experts (`--model` a HF directory, e.g. one `bench/random_model.py` wrote) the
adapters also adapt every expert (`experts_gate_up`, `experts_down`; peft's target_parameters),
so the table is the cost of LoRA on experts.

    python bench/lora_decode.py [--rows 32] [--rank 16] [--steps 8] [--rounds 5] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

from kiln.engine.block_pool import BlockPool
from kiln.engine.config import EngineConfig
from kiln.engine.lora_slots import AdapterWeights, LoraSlots
from kiln.engine.ownership import Ownership
from kiln.engine.params import SamplingParams
from kiln.engine.request import Request
from kiln.engine.runner import Runner
from kiln.engine.step_types import Batch
from kiln.models.loader import default_model_path, load_model
from kiln.models.lora import EXPERT_MODULES, experts_axis, module_shapes

CONTEXT = 60
BLOCK = 16
CONFIGS = {"no adapter": (0, 4), "1 adapter": (1, 4), "4 adapters": (4, 4), "1 adapter, 16 slots": (1, 16)}


def random_adapter(cfg, rank: int, seed: int) -> dict:
    rng = np.random.RandomState(seed)
    return {m: {"a": (0.02 * rng.randn(cfg.num_layers, *experts_axis(cfg, m), i, rank)).astype(np.float32),
                "b": (0.02 * rng.randn(cfg.num_layers, *experts_axis(cfg, m), rank, o)).astype(np.float32)}
            for m, (i, o) in module_shapes(cfg).items()}


def slot_of(adapters: int, row: int) -> int:
    return 0 if adapters == 0 else 1 + row % adapters


def kiln_decode(model, rank: int, rows: int, steps: int, rounds: int) -> dict[str, float]:
    cfg = model.config
    blocks_per_row = -(-(CONTEXT + steps * (rounds + 1)) // BLOCK)  # what the longest row reaches
    num_blocks = 1 + len(CONFIGS) * rows * blocks_per_row
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK, max_num_seqs=rows, max_num_batched_tokens=rows,
                          decode_row_buckets=(rows,), prefill_token_buckets=(rows,))
    runners = {}
    for n_slots in {slots for _, slots in CONFIGS.values()}:
        slots = LoraSlots(cfg, n_slots, rank, Ownership(), experts=True)
        for i in range(4):
            slots.acquire(AdapterWeights(f"a{i}", f"v{i}", random_adapter(cfg, rank, i), 2.0, rank))
        runners[n_slots] = Runner(cfg, model.params, config, blocks_per_row * BLOCK, (), slots)
    pool = BlockPool(num_blocks, BLOCK, False)
    greedy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    batches = {}
    for name, (adapters, _) in CONFIGS.items():
        reqs = []
        for r in range(rows):
            req = Request(f"{name}-{r}", list(range(3, 3 + CONTEXT)), greedy, seed=r, adapter_slot=slot_of(adapters, r))
            req.block_ids = pool.allocate(blocks_per_row)
            req.num_computed = CONTEXT - 1
            reqs.append(req)
        batches[name] = reqs

    def step(name):
        reqs = batches[name]
        result = runners[CONFIGS[name][1]].execute(Batch([(r, 1) for r in reqs]))
        for i, r in enumerate(reqs):
            r.num_computed += 1
            r.output_ids.append(result.token(i)[0])

    for name in CONFIGS:  # compile every graph (with and without LoRA)
        step(name)
    times = {name: [] for name in CONFIGS}
    for _ in range(rounds):
        for name in CONFIGS:
            t0 = time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append(time.perf_counter() - t0)
    lora = {b.lora for r in runners.values() for b in r.forwards}
    assert lora == {False, True}, lora  # adapter rows really ran the LoRA step, plain rows the plain one
    return {name: rows * steps / statistics.median(ts) for name, ts in times.items()}


def hf_decode(model, rank: int, rows: int, steps: int, rounds: int, model_dir: str | None) -> dict[str, float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if model_dir:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    modules = [m for m in module_shapes(model.config) if m not in EXPERT_MODULES]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if model.config.num_experts else None

    def config():
        return LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=modules, target_parameters=experts)

    peft_model = get_peft_model(hf, config(), adapter_name="a0")
    for i in range(1, 4):
        peft_model.add_adapter(f"a{i}", config())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.02)
    peft_model.eval()
    ids = torch.tensor([list(range(3, 3 + CONTEXT))] * rows)

    def generate(adapters: int, n: int) -> float:
        names = ["__base__" if slot_of(adapters, r) == 0 else f"a{slot_of(adapters, r) - 1}" for r in range(rows)]
        t0 = time.perf_counter()
        with torch.no_grad():
            peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0, adapter_names=names)
        return time.perf_counter() - t0

    generate(4, 2)
    configs = {name: c for name, c in CONFIGS.items() if c[1] == 4}  # peft has no slots: the same batches
    if experts:  # peft's ParamWrapper (the experts' LoRA) runs one adapter per batch
        configs = {name: c for name, c in configs.items() if c[0] <= 1}
    times = {name: [] for name in configs}
    for _ in range(max(1, rounds // 2)):
        for name, (adapters, _) in configs.items():
            first = generate(adapters, 1)  # prefill + first token
            times[name].append(max(generate(adapters, steps + 1) - first, 1e-9))
    return {name: rows * steps / statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model", help="a HF model directory (default: the default model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory():
        model = load_model(args.model, show_progress=False)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {model.model_id} float32; {args.rows} rows, "
          f"rank {args.rank} on {', '.join(module_shapes(model.config))}, context {CONTEXT}")
    kiln = kiln_decode(model, args.rank, args.rows, args.steps, args.rounds)
    hf = None if args.skip_hf else hf_decode(model, args.rank, args.rows, args.steps, args.rounds, args.model)
    header = (f"{'configuration':>19} | {'kiln tok/s':>10} | {'vs none':>7} | {'peft tok/s':>10} | {'vs none':>7} | "
              f"{'kiln/peft':>9}")
    print(header)
    print("-" * len(header))
    for name in CONFIGS:
        k = kiln[name]
        h = hf.get(name) if hf else None
        cols = [f"{name:>19}", f"{k:>10.1f}", f"{k / kiln['no adapter']:>6.2f}x"]
        cols += [f"{h:>10.1f}", f"{h / hf['no adapter']:>6.2f}x", f"{k / h:>8.2f}x"] if h else ["n/a", "n/a", "n/a"]
        print(" | ".join(cols))
    slowdown = 1 - kiln["4 adapters"] / kiln["no adapter"]
    verdict = "met" if slowdown <= 0.15 else "MISSED"
    print(f"4 distinct adapters vs none (kiln): {slowdown * 100:.1f}% slower; target <= 15%: {verdict}")
    slots = kiln["1 adapter"] / kiln["1 adapter, 16 slots"]
    print(f"1 adapter with 16 slots vs 4 slots: {slots:.2f}x the time (LoRA cost follows the batch's adapters)")


if __name__ == "__main__":
    main()
