"""Random PEFT LoRA adapters on tiny HF models, saved as real PEFT directories (the reference)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # a mixture's experts, as PEFT targets them


def make_peft_adapter(hf_model, path: Path, rank: int = 4, alpha: float = 8.0, modules=ALL_MODULES, seed: int = 0,
                      use_rslora: bool = False, parameters=None):
    """Wraps a copy of `hf_model` in a LoRA with random A and B (PEFT zero-inits B), saves it
    to `path` and returns the PEFT model for reference outputs. `parameters`: PEFT's
    target_parameters (a mixture's experts)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules), lora_dropout=0.0,
                        use_rslora=use_rslora, task_type="CAUSAL_LM", target_parameters=parameters)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.eval()
    model.save_pretrained(path)
    return model


def reference_logits(model, ids: list[int]):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
