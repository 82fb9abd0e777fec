"""GRPO step time: Kiln (rollouts from its serving engine, training on the shared weights)
against TRL's GRPOTrainer (transformers generation) with a PEFT LoRA, one run.

Same model (the default, float32 on both sides), the same prompts (chat-rendered), G = 8
completions of exactly --new-tokens tokens (EOS ignored) for each of 8 prompts, LoRA rank 16
on the same modules, micro-batches of 16 sequences accumulated into one optimizer step per
generation batch, the same reward function, no KL term. Each side runs --warmup untimed steps
(compilation, allocator warm-up), then --steps timed ones, and reports the split between
generating the rollouts and training on them.

    python bench/train_grpo.py [--steps 2] [--new-tokens 64] [--skip-trl]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.models.loader import load_model
from kiln.models.lora import TARGET_MODULES
from kiln.train.grpo import GRPOConfig, GRPORun

DATA = Path(__file__).parent.parent / "notebooks" / "data" / "contacts_train.jsonl"
PROMPTS, G, RANK, MICRO = 8, 8, 16, 16


def questions(n: int) -> list[list[dict]]:
    """The user turns of the SFT notebook's data, as prompts."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    return [[m for m in r["messages"] if m["role"] != "assistant"] for r in rows]


def reward(texts: list[str]) -> list[float]:
    return [len(set(t.split())) / (1 + len(t.split())) for t in texts]  # any cheap, varied score


def kiln_grpo(model, chats, args) -> dict:
    PROMPTS, G, RANK, MICRO = sizes(args)  # noqa: N806
    engine = AsyncEngine(model, EngineConfig(num_kv_blocks=1024, max_loras=2, max_lora_rank=RANK,
                                             max_num_seqs=PROMPTS * G))
    tok = model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in chats]
    config = GRPOConfig(lora_rank=RANK, lora_alpha=2 * RANK, num_generations=G, prompts_per_step=PROMPTS,
                        max_completion_tokens=args.new_tokens, ignore_eos=True, micro_batch_rows=MICRO,
                        max_steps=args.warmup + args.steps, learning_rate=1e-5)
    try:
        run = GRPORun(engine, prompts, [None] * len(prompts), lambda texts, items: reward(texts), config)
        timed = []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            m = run.advance(engine.ownership)
            if i >= args.warmup:
                timed.append((time.perf_counter() - t0, m["rollout_seconds"], m["train_seconds"]))
        return {"step": sum(t[0] for t in timed) / len(timed), "rollout": sum(t[1] for t in timed) / len(timed),
                "train": sum(t[2] for t in timed) / len(timed), "completion_length": m["completion_length"]}
    finally:
        engine.shutdown()


def sizes(args) -> tuple[int, int, int, int]:
    """Prompts per step, completions per prompt, LoRA rank and micro-batch rows: the bench's, unless
    `args` names others (bench/gpu.py's dry run)."""
    return (getattr(args, "prompts", PROMPTS), getattr(args, "generations", G), getattr(args, "rank", RANK),
            getattr(args, "micro", MICRO))


def trl_grpo(chats, args, model_dir: Path | None = None, dtype: str = "float32") -> dict:
    """TRL's GRPO steps on the GPU when torch sees one: on `model_dir` (an HF directory; default Kiln's
    conversion of the default model) with its weights in `dtype`."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from kiln.models.loader import convert_gguf, default_model_path

    PROMPTS, G, RANK, MICRO = sizes(args)  # noqa: N806
    torch.manual_seed(0)
    model_dir = model_dir or convert_gguf(default_model_path(), show_progress=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    steps: list[float] = []
    generation: list[float] = []

    class Timer(TrainerCallback):
        start = 0.0

        def on_step_begin(self, a, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        config = TRLConfig(output_dir=out, per_device_train_batch_size=MICRO,
                           gradient_accumulation_steps=PROMPTS * G // MICRO, num_generations=G,
                           max_completion_length=args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
                           max_steps=args.warmup + args.steps, learning_rate=1e-5, beta=0.0, logging_steps=1000,
                           save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), bf16=False,
                           dataloader_num_workers=0,
                           gradient_checkpointing=False, shuffle_dataset=False)
        lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=hf, args=config, train_dataset=Dataset.from_list([{"prompt": c} for c in chats]),
                              reward_funcs=lambda completions, **kw: reward([c[0]["content"] for c in completions]),
                              peft_config=lora, processing_class=tokenizer, callbacks=[Timer()])
        generate = trainer._generate_and_score_completions

        def timed_generate(*a, **kw):
            t0 = time.perf_counter()
            out = generate(*a, **kw)
            generation.append(time.perf_counter() - t0)
            return out

        trainer._generate_and_score_completions = timed_generate
        trainer.train()
    step, gen = steps[args.warmup:], generation[args.warmup:]
    return {"step": sum(step) / len(step), "rollout": sum(gen) / len(gen),
            "train": (sum(step) - sum(gen)) / len(step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--skip-trl", action="store_true")
    args = ap.parse_args()
    chats = questions(64)
    print(f"GRPO: {PROMPTS} prompts x G={G}, {args.new_tokens} new tokens, LoRA rank {RANK} on "
          f"{', '.join(TARGET_MODULES)}, micro-batches of {MICRO}; {args.warmup} untimed + {args.steps} timed steps")
    model = load_model(dtype="float32", show_progress=False)
    kiln = kiln_grpo(model, chats, args)
    print(f"kiln  {kiln['step']:7.1f} s/step  (rollout {kiln['rollout']:.1f} s, train {kiln['train']:.1f} s; "
          f"{kiln['completion_length']:.0f} tokens per completion)")
    if args.skip_trl:
        return
    del model
    trl = trl_grpo(chats, args)
    print(f"trl   {trl['step']:7.1f} s/step  (rollout {trl['rollout']:.1f} s, train {trl['train']:.1f} s)")
    print(f"kiln speedup: {trl['step'] / kiln['step']:.2f}x (rollout {trl['rollout'] / kiln['rollout']:.2f}x, "
          f"train {trl['train'] / kiln['train']:.2f}x)")


if __name__ == "__main__":
    main()
