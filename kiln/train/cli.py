"""`kiln train sft`: a LoRA adapter trained in this process, saved to the adapter store."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.config import Settings

# flag -> SFTConfig field; unset flags keep the [train] settings
_OVERRIDES = {"epochs": "n_epochs", "batch_size": "batch_size", "learning_rate": "learning_rate",
              "rank": "lora_rank", "alpha": "lora_alpha", "max_seq_len": "max_seq_len", "seed": "seed"}


def add_parser(sub, add_settings_arguments) -> None:
    p = sub.add_parser("train", help="train a LoRA adapter on the configured model")
    methods = p.add_subparsers(dest="train_method", required=True, metavar="METHOD")
    q = methods.add_parser("sft", help="supervised fine-tuning on chat or prompt/completion JSONL")
    add_settings_arguments(q)
    q.add_argument("--data", required=True, metavar="FILE", help="training JSONL (OpenAI chat or prompt/completion)")
    q.add_argument("--name", required=True, help="adapter name in the store")
    q.add_argument("--validation", metavar="FILE", help="validation JSONL: valid_loss and valid_mean_token_accuracy")
    q.add_argument("--epochs", type=int)
    q.add_argument("--batch-size", type=int)
    q.add_argument("--learning-rate", type=float)
    q.add_argument("--rank", type=int)
    q.add_argument("--alpha", type=float)
    q.add_argument("--max-seq-len", type=int)
    q.add_argument("--seed", type=int)
    q.add_argument("--json", action="store_true", help="print the history and artifact as JSON")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from kiln import distributed
    from kiln.engine.setup import configure_compilation_cache
    from kiln.errors import KilnError
    from kiln.train.sft import sft

    overrides = {field: v for flag, field in _OVERRIDES.items() if (v := getattr(args, flag)) is not None}
    try:
        # a run over several processes joins them before JAX starts its backends
        index = distributed.initialize(settings)
        configure_compilation_cache(settings.compilation_dir())
        result = sft(Path(args.data), args.name, validation=Path(args.validation) if args.validation else None,
                     settings=settings, **overrides)
    except (KilnError, OSError) as exc:
        print(f"kiln: error: {exc}")
        return 1
    artifact, final = result.artifact, result.history[-1]
    if args.json:
        print(json.dumps({"artifact": artifact.summary() if artifact else None, "process": index,
                          "history": result.history, "compiled_shapes": result.compiled_shapes}, indent=2))
        return 0
    metrics = "  ".join(f"{k} {v:.4g}" for k, v in final.items() if isinstance(v, float))
    print(f"trained {args.name} in {final['step']} steps ({result.compiled_shapes} compiled shapes): {metrics}")
    print(f"saved to {artifact.path} as v{artifact.version}" if artifact else
          f"process {index}: process 0 saves the adapter")
    return 0
