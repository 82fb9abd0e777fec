"""Random-init tiny HF models of each supported architecture, saved as real HF directories."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "llama-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def make_hf_model(variant: str, seed: int = 0):
    config_cls, model_cls, extra = VARIANTS[variant]
    kwargs = {**BASE, **extra}
    if "rope_scaling" in kwargs:  # transformers 5 spells it rope_parameters
        kwargs["rope_parameters"] = {"rope_theta": kwargs.pop("rope_theta"), **kwargs.pop("rope_scaling")}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # spread the norms away from 1 so a missing norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path
