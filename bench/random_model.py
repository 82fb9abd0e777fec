"""A checkpoint of a model's shape with random weights, for a machine that cannot have the weights
themselves (a lent GPU with no network, whose transfer limit the default model's file exceeds).
The benches measure speed there, which does not depend on what the weights say.

    python bench/random_model.py SRC OUT [--layers N]

SRC holds config.json and the tokenizer files (the default model's converted directory, which
bench/gpu/prepare.py copies); OUT gets model.safetensors (bfloat16) beside copies of them.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def write_random_model(src: Path, out: Path, layers: int | None = None) -> str:
    """Writes the checkpoint; returns a line that describes it."""
    config = AutoConfig.from_pretrained(src)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(f, out / f.name)
    return (f"{out}: {config.model_type}, {config.num_hidden_layers} layers, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M random parameters")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, help="fewer layers than the config's (a quick check of the plumbing)")
    args = ap.parse_args()
    print(write_random_model(args.src, args.out, args.layers))


if __name__ == "__main__":
    main()
