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

A mixture's experts are adapted as PEFT's `target_parameters` does it: one wrapper around
`mlp.experts` per targeted parameter (`gate_up_proj`, `down_proj`), each later one wrapping the
earlier ones in the order the module registers them (gate_up_proj first, so it sits under a
`base_layer.` when both are adapted; the config's list order says nothing), with lora_A
[r*E, in] (expert-major rows) and lora_B [out, r*E] (rank-major columns). Which parameter a
wrapper adapts is read from its shapes: (hidden, 2 x width) or (width, hidden), never equal.
Kiln's `experts_gate_up` keeps gate's columns then up's; gpt-oss interleaves them in the base
weights and so in lora_B.
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
_EXPERTS_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_EXPERT_PARAMETERS = {"gate_up_proj": "experts_gate_up", "down_proj": "experts_down"}  # PEFT's names -> Kiln's


def _expert_targets(config: dict, path: Path) -> set[str]:
    """Kiln's expert modules the config's target_parameters names."""
    modules = set()
    for name in config.get("target_parameters") or []:
        parent, _, param = str(name).rpartition(".")
        if not parent.endswith("experts") or param not in _EXPERT_PARAMETERS:
            raise InvalidAdapter(f"{path}: target_parameters entry {name!r} is not a mixture's experts' "
                                 f"{' or '.join(_EXPERT_PARAMETERS)}")
        modules.add(_EXPERT_PARAMETERS[param])
    return modules


def _interleaved(architecture: str | None) -> bool:
    """gpt-oss's experts interleave gate's and up's columns in gate_up_proj."""
    return architecture == "GptOssForCausalLM"


def _expert_from_peft(value: np.ndarray, part: str, num_experts: int, module: str, architecture: str) -> np.ndarray:
    """PEFT's lora_A [r*E, in] or lora_B [out, r*E] as Kiln's a [E, in, r] or b [E, r, out]."""
    if part == "A":
        return value.reshape(num_experts, -1, value.shape[-1]).transpose(0, 2, 1)
    b = value.reshape(value.shape[0], -1, num_experts).transpose(2, 1, 0)
    if module == "experts_gate_up" and _interleaved(architecture):
        b = np.concatenate([b[..., 0::2], b[..., 1::2]], axis=-1)
    return b


def _expert_to_peft(w: np.ndarray, part: str, module: str, architecture: str | None) -> np.ndarray:
    """Kiln's a [E, in, r] or b [E, r, out] as PEFT's lora_A [r*E, in] or lora_B [out, r*E]."""
    if part == "a":
        return w.transpose(0, 2, 1).reshape(-1, w.shape[1])
    if module == "experts_gate_up" and _interleaved(architecture):
        half = w.shape[-1] // 2
        w = np.stack([w[..., :half], w[..., half:]], axis=-1).reshape(w.shape)
    return w.transpose(2, 1, 0).reshape(w.shape[-1], -1)


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
    expert_targets = _expert_targets(config, path)
    weights: dict[str, dict[str, np.ndarray]] = {}
    wrappers: dict[tuple[int, int], dict[str, tuple[str, np.ndarray]]] = {}  # (layer, depth) -> A and B
    for key, value in tensors.items():
        expert_key = _EXPERTS_KEY.search(key)
        if expert_key is not None:
            layer, depth = int(expert_key.group(1)), expert_key.group(2).count("base_layer")
            wrappers.setdefault((layer, depth), {})[expert_key.group(3)] = (key, value)
            continue
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
    for (layer, _), parts in sorted(wrappers.items()):
        _read_expert(weights, layer, parts, expert_targets, rank, cfg, path)
    if not weights:
        raise InvalidAdapter(f"{path}: {WEIGHTS} holds no LoRA weights")
    info = {"rank": rank, "alpha": alpha, "use_rslora": bool(config.get("use_rslora")),
            "target_modules": sorted(weights, key=TARGET_MODULES.index),
            "base_model": config.get("base_model_name_or_path"), "peft_config": config}
    return weights, info


def _read_expert(weights: dict, layer: int, parts: dict, targets: set[str], rank: int, cfg: ModelConfig,
                 path: Path) -> None:
    """One experts' wrapper (its lora_A and lora_B) into the Kiln module its shapes say it adapts."""
    key = next(iter(parts.values()))[0]
    if not cfg.num_experts:
        raise InvalidAdapter(f"{path}: tensor {key!r} adapts experts; this base model has none")
    if set(parts) != {"A", "B"}:
        raise InvalidAdapter(f"{path}: tensor {key!r} has no lora_{'B' if 'A' in parts else 'A'} beside it")
    if layer >= cfg.num_layers:
        raise InvalidAdapter(f"{path}: tensor {key!r} is for layer {layer}, the model has {cfg.num_layers}")
    E, shapes = cfg.num_experts, module_shapes(cfg)
    a, b = (np.asarray(parts[p][1], np.float32) for p in ("A", "B"))
    found = [m for m in _EXPERT_PARAMETERS.values()
             if a.shape == (rank * E, shapes[m][0]) and b.shape == (shapes[m][1], rank * E)]
    if not found or found[0] not in targets:
        expected = " or ".join(f"{(rank * E, shapes[m][0])} / {(shapes[m][1], rank * E)}"
                               for m in _EXPERT_PARAMETERS.values())
        raise InvalidAdapter(f"{path}: tensor {key!r} and its lora_B have shapes {a.shape} / {b.shape}; the experts' "
                             f"parameters its target_parameters names take {expected} for this base model")
    module = found[0]
    fan_in, fan_out = shapes[module]
    w = weights.setdefault(module, {"a": np.zeros((cfg.num_layers, E, fan_in, rank), np.float32),
                                    "b": np.zeros((cfg.num_layers, E, rank, fan_out), np.float32)})
    w["a"][layer] = _expert_from_peft(a, "A", E, module, cfg.architecture)
    w["b"][layer] = _expert_from_peft(b, "B", E, module, cfg.architecture)


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
    """Writes a PEFT LoRA adapter directory that transformers + peft and vLLM load (`architecture`:
    the base model's, where its modules fuse Kiln's projections or interleave experts' columns)."""
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
    weights = dict(weights)
    experts = [m for m in _EXPERT_PARAMETERS.values() if m in weights]  # PEFT's wrapping order
    for depth, module in enumerate(reversed(experts)):
        w = weights.pop(module)
        for layer in range(w["a"].shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.mlp.experts" + ".base_layer" * depth
            for part, suffix in (("a", "lora_A"), ("b", "lora_B")):
                piece = _expert_to_peft(w[part][layer], part, module, architecture)
                tensors[f"{prefix}.{suffix}.weight"] = np.ascontiguousarray(piece, np.float32)
    for module, w in weights.items():
        for layer in range(w["a"].shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(w["a"][layer].T, np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(w["b"][layer].T, np.float32)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": sorted(weights),
        "target_parameters": [f"mlp.experts.{p}" for p, m in _EXPERT_PARAMETERS.items() if m in experts] or None,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "inference_mode": True, "init_lora_weights": True,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
    }
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path
