"""Hugging Face PEFT interop: `adapter_config.json` + `adapter_model.safetensors`.

PEFT stores lora_A as [r, in] and lora_B as [out, r] per layer and module under keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`; Kiln keeps
{module: {"a": [L, in, r], "b": [L, r, out]}} in the HF layout of the base weights, so
adapters move to and from vLLM and transformers unchanged.

A fused projection's adapter (Phi-3's `qkv_proj` and `gate_up_proj`) reads exactly as one
adapter per part: each part keeps the shared lora_A and its own rows of lora_B. Written for such
a model, the parts' adapters become one fused adapter of n times the rank (their lora_A stacked,
their lora_B block-diagonal, and lora_alpha scaled so that alpha / r stays), through PEFT's
rank_pattern and alpha_pattern.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from kiln.errors import InvalidAdapter
from kiln.models.config import ModelConfig
from kiln.models.lora import TARGET_MODULES, module_shapes
from kiln.models.weights import FUSED_TENSORS

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_PARENT = {m: ("self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for m in TARGET_MODULES}
_PARENT.update(qkv_proj="self_attn", gate_up_proj="mlp")  # Phi-3's fused modules
# the part of a fused module whose width a part left out takes (k and v; gate and up)
_TWIN = {"k_proj": "v_proj", "v_proj": "k_proj", "gate_proj": "up_proj", "up_proj": "gate_proj"}
_FUSED = {suffix.split(".")[1]: parts for suffix, parts in FUSED_TENSORS.items()}  # qkv_proj -> (q, k, v)


def is_peft_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_peft_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidAdapter(f"{path / CONFIG}: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        raise InvalidAdapter(f"{path / CONFIG}: not a LoRA adapter config (needs a positive integer 'r')")
    return config


def read_peft(path: str | Path, cfg: ModelConfig) -> tuple[dict, dict]:
    """Returns (weights, info) with info = {rank, alpha, use_rslora, target_modules, base_model, peft_config}."""
    from safetensors.numpy import load_file

    path = Path(path)
    config = read_peft_config(path)
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise InvalidAdapter(f"{path}: unsupported PEFT options: {', '.join(bad)}")
    if not (path / WEIGHTS).is_file():
        raise InvalidAdapter(f"{path}: {WEIGHTS} is missing (pickled adapter_model.bin is not loaded)")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    try:
        tensors = load_file(str(path / WEIGHTS))
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise InvalidAdapter(f"{path / WEIGHTS}: {exc}") from None

    shapes = module_shapes(cfg)
    weights: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise InvalidAdapter(f"{path}: tensor {key!r} is not a LoRA weight of a decoder projection")
        layer, module, part = int(m.group(1)), m.group(3), m.group(4)
        parts = _FUSED.get(module, (module,))
        if any(p not in shapes for p in parts):
            raise InvalidAdapter(f"{path}: tensor {key!r} targets {module!r}; Kiln adapts {', '.join(TARGET_MODULES)}")
        if layer >= cfg.num_layers:
            raise InvalidAdapter(f"{path}: tensor {key!r} is for layer {layer}, the model has {cfg.num_layers}")
        fan_in, widths = shapes[parts[0]][0], [shapes[p][1] for p in parts]
        expected = (rank, fan_in) if part == "A" else (sum(widths), rank)
        if tuple(value.shape) != expected:
            raise InvalidAdapter(f"{path}: tensor {key!r} has shape {tuple(value.shape)}, expected {expected} "
                                  "for this base model")
        value = np.asarray(value, np.float32)
        pieces = [value] * len(parts) if part == "A" else np.split(value, np.cumsum(widths)[:-1], axis=0)
        for name, piece in zip(parts, pieces, strict=True):
            w = weights.setdefault(name, {"a": np.zeros((cfg.num_layers, fan_in, rank), np.float32),
                                          "b": np.zeros((cfg.num_layers, rank, shapes[name][1]), np.float32)})
            w["a" if part == "A" else "b"][layer] = piece.T
    if not weights:
        raise InvalidAdapter(f"{path}: {WEIGHTS} holds no LoRA weights")
    info = {"rank": rank, "alpha": alpha, "use_rslora": bool(config.get("use_rslora")),
            "target_modules": sorted(weights, key=TARGET_MODULES.index),
            "base_model": config.get("base_model_name_or_path"), "peft_config": config}
    return weights, info


# the architectures whose HF modules fuse Kiln's projections
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


def _fused(weights: dict, rank: int) -> tuple[dict, dict]:
    """The parts' adapters as fused modules' ({module: {"a", "b"}}, {module: parts written})."""
    out, counts = {}, {}
    for module, parts in _FUSED.items():
        present = [p for p in parts if p in weights]
        if not present:
            continue
        L = weights[present[0]]["a"].shape[0]
        width = {p: weights[p]["b"].shape[2] for p in present}
        for p in parts:  # a part not adapted keeps zero rows, as wide as its twin
            if p not in width and _TWIN.get(p) in width:
                width[p] = width[_TWIN[p]]
        if len(width) < len(parts):
            raise InvalidAdapter(f"cannot write {module} for PEFT: adapt k_proj or v_proj with q_proj")
        widths = [width[p] for p in parts]
        a = np.concatenate([weights[p]["a"] for p in present], axis=2)  # [L, in, n*r]
        b = np.zeros((L, len(present) * rank, sum(widths)), np.float32)
        offsets = dict(zip(parts, np.cumsum([0] + widths[:-1]), strict=True))
        for j, p in enumerate(present):
            b[:, j * rank:(j + 1) * rank, offsets[p]:offsets[p] + widths[parts.index(p)]] = weights[p]["b"]
        out[module], counts[module] = {"a": a, "b": b}, len(present)
    return out, counts


def write_peft(path: str | Path, weights: dict, rank: int, alpha: float, use_rslora: bool, base_model: str,
               architecture: str | None = None) -> Path:
    """Writes a PEFT LoRA adapter directory that transformers + peft and vLLM load."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    if architecture in FUSED_ARCHITECTURES:
        fused, counts = _fused(weights, rank)
        weights = {m: w for m, w in weights.items() if not any(m in parts for parts in _FUSED.values())} | fused
        for module, n in counts.items():
            rank_pattern[module] = n * rank
            alpha_pattern[module] = alpha * (n ** 0.5 if use_rslora else n)
    for module, w in weights.items():
        for layer in range(w["a"].shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(w["a"][layer].T, np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(w["b"][layer].T, np.float32)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": sorted(weights),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "inference_mode": True, "init_lora_weights": True,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
    }
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path
