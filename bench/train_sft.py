"""SFT training throughput: Kiln's SFT step against TRL's SFTTrainer with a PEFT LoRA, one run.

Same model (the default, float32 on both sides, the same dequantized weights), the same tokenized examples
(Kiln's chat rendering; TRL gets them pre-tokenized with -100 labels on untrained tokens), the
same batch size, sequence cap, LoRA rank, alpha and target modules, AdamW on both. Each side
runs --warmup untimed steps (compilation, allocator warm-up), then --steps timed ones; Kiln
compiles a step per new batch shape, which is timed apart and reported.
Throughput counts real (non-padding) tokens: each side pads in its own way (Kiln to a length
bucket, with rows of similar length batched together; TRL to the longest row of each batch).

    python bench/train_sft.py [--batch-size 8] [--max-seq-len 128] [--steps 10] [--max-slice-ms 100] [--skip-trl]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kiln.engine.ownership import Ownership
from kiln.models.loader import load_model
from kiln.models.lora import TARGET_MODULES
from kiln.train.data import load_examples
from kiln.train.sft import SFTConfig, SFTRun
from kiln.train.slices import Turns

DATA = Path(__file__).parent.parent / "notebooks" / "data" / "contacts_train.jsonl"


def kiln_sft(model, examples, args, max_slice_ms: float | None = None) -> dict:
    """Kiln's SFT steps: fused (a run alone in its process), or with `max_slice_ms` in slices as a
    server runs them while it serves (here nothing is served: slices run back to back)."""
    config = SFTConfig(lora_rank=args.rank, lora_alpha=2.0 * args.rank, learning_rate=1e-4, n_epochs=100,
                       batch_size=args.batch_size, max_seq_len=args.max_seq_len, warmup_ratio=0.0,
                       max_slice_ms=max_slice_ms or 100.0)
    run = SFTRun(model.params, model.config, examples, config)
    turns = Turns(Ownership()) if max_slice_ms else None
    for _ in range(args.warmup):
        run.advance(turns)
    tokens0, seconds, compile_seconds = run.input_tokens, 0.0, 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        run.prepare(turns)  # the next batch, compiled once per new shape (a one-time cost, reported apart)
        t1 = time.perf_counter()
        run.advance(turns)  # returns host floats: the step has finished
        compile_seconds += t1 - t0
        seconds += time.perf_counter() - t1
    return {"tokens_per_second": (run.input_tokens - tokens0) / seconds, "seconds_per_step": seconds / args.steps,
            "compiled_shapes": len(run.shapes), "compile_seconds": compile_seconds}


def trl_sft(examples, args, gradient_checkpointing: bool, model_dir: Path | None = None,
            dtype: str = "float32") -> dict:
    """TRL's SFT steps on the GPU when torch sees one: on `model_dir` (an HF directory; default Kiln's
    conversion of the default model) with its weights in `dtype`."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    from kiln.models.loader import convert_gguf, default_model_path

    torch.manual_seed(0)
    # Kiln's conversion of the GGUF (the dequantized float32 weights Kiln trains on) as a plain HF
    # directory: transformers refuses to train a model it loaded from GGUF
    model_dir = model_dir or convert_gguf(default_model_path(), show_progress=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [{"input_ids": e.ids.tolist(),
             "labels": [int(i) if t else -100 for i, t in zip(e.ids, e.trained, strict=True)]} for e in examples]
    batch_tokens: list[int] = []

    class Timer(TrainerCallback):
        start = None
        seconds = 0.0

        def on_step_begin(self, a, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step > args.warmup:
                self.seconds += time.perf_counter() - self.start

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        config = TRLConfig(output_dir=out, per_device_train_batch_size=args.batch_size, max_length=args.max_seq_len,
                           max_steps=args.warmup + args.steps, learning_rate=1e-4, lr_scheduler_type="constant",
                           logging_steps=1000, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                           dataloader_num_workers=0, num_train_epochs=100,
                           bf16=False,  # TRL's default is bf16 autocast; both sides train in the weights' dtype
                           gradient_checkpointing=gradient_checkpointing)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(TARGET_MODULES),
                          lora_dropout=0.0, task_type="CAUSAL_LM")
        trainer = SFTTrainer(model=hf, args=config, train_dataset=Dataset.from_list(rows), peft_config=lora,
                             processing_class=tokenizer, callbacks=[timer])
        collate = trainer.data_collator

        def counting(features):
            batch = collate(features)
            batch_tokens.append(int(batch["attention_mask"].sum()) if "attention_mask" in batch
                                else sum(len(f["input_ids"]) for f in features))
            return batch

        trainer.data_collator = counting
        trainer.train()
    mean_tokens = sum(batch_tokens) / len(batch_tokens)
    return {"tokens_per_second": mean_tokens * args.steps / timer.seconds,
            "seconds_per_step": timer.seconds / args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--max-slice-ms", type=float, default=100.0,
                    help="Kiln also runs its steps in slices of at most this long, as a serving server does")
    args = ap.parse_args()

    model = load_model(dtype="float32", show_progress=False)
    examples = load_examples(Path(args.data), model.tokenizer, args.max_seq_len)
    print(f"{len(examples)} examples, batch {args.batch_size}, max_seq_len {args.max_seq_len}, LoRA rank {args.rank} "
          f"on {', '.join(TARGET_MODULES)}; {args.warmup} untimed + {args.steps} timed steps")
    kiln = kiln_sft(model, examples, args)
    print(f"kiln  {kiln['tokens_per_second']:8.1f} tok/s  {kiln['seconds_per_step']:.2f} s/step  "
          f"({kiln['compiled_shapes']} compiled shapes; {kiln['compile_seconds']:.0f} s compiling in the timed "
          "steps, not counted)")
    sliced = kiln_sft(model, examples, args, args.max_slice_ms)
    print(f"kiln  {sliced['tokens_per_second']:8.1f} tok/s  {sliced['seconds_per_step']:.2f} s/step  "
          f"(in slices of <= {args.max_slice_ms:g} ms, as while serving; {sliced['compile_seconds']:.0f} s compiling, "
          f"not counted)")
    if args.skip_trl:
        return
    del model
    # TRL's SFTConfig turns gradient checkpointing on by default; Kiln remats only when a job
    # needs it to fit. Both TRL settings are measured, and Kiln is compared with the faster.
    best = 0.0
    for checkpointing in (True, False):
        trl = trl_sft(examples, args, checkpointing)
        best = max(best, trl["tokens_per_second"])
        print(f"trl   {trl['tokens_per_second']:8.1f} tok/s  {trl['seconds_per_step']:.2f} s/step  "
              f"(gradient_checkpointing={checkpointing})")
    print(f"kiln / trl (the faster TRL setting): {kiln['tokens_per_second'] / best:.2f}x fused, "
          f"{sliced['tokens_per_second'] / best:.2f}x in slices")


if __name__ == "__main__":
    main()
