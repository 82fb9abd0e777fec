"""Model configuration: the architecture facts the functional decoder needs, read from HF config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.errors import ModelLoadError

# Architectures the decoder covers, and what distinguishes each one.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Phi3ForCausalLM": {},  # fused qkv_proj and gate_up_proj, split at load (weights.FUSED_TENSORS)
    "Gemma2ForCausalLM": {},  # Gemma 3's layout without q/k norms, with soft-capping (see `_gemma`)
    "Gemma3ForCausalLM": {"qk_norm": True},  # the text model of Gemma 3 (see `_gemma`)
    "MixtralForCausalLM": {"moe": True},  # every layer's MLP: top-k of num_local_experts SwiGLU experts
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": True},
    "Qwen2MoeForCausalLM": {"attention_bias": True, "moe": True},  # and a shared expert beside the routed ones
    "GptOssForCausalLM": {"moe": True, "attention_bias": True},  # see `_gpt_oss`
}
# Where a config's attention_bias puts biases: q/k/v and the output projection; q/k/v only (Qwen2's
# families, which have them by default); nowhere (these families' attention has none).
BIAS_ON_OUTPUT = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                  "Gemma3ForCausalLM", "GptOssForCausalLM")
NO_ATTENTION_BIAS = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# Architectures whose configs' sliding_window applies to every layer.
SLIDING_WINDOW = ("MistralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                  "MixtralForCausalLM", "GptOssForCausalLM")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable for jit static args
    partial_rotary_factor: float = 1.0  # the fraction of each head's dims that rotate (the first ones)
    # each rotary frequency divided by its factor: how a GGUF file holds Llama 3's scaling (rope_freqs)
    rope_freq_factors: tuple[float, ...] | None = None
    hidden_act: str = "silu"  # the MLP's gate activation: silu, gelu_tanh (GeGLU), or gpt_oss (see decoder)
    swiglu_limit: float = 7.0  # gpt_oss: the gate's and the up projection's clamp
    swiglu_alpha: float = 1.702  # gpt_oss: the gate's sigmoid slope
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # a norm on the attention's and the MLP's outputs too (Gemma)
    embed_scale: float | None = None  # the embeddings times this (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # attention scores' scale; None = head_dim ** -0.5
    sliding_layers: tuple[bool, ...] | None = None  # per layer: windowed (local) or global; None = all alike
    local_rope_theta: float | None = None  # the windowed layers' RoPE base (unscaled), when it differs
    attn_logit_softcapping: float | None = None  # attention scores become cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # so do the vocabulary logits
    num_experts: int = 0  # mixture of experts: every layer's MLP is this many experts (0: one dense MLP)
    experts_per_token: int = 0  # the router's top k
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top k routing weights renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # an expert every token runs, gated by a sigmoid (Qwen2-MoE)
    router_bias: bool = False  # the router's logits have a bias (gpt-oss)
    expert_bias: bool = False  # so do each expert's projections (gpt-oss)
    o_bias: bool = False  # the attention's output projection has a bias (attention_bias in Llama, Gemma, ...)
    attention_sinks: bool = False  # each head's learned logit joins its softmax's normalizer (gpt-oss)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def projection_widths(self) -> dict[str, int]:
        """Output columns of the projections a fused weight holds side by side (`quant.FUSED`)."""
        q, kv, i = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": i, "up_proj": i}

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}",
                file=source,
            )
        extras = ARCHITECTURES[arch]
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            rope_scaling = hf.get("rope_scaling") or None
            rope_theta = hf.get("rope_theta")
            partial = hf.get("partial_rotary_factor")
            gemma = _gemma(hf, arch, source)
            if gemma:
                rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
            elif rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
                # transformers 5 folds rope_theta and scaling into rope_parameters
                params = dict(hf["rope_parameters"])
                rope_theta = params.pop("rope_theta", 10000.0)
                partial = params.pop("partial_rotary_factor", partial)
                if params.get("rope_type", "default") != "default":
                    rope_scaling = params
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling)
                rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
                rope_scaling["rope_type"] = rope_type
                rope_scaling.pop("type", None)
                rope_scaling.pop("partial_rotary_factor", None)
                if rope_type == "longrope":  # Phi-3 keeps the pretraining length beside the scaling
                    rope_scaling.setdefault("original_max_position_embeddings",
                                            hf.get("original_max_position_embeddings"))
                    rope_scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in rope_scaling.items()}
                if rope_type == "default":
                    rope_scaling = None
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            moe = _moe(hf, arch, source) if extras.get("moe") else {}
            if arch == "GptOssForCausalLM":
                moe.update(_gpt_oss(hf, source))
            factors = hf.get("rope_freq_factors")
            bias = arch not in NO_ATTENTION_BIAS and bool(
                hf.get("attention_bias", hf.get("qkv_bias", extras.get("attention_bias", False))))
            return cls(
                **gemma,
                **moe,
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", bool(gemma))),
                attention_bias=bias,
                o_bias=bias and arch in BIAS_ON_OUTPUT,
                qk_norm=bool(extras.get("qk_norm", False)),
                sliding_window=(hf.get("sliding_window") or None) if arch in SLIDING_WINDOW else None,
                rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
                partial_rotary_factor=float(partial if partial is not None else 1.0),
                rope_freq_factors=tuple(float(f) for f in factors) if factors else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"invalid model config: {exc!r}", file=source) from exc

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json equivalent (used when caching converted GGUF weights)."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {
                "LlamaForCausalLM": "llama",
                "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3",
                "Phi3ForCausalLM": "phi3",
                "MixtralForCausalLM": "mixtral",
                "Qwen3MoeForCausalLM": "qwen3_moe",
                "Qwen2MoeForCausalLM": "qwen2_moe",
                "Gemma2ForCausalLM": "gemma2",
                "Gemma3ForCausalLM": "gemma3_text",
                "GptOssForCausalLM": "gpt_oss",
            }[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "partial_rotary_factor": self.partial_rotary_factor,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):  # transformers 5's form
            out.update(layer_types=["sliding_attention" if s else "full_attention" for s in self.sliding_layers],
                       query_pre_attn_scalar=round(self.attention_scale**-2, 6), hidden_activation="gelu_pytorch_tanh",
                       attn_logit_softcapping=self.attn_logit_softcapping,
                       final_logit_softcapping=self.final_logit_softcapping)
        if self.architecture == "Gemma3ForCausalLM":
            full = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling_dict or {})}
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}}
            del out["rope_theta"], out["rope_scaling"]
        if self.architecture == "GptOssForCausalLM":
            out.update(layer_types=["sliding_attention" if s else "full_attention" for s in self.sliding_layers],
                       swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        if self.rope_freq_factors:  # Kiln's own key: transformers has no form of a GGUF file's rope_freqs
            out["rope_freq_factors"] = list(self.rope_freq_factors)
        if self.num_experts:
            out.update(num_local_experts=self.num_experts, num_experts=self.num_experts,
                       num_experts_per_tok=self.experts_per_token, norm_topk_prob=self.norm_topk_prob)
            if self.architecture in ("MixtralForCausalLM", "GptOssForCausalLM"):
                out["intermediate_size"] = self.expert_intermediate_size
            else:
                out["moe_intermediate_size"] = self.expert_intermediate_size
            if self.shared_expert_intermediate_size:
                out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return out


def _gemma(hf: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """Gemma 2's and 3's departures from the Llama layout (empty for other families): GeGLU, (1 + w)
    RMSNorms around attention and MLP, scaled embeddings, query_pre_attn_scalar, soft-capped
    attention scores and logits where configured, and layers that alternate between a sliding
    window (Gemma 3: with a RoPE base of their own) and global attention."""
    if arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention is not supported (Kiln serves causal decoders)", file=source)
    layers = int(hf["num_hidden_layers"])
    period = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern") or 6)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one set per layer type
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1_000_000.0), local.get("rope_theta", 10_000.0)
        scaling = full if full.get("rope_type", "default") != "default" else None
    elif arch == "Gemma2ForCausalLM":  # one RoPE for every layer
        params = dict(params) if isinstance(params, dict) else {}
        theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10_000.0
        scaling = params if params.get("rope_type", "default") != "default" else hf.get("rope_scaling")
        local_theta = None
    else:
        theta, local_theta = hf.get("rope_theta", 1_000_000.0), hf.get("rope_local_base_freq", 10_000.0)
        scaling = hf.get("rope_scaling")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)", file=source)
    caps = {key: float(hf[key]) if hf.get(key) else None
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {
        "rope_theta": float(theta), "rope_scaling": scaling, "hidden_act": "gelu_tanh", "norm_offset": 1.0,
        "sandwich_norms": True, "embed_scale": float(hf["hidden_size"]) ** 0.5,
        "query_scale": float(hf.get("query_pre_attn_scalar") or 256) ** -0.5,
        "sliding_layers": tuple(t == "sliding_attention" for t in types),
        "local_rope_theta": None if local_theta is None else float(local_theta), **caps,
    }


def _moe(hf: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """A mixture-of-experts MLP in every layer (Mixtral, Qwen3-MoE)."""
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if experts < 1 or int(hf.get("num_experts_per_tok") or 0) < 1:
        raise ModelLoadError("a mixture-of-experts config needs num_experts and num_experts_per_tok", file=source)
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        raise ModelLoadError("dense MLP layers between expert layers (mlp_only_layers, decoder_sparse_step) are "
                             "not supported yet", file=source)
    if arch == "Qwen3MoeForCausalLM" and hf.get("shared_expert_intermediate_size"):
        raise ModelLoadError("shared experts are not supported yet", file=source)
    whole = arch in ("MixtralForCausalLM", "GptOssForCausalLM")  # intermediate_size is an expert's
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return {
        "num_experts": experts, "experts_per_token": int(hf["num_experts_per_tok"]),
        "expert_intermediate_size": int(hf["intermediate_size"] if whole else hf["moe_intermediate_size"]),
        "norm_topk_prob": True if whole else bool(hf.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": shared,
    }


def _gpt_oss(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """gpt-oss's layout: attention sinks, biases on every attention projection, the router and the
    experts, experts whose gate is clamped (swiglu_limit) and scaled inside its sigmoid
    (swiglu_alpha), the top k weights a softmax over the k router logits (the same as renormalizing
    the top k of a softmax over all), and every other layer windowed with the same RoPE."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {
        "hidden_act": "gpt_oss", "swiglu_limit": float(hf.get("swiglu_limit") or 7.0),
        "swiglu_alpha": float(hf.get("swiglu_alpha") or 1.702), "router_bias": True, "expert_bias": True,
        "attention_sinks": True, "sliding_layers": tuple(t == "sliding_attention" for t in types),
    }
