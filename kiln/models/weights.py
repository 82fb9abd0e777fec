"""Mapping between HF checkpoint tensor names and Kiln's stacked param pytree, with shape checks."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable

import numpy as np

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# HF per-layer suffix -> (kiln name, transposed). Linear weights are stored [out, in] by HF
# and [in, out] by Kiln so that activations multiply from the left.
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "self_attn.o_proj.bias": ("o_bias", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}
# Gemma's sandwich norms: its post_attention_layernorm normalizes the attention's output, and
# the MLP has a norm before it (Kiln's mlp_norm) and one after it.
SANDWICH_TENSORS = {
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}
# Fused HF projections (Phi-3) -> the Kiln weights they hold, in order along HF's output axis.
FUSED_TENSORS = {
    "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
}


# A mixture of experts' tensors (Mixtral: block_sparse_moe.*, w1/w3/w2; Qwen3-MoE: mlp.*): the
# router [E, in], and each expert's projections, held stacked per layer as [E, in, out].
ROUTER_TENSORS = {"block_sparse_moe.gate.weight": ("router", True), "mlp.gate.weight": ("router", True)}
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# Qwen2-MoE's shared expert (a SwiGLU MLP every token runs) and its sigmoid gate [1, in]
SHARED_EXPERT_TENSORS = {
    "mlp.shared_expert.gate_proj.weight": ("shared_gate", True),
    "mlp.shared_expert.up_proj.weight": ("shared_up", True),
    "mlp.shared_expert.down_proj.weight": ("shared_down", True),
    "mlp.shared_expert_gate.weight": ("shared_expert_gate", True),
}
EXPERT_TENSORS = {"w1": "experts_gate", "gate_proj": "experts_gate", "w3": "experts_up", "up_proj": "experts_up",
                  "w2": "experts_down", "down_proj": "experts_down"}

_EXPERT_HF = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}

# gpt-oss: attention sinks and biases, a router with a bias, and every layer's experts as stacked
# tensors already [E, in, out], gate and up interleaved along the output axis (even columns: gate).
GPT_OSS_TENSORS = {
    "self_attn.sinks": ("sinks", False),
    "mlp.router.weight": ("router", True),
    "mlp.router.bias": ("router_bias", False),
}
STACKED_EXPERTS = {
    "mlp.experts.gate_up_proj": ("experts_gate", "experts_up"),
    "mlp.experts.gate_up_proj_bias": ("experts_gate_bias", "experts_up_bias"),
    "mlp.experts.down_proj": ("experts_down",),
    "mlp.experts.down_proj_bias": ("experts_down_bias",),
}
# MXFP4 (gpt-oss's release): 4-bit e2m1 values, two per byte (low nibble first), 32 per block of
# input features, each block scaled by 2 ** (its uint8 scale - 127)
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32] -> float32 [..., in, out]."""
    values = np.stack([_FP4_VALUES[blocks & 15], _FP4_VALUES[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    w = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(w.reshape(*blocks.shape[:-2], -1), -1, -2)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Kiln param name -> shape (per layer for layer params, in Kiln's [in, out] orientation)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {
        "embed": (cfg.vocab_size, h),
        "final_norm": (h,),
        "attn_norm": (h,),
        "mlp_norm": (h,),
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    if cfg.attention_bias:
        shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if cfg.sandwich_norms:
        shapes.update(post_attn_norm=(h,), post_mlp_norm=(h,))
    if cfg.num_experts:
        E, ei = cfg.num_experts, cfg.expert_intermediate_size
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[name]
        shapes.update(router=(h, E), experts_gate=(E, h, ei), experts_up=(E, h, ei), experts_down=(E, ei, h))
    if cfg.shared_expert_intermediate_size:
        s = cfg.shared_expert_intermediate_size
        shapes.update(shared_gate=(h, s), shared_up=(h, s), shared_down=(s, h), shared_expert_gate=(h, 1))
    if cfg.router_bias:
        shapes["router_bias"] = (cfg.num_experts,)
    if cfg.expert_bias:
        E, ei = cfg.num_experts, cfg.expert_intermediate_size
        shapes.update(experts_gate_bias=(E, ei), experts_up_bias=(E, ei), experts_down_bias=(E, h))
    if cfg.o_bias:
        shapes["o_bias"] = (h,)
    if cfg.attention_sinks:
        shapes["sinks"] = (cfg.num_heads,)
    return shapes


def layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """HF per-layer suffix -> (kiln name, transposed) for this model's layout."""
    out = {**LAYER_TENSORS, **SANDWICH_TENSORS} if cfg.sandwich_norms else dict(LAYER_TENSORS)
    if cfg.architecture == "GptOssForCausalLM":
        return {**out, **GPT_OSS_TENSORS}
    if cfg.shared_expert_intermediate_size:
        out.update(SHARED_EXPERT_TENSORS)
    return {**out, **ROUTER_TENSORS} if cfg.num_experts else out


def _hf_suffixes(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """The inverse: kiln name -> (HF per-layer suffix, transposed)."""
    return {v[0]: (k, v[1]) for k, v in layer_tensors(cfg).items()}


GLOBAL_NAMES = ("embed", "final_norm", "lm_head")


def build_params(
    cfg: ModelConfig,
    names: Iterable[str],
    read: Callable[[str], np.ndarray],
    source: Callable[[str], str],
    dtype,
    progress: Callable[[int], None] | None = None,
    supplied: Collection[str] = (),
) -> dict:
    """Builds the stacked param pytree (numpy) from HF-named tensors.

    read(name) returns the HF tensor; source(name) names its file for errors. Every expected
    tensor must be present with the expected shape; extra tensors (e.g. rotary caches) are ignored.
    Params named in `supplied` (a GGUF file's projections, embedding and head as stored; not
    experts) come from the caller: their tensors are neither read nor required, and the result
    leaves them out.
    """
    all_shapes, suffixes = expected_shapes(cfg), layer_tensors(cfg)
    shapes = {n: shape for n, shape in all_shapes.items() if n not in supplied}
    layer_names = [n for n in shapes if n not in GLOBAL_NAMES]
    layers = {n: np.empty((cfg.num_layers, *shapes[n]), dtype) for n in layer_names}
    seen: set[tuple[str, int]] = set()
    experts_seen: dict[tuple[str, int], set[int]] = {}
    out: dict = {}
    names = list(names)
    for name in names:
        m = _LAYER.match(name)
        if m:
            idx, suffix = int(m.group(1)), m.group(2)
            expert = _EXPERT.match(suffix) if cfg.num_experts else None
            if expert:
                key, e = EXPERT_TENSORS[expert.group(2)], int(expert.group(1))
                if idx >= cfg.num_layers or e >= cfg.num_experts:
                    raise ModelLoadError(f"expert {e} of layer {idx} is past the config's {cfg.num_experts} experts "
                                         f"and {cfg.num_layers} layers", file=source(name), tensor=name)
                layers[key][idx, e] = _checked(read(name), shapes[key][1:], True, name, source(name))
                experts_seen.setdefault((key, idx), set()).add(e)
                if len(experts_seen[key, idx]) == cfg.num_experts:
                    seen.add((key, idx))
                if progress:
                    progress(1)
                continue
            if suffix.endswith("_scales") and suffix.removesuffix("_scales") in STACKED_EXPERTS:
                continue  # read with its blocks
            if suffix.endswith("_blocks") and (base := suffix.removesuffix("_blocks")) in STACKED_EXPERTS:
                scales = name.removesuffix("_blocks") + "_scales"
                if scales not in names:
                    raise ModelLoadError("MXFP4 blocks without their scales", file=source(name), tensor=scales)
                _stacked_experts(layers, shapes, idx, base, dequantize_mxfp4(read(name), read(scales)), name,
                                 source(name), seen)
                continue
            if suffix in STACKED_EXPERTS:
                _stacked_experts(layers, shapes, idx, suffix, read(name), name, source(name), seen)
                continue
            if suffix in FUSED_TENSORS and any(part in layers for part in FUSED_TENSORS[suffix]):
                parts = FUSED_TENSORS[suffix]
            elif suffix in suffixes and suffixes[suffix][0] in layers:
                parts = (suffixes[suffix][0],)
            else:
                continue
            if idx >= cfg.num_layers:
                raise ModelLoadError(f"layer index {idx} >= num_hidden_layers {cfg.num_layers}", file=source(name),
                                     tensor=name)
            if len(parts) == 1:
                layers[parts[0]][idx] = _checked(read(name), shapes[parts[0]], suffixes[suffix][1], name,
                                                 source(name))
            else:  # [sum of outputs, in]: each part's rows, transposed to [in, out]
                widths = [all_shapes[k][1] for k in parts]
                fused = _checked(read(name), (all_shapes[parts[0]][0], sum(widths)), True, name, source(name))
                for key, part in zip(parts, np.split(fused, np.cumsum(widths)[:-1], axis=1), strict=True):
                    if key in layers:
                        layers[key][idx] = part
            seen.update((key, idx) for key in parts)
        elif name == "model.embed_tokens.weight" and "embed" in shapes:
            out["embed"] = _checked(read(name), shapes["embed"], False, name, source(name)).astype(dtype)
        elif name == "model.norm.weight":
            out["final_norm"] = _checked(read(name), shapes["final_norm"], False, name, source(name)).astype(dtype)
        elif name == "lm_head.weight" and "lm_head" in shapes:
            out["lm_head"] = _checked(read(name), shapes["lm_head"], True, name, source(name)).astype(dtype)
        if progress:
            progress(1)
    for key in [key for key in GLOBAL_NAMES if key in shapes]:
        if key not in out:
            raise ModelLoadError("missing tensor", file=source(""), tensor=_hf_name(cfg, key))
    for key in layer_names:
        for idx in range(cfg.num_layers):
            if (key, idx) not in seen:
                raise ModelLoadError("missing tensor", file=source(""), tensor=_hf_name(cfg, key, idx))
    if cfg.sliding_layers is not None:  # each layer carries its kind, so every layer loop reads it as data
        layers["sliding"] = np.asarray(cfg.sliding_layers, bool)
    out["layers"] = layers
    return out


def _stacked_experts(layers: dict, shapes: dict, idx: int, suffix: str, array: np.ndarray, name: str, file: str,
                     seen: set) -> None:
    """One layer's stacked experts' tensor (gpt-oss) into its Kiln parts: gate and up de-interleaved."""
    parts = STACKED_EXPERTS[suffix]
    if len(parts) == 1:
        layers[parts[0]][idx] = _checked(array, shapes[parts[0]], False, name, file)
    else:
        whole = shapes[parts[0]][:-1] + (2 * shapes[parts[0]][-1],)
        array = _checked(array, whole, False, name, file)
        layers[parts[0]][idx], layers[parts[1]][idx] = array[..., 0::2], array[..., 1::2]
    seen.update((key, idx) for key in parts)


def _checked(array: np.ndarray, shape: tuple[int, ...], transpose: bool, name: str, file: str) -> np.ndarray:
    hf_shape = tuple(reversed(shape)) if transpose else shape
    if tuple(array.shape) != hf_shape:
        raise ModelLoadError(f"wrong shape {tuple(array.shape)}, expected {hf_shape}", file=file, tensor=name)
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
        raise ModelLoadError(f"unsupported dtype {array.dtype}", file=file, tensor=name)
    return array.T if transpose else array


def _hf_name(cfg: ModelConfig, key: str, idx: int | None = None) -> str:
    if key == "embed":
        return "model.embed_tokens.weight"
    if key == "final_norm":
        return "model.norm.weight"
    if key == "lm_head":
        return "lm_head.weight"
    if key in EXPERT_TENSORS.values() or key.startswith("experts_"):
        return f"model.layers.{idx}: an expert's {key.removeprefix('experts_')} projection"
    return f"model.layers.{idx}.{_hf_suffixes(cfg)[key][0]}"


def to_hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The inverse mapping: Kiln params -> HF-named tensors (for caching converted weights)."""
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    if params.get("lm_head") is not None:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    suffixes = _hf_suffixes(cfg)
    for key, stacked in params["layers"].items():
        stacked = np.asarray(stacked)
        if key == "sliding":  # the layer's kind, from the config
            continue
        if key in _EXPERT_HF:  # [L, E, in, out] -> one [out, in] tensor per expert
            for idx, e in np.ndindex(stacked.shape[:2]):
                out[f"model.layers.{idx}.mlp.experts.{e}.{_EXPERT_HF[key]}.weight"] = np.ascontiguousarray(
                    stacked[idx, e].T)
            continue
        if key in ("experts_gate_bias", "experts_up_bias", "experts_down_bias"):  # gpt-oss's, as its checkpoint
            if key == "experts_up_bias":  # written with gate's, interleaved
                continue
            if key == "experts_gate_bias":
                up = np.asarray(params["layers"]["experts_up_bias"])
                stacked = np.stack([stacked, up], axis=-1).reshape(*stacked.shape[:-1], -1)
            name = "gate_up_proj_bias" if key == "experts_gate_bias" else "down_proj_bias"
            for idx in range(cfg.num_layers):
                out[f"model.layers.{idx}.mlp.experts.{name}"] = np.ascontiguousarray(stacked[idx])
            continue
        suffix, transpose = suffixes[key]
        for idx in range(cfg.num_layers):
            w = stacked[idx]
            out[f"model.layers.{idx}.{suffix}"] = np.ascontiguousarray(w.T if transpose else w)
    return out
