"""Loads GGUF files: metadata -> config, dequantized tensors -> HF layout, tokenizer -> tokenizer.json;
and Q8_0/Q4_0/Q4_1/Q4_K layer weights and tables as Kiln's int8/int4 as stored (`stored_layers`,
`stored_tables`).

Files are read as llama.cpp's converter writes each family: it permutes the Q/K rows of `llama`
models for interleaved RoPE (undone here, to HF's rotate-half layout), holds Llama 3's RoPE
scaling as per-frequency divisors (rope_freqs), a mixture's experts stacked per layer, Phi-3's
projections fused and its LongRoPE factors as tensors, Gemma's norms as 1 + w, and gpt-oss's
experts in MXFP4 with gate and up (and their biases) apart.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig
from kiln.models.quant import (
    GROUP,
    LINEAR,
    Int4Table,
    Int4Weight,
    Int8Table,
    Int8Weight,
    compact_scales,
    int4_from_levels,
    quantize_int8,
    table_from_weight,
)
from kiln.models.weights import build_params

ARCH_TO_HF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
              "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
              "gpt-oss": "GptOssForCausalLM"}  # llama with experts: Mixtral

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Phi-3 keeps its fused projections: the query, key and value rows in one tensor, gate and up in ffn_up
# Gemma has a norm after attention and one before and after the MLP
_GEMMA_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# gpt-oss: its MLP's norm is post_attention_norm, attention sinks, and a router with a bias
_GPT_OSS_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                  "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
                  "ffn_gate_inp.bias": "mlp.router.bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias"}
_ARCH_LAYER_NAMES = {"phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                              "ffn_up.weight": "mlp.gate_up_proj.weight"},
                     "gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS, "gpt-oss": _GPT_OSS_NAMES}
# A mixture of experts: the router, and every expert's projection stacked in one tensor [E, out, in]
# (older Mixtral files hold one tensor per expert, ffn_gate.E.weight)
_ROUTER_NAME = {"ffn_gate_inp.weight": "mlp.gate.weight",
                # Qwen2-MoE's shared expert and its gate
                "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_STACKED_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                    "ffn_down_exps.weight": "down_proj"}
_GATE_UP_EXPERTS = "ffn_gate_up_exps.weight"  # gate's rows then up's, in one tensor (llama.cpp's fused option)
_EXPERT_OF_ITS_OWN = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
# the GGUF types each quantization holds as stored
_STORED_AS = {"int8": (GGMLQuantizationType.Q8_0,),
              "int4": (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)}
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                GGMLQuantizationType.F64}
Q4_K_BLOCK = 256  # values per Q4_K super-block: 8 groups of 32, 144 bytes
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as llama.cpp defines them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss): words by letter case with a contraction, digits in threes
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION
                + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    splits = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "gpt-4o": _GPT4O_SPLIT}
    split = splits.get(pre)
    if split is None:
        return None
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (its file lists none): every split of a
    piece into two pieces of the vocabulary, the best-scored merged piece first (then the shorter
    left part, as transformers orders them)."""
    found = []
    for piece, i in vocab.items():
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        found += [(scores[i], left, right) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _nibbles(qs: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q4_x block bytes [out, blocks, 16] as levels [out, in]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n_out, n_in)


def _q4_k(data: np.ndarray, n_out: int, n_in: int) -> list[np.ndarray]:
    """Q4_K super-blocks as [levels [out, in], scale, offset [out, in / 32]]. A super-block holds
    float16 d and dmin, then 12 bytes of 6-bit scales and mins for its 8 groups of 32, then 128
    bytes of levels: 32 bytes per pair of groups, the first group in the low nibbles. A weight is
    d * scale_g * level - dmin * min_g, so each group is Int4Weight's scale and offset."""
    blocks = np.asarray(data).reshape(n_out, n_in // Q4_K_BLOCK, 144)

    def f16(at: int) -> np.ndarray:
        return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]

    packed = blocks[..., 4:16]
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # groups 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7: a nibble of
    # bytes 8-11 below the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)
    scales = np.concatenate([low & 63, (extra & 15) | (low >> 6) << 4], axis=-1).astype(np.float32)
    mins = np.concatenate([high & 63, (extra >> 4) | (high >> 6) << 4], axis=-1).astype(np.float32)
    pairs = blocks[..., 16:].reshape(n_out, n_in // Q4_K_BLOCK, 4, 1, 32)
    levels = np.concatenate([pairs & 15, pairs >> 4], axis=-2).reshape(n_out, n_in)
    groups = n_in // GROUP
    return [levels, (f16(0) * scales).reshape(n_out, groups), (-f16(2) * mins).reshape(n_out, groups)]


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute for interleaved RoPE, on an [out, in] weight."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    """A parsed GGUF file: config, tensors (HF names) and tokenizer description."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except FileNotFoundError as exc:
            raise ModelLoadError("GGUF file not found", file=str(path)) from exc
        except Exception as exc:  # gguf raises ValueError/struct errors/... on corrupt files
            raise ModelLoadError(f"corrupt or unreadable GGUF file: {exc}", file=str(path)) from exc
        self.arch = self.meta("general.architecture")
        if self.arch not in ARCH_TO_HF:
            raise ModelLoadError(f"unsupported GGUF architecture {self.arch!r}; supported: {sorted(ARCH_TO_HF)}",
                                 file=str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.layer_names = {**_LAYER_NAMES, **_ROUTER_NAME, **_ARCH_LAYER_NAMES.get(self.arch, {})}
        # the layers' linear weights as the file names them -> Kiln's name (fused ones are split at load)
        self.linear_suffixes = {g: hf.split(".")[1] for g, hf in self.layer_names.items()
                                if hf.endswith(".weight") and hf.split(".")[1] in LINEAR}
        self._whole: tuple[str, np.ndarray] | None = None  # the stacked experts' tensor read last
        self.config = ModelConfig.from_hf(self.hf_config(), source=str(path))

    def meta(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def hf_config(self) -> dict:
        a = self.arch
        hidden = int(self.meta(f"{a}.embedding_length"))
        heads = int(self.meta(f"{a}.attention.head_count"))
        tokens = self.meta("tokenizer.ggml.tokens") or []
        rotary = self.meta(f"{a}.rope.dimension_count")
        # Phi-3 rotates part of each head (rope.dimension_count) and names no key length
        head_dim = int(self.meta(f"{a}.attention.key_length",
                                 rotary if rotary and a != "phi3" else hidden // heads))
        cfg = {
            "architectures": [ARCH_TO_HF[a]],
            "vocab_size": int(self.meta(f"{a}.vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self.meta(f"{a}.feed_forward_length",
                                               self.meta(f"{a}.expert_feed_forward_length", 0))),
            "num_hidden_layers": int(self.meta(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.meta(f"{a}.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "partial_rotary_factor": int(rotary) / head_dim if rotary else 1.0,
            "rms_norm_eps": float(self.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.meta(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.meta(f"{a}.context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta("tokenizer.ggml.eos_token_id"),
        }
        if a in ("phi3", "gpt-oss"):
            cfg["sliding_window"] = self.meta(f"{a}.attention.sliding_window")
        orig = self.meta(f"{a}.rope.scaling.original_context_length")
        scaling = self.meta(f"{a}.rope.scaling.type")
        if scaling and scaling != "none":
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self.meta(f"{a}.rope.scaling.factor"))}
            if orig:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's LongRoPE: its two sets of factors
            cfg["original_max_position_embeddings"] = int(orig)
            cfg["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(orig),
                                   "long_factor": self.read("rope_factors_long.weight").tolist(),
                                   "short_factor": self.read("rope_factors_short.weight").tolist()}
            if (attention_factor := self.meta(f"{a}.rope.scaling.attn_factor")) is not None:
                cfg["rope_scaling"]["attention_factor"] = float(attention_factor)
        if "rope_freqs.weight" in self.tensors:  # Llama 3's scaling, as per-frequency divisors
            factors = self.read("rope_freqs.weight").reshape(-1)
            if factors.size != int(head_dim * cfg["partial_rotary_factor"]) // 2:
                raise ModelLoadError(f"rope_freqs holds {factors.size} factors; the heads rotate "
                                     f"{int(head_dim * cfg['partial_rotary_factor']) // 2} frequencies",
                                     file=str(self.path), tensor="rope_freqs.weight")
            cfg["rope_freq_factors"] = factors.tolist()
        if a in ("gemma2", "gemma3"):
            cfg.update(self._gemma_config(cfg))
        if a == "gpt-oss" and cfg.get("rope_scaling", {}).get("rope_type") == "yarn":
            cfg["rope_scaling"]["truncate"] = False  # gpt-oss's YaRN keeps its correction range unrounded
        if experts := int(self.meta(f"{a}.expert_count", 0) or 0):
            if a == "qwen2moe":
                cfg["shared_expert_intermediate_size"] = int(self.meta(f"{a}.expert_shared_feed_forward_length", 0))
            elif self.meta(f"{a}.expert_shared_count"):
                raise ModelLoadError("shared experts are supported in qwen2moe files only", file=str(self.path))
            if a == "llama":
                cfg["architectures"] = ["MixtralForCausalLM"]
            cfg.update(num_local_experts=experts, num_experts=experts,
                       num_experts_per_tok=int(self.meta(f"{a}.expert_used_count")),
                       moe_intermediate_size=int(self.meta(f"{a}.expert_feed_forward_length",
                                                           cfg["intermediate_size"])),
                       # llama.cpp renormalizes the top k of these families (not Qwen2-MoE's) unless the
                       # file says otherwise
                       norm_topk_prob=bool(self.meta(f"{a}.expert_weights_norm", a != "qwen2moe")))
        return cfg

    def _gemma_config(self, cfg: dict) -> dict:
        """What a Gemma file leaves to llama.cpp's own rules: which layers are global (Gemma 2: every
        other one; Gemma 3: every sixth, unless the file lists its windowed layers), Gemma 3's
        windowed layers' RoPE base 10,000, and the attention scale 1/sqrt(head_dim), but
        1/sqrt(hidden / heads) for the 27B models (46 layers in Gemma 2, 62 in Gemma 3)."""
        a, layers = self.arch, cfg["num_hidden_layers"]
        pattern = self.meta(f"{a}.attention.sliding_window_pattern", 2 if a == "gemma2" else 6)
        sliding = ([bool(x) for x in pattern] if isinstance(pattern, list)
                   else [(i + 1) % int(pattern) != 0 for i in range(layers)])
        big = layers == (46 if a == "gemma2" else 62)
        out = {"model_type": f"{a}_text" if a == "gemma3" else a,
               "sliding_window": self.meta(f"{a}.attention.sliding_window"),
               "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
               "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
               "attn_logit_softcapping": self.meta(f"{a}.attn_logit_softcapping"),
               "final_logit_softcapping": self.meta(f"{a}.final_logit_softcapping")}
        if a == "gemma3":
            full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
            full.update(cfg.pop("rope_scaling", None) or {})
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(self.meta(f"{a}.rope.freq_base_swa", 10000.0))}}
        return out

    def hf_names(self) -> dict[str, str]:
        """HF tensor name -> GGUF tensor name (`name#e`: expert e of a stacked experts' tensor;
        `...%h`: half h of it, or of a bias's last axis; `a|b`: a's and b's last axes interleaved,
        as gpt-oss's checkpoint holds its gate and up biases)."""
        out = {}
        for name in self.tensors:
            if name in _GLOBAL_NAMES:
                out[_GLOBAL_NAMES[name]] = name
            elif m := _BLK.match(name):
                layer, rest = f"model.layers.{m.group(1)}.", m.group(2)
                if rest in self.layer_names:
                    out[layer + self.layer_names[rest]] = name
                elif rest in _STACKED_EXPERTS:
                    for e in range(self.config.num_experts):
                        out[f"{layer}mlp.experts.{e}.{_STACKED_EXPERTS[rest]}.weight"] = f"{name}#{e}"
                elif rest == _GATE_UP_EXPERTS:
                    for e in range(self.config.num_experts):
                        out[f"{layer}mlp.experts.{e}.gate_proj.weight"] = f"{name}#{e}%0"
                        out[f"{layer}mlp.experts.{e}.up_proj.weight"] = f"{name}#{e}%1"
                elif rest == "ffn_gate_exps.bias":
                    out[layer + "mlp.experts.gate_up_proj_bias"] = f"{name}|blk.{m.group(1)}.ffn_up_exps.bias"
                elif rest == "ffn_gate_up_exps.bias":
                    out[layer + "mlp.experts.gate_up_proj_bias"] = f"{name}%0|{name}%1"
                elif own := _EXPERT_OF_ITS_OWN.match(rest):
                    out[f"{layer}mlp.experts.{own.group(2)}.{own.group(1)}_proj.weight"] = name
        return out

    def read(self, gguf_name: str) -> np.ndarray:
        if "|" in gguf_name:
            a, b = (self.read(part) for part in gguf_name.split("|"))
            return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1)
        stored, _, half = gguf_name.partition("%")
        w = self._expert(stored)
        return np.split(w, 2, axis=0 if "#" in stored else -1)[int(half)] if half else w

    def _expert(self, gguf_name: str) -> np.ndarray:
        name, _, expert = gguf_name.partition("#")
        if not expert:
            return self._read(name)
        if self._whole is None or self._whole[0] != name:  # each expert of it is read in turn
            self._whole = (name, self._read(name))
        return self._whole[1][int(expert)]

    def _read(self, gguf_name: str) -> np.ndarray:
        t = self.tensors[gguf_name]
        shape = tuple(int(x) for x in reversed(t.shape))
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
                w = np.asarray(t.data)
                if t.tensor_type == GGMLQuantizationType.BF16:
                    import ml_dtypes

                    w = w.view(ml_dtypes.bfloat16)
                w = w.astype(np.float32)
            else:
                w = dequantize(t.data, t.tensor_type)
            w = w.reshape(shape)
        except NotImplementedError as exc:
            raise ModelLoadError(f"unsupported GGUF quantization {t.tensor_type.name}", file=str(self.path),
                                 tensor=gguf_name) from exc
        except ValueError as exc:
            raise ModelLoadError(f"cannot decode tensor: {exc}", file=str(self.path), tensor=gguf_name) from exc
        if self.arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config.num_heads if gguf_name.endswith("attn_q.weight") else self.config.num_kv_heads
            w = unpermute_qk(w, heads)
        if self.arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's converter stores Gemma's norms as the 1 + w they scale by
        return w

    def stored_quantization(self) -> tuple[str, str]:
        """The quantization that holds this file's layer weights, and why: int8 for Q8_0, int4 for
        Q4_0/Q4_1/Q4_K; for other quantized types, and mixes of them, int4 where some layers are in
        4-bit blocks (a Q4_K_M file, whose attn_v and ffn_down layers are partly Q6_K), int8 otherwise
        (`stored_layers` says which projection is held how); none (float) where a layer is float."""
        types = {t.tensor_type for name, t in self.tensors.items()
                 if (m := _BLK.match(name)) and m.group(2) in self.linear_suffixes}
        names = ", ".join(sorted(t.name for t in types))
        for quantization, stored in _STORED_AS.items():
            if types and types <= set(stored):
                return quantization, f"auto: the GGUF file's layers are {names}"
        if not types or types & _FLOAT_TYPES:
            return "none", f"auto: the GGUF file's layers are {names}, held as float"
        if types & set(_STORED_AS["int4"]):
            return "int4", f"auto: the GGUF file's layers are {names}; projections with more bits held as int8"
        return "int8", f"auto: the GGUF file's layers are {names}, held as int8"

    def stored_layers(self, quantization: str) -> dict[str, Int8Weight | Int4Weight]:
        """The layers' linear weights that the file stores in `quantization`'s own blocks (int8: Q8_0;
        int4: Q4_0, Q4_1, Q4_K), as Kiln's quantized weights (stacked per name) without a trip through
        float. With int4, a projection the file stores in more bits is held as int8: as stored where
        all its layers are Q8_0, else quantized from float (Q5_x, Q6_K, or a mix of layers). Any
        other name is left out (the loader quantizes it from float)."""
        types = _STORED_AS.get(quantization, ())
        out = {}
        for gguf_suffix, name in self.linear_suffixes.items():
            tensors = [self.tensors.get(f"blk.{i}.{gguf_suffix}") for i in range(self.config.num_layers)]
            if any(t is None for t in tensors):
                continue
            kinds = {t.tensor_type for t in tensors}
            if kinds <= set(types) or (quantization == "int4" and kinds <= set(_STORED_AS["int8"])):
                layers = [self._stored(t, gguf_suffix) for t in tensors]
                out[name] = compact_scales(type(layers[0])(*(np.stack(parts) for parts in zip(*layers, strict=True))))
            elif quantization == "int4" and not kinds & _FLOAT_TYPES:
                out[name] = quantize_int8(np.stack([self.read(f"blk.{i}.{gguf_suffix}").T for i in
                                                    range(self.config.num_layers)]))
        return out

    def stored_tables(self) -> dict[str, Int8Table | Int4Table]:
        """The embedding ("embed") and an untied LM head ("lm_head") that the file stores in Q8_0,
        Q4_0, Q4_1 or Q4_K blocks, as Kiln's tables (whatever format the layers are held in: the file's own
        blocks lose nothing). One in another type is left out (the loader quantizes it from float)."""
        stored = set(_STORED_AS["int8"] + _STORED_AS["int4"])
        out = {}
        for gguf_name, name in (("token_embd.weight", "embed"), ("output.weight", "lm_head")):
            t = self.tensors.get(gguf_name)
            if t is not None and t.tensor_type in stored:
                out[name] = table_from_weight(self._stored(t, gguf_name))
        return out

    def _stored(self, t, gguf_suffix: str) -> Int8Weight | Int4Weight:
        """One Q8_0/Q4_0/Q4_1/Q4_K tensor ([out, in] in the file) as [in, out]. Block j of a row holds
        input rows 32j..32j+31 after its float16 scale (and Q4_1's float16 offset): Q8_0 as 32 int8,
        Q4_x as 16 bytes, rows 0-15 in the low nibbles and 16-31 in the high (Q4_K: `_q4_k`)."""
        n_out, n_in = (int(x) for x in reversed(t.shape))
        if t.tensor_type == GGMLQuantizationType.Q4_K:
            parts = _q4_k(t.data, n_out, n_in)
        else:
            blocks = np.asarray(t.data).reshape(n_out, n_in // GROUP, -1)

            def f16(at: int) -> np.ndarray:
                return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)

            scale = f16(0)
            if t.tensor_type == GGMLQuantizationType.Q8_0:
                parts = [blocks[..., 2:].copy().view(np.int8).reshape(n_out, n_in), scale]
            elif t.tensor_type == GGMLQuantizationType.Q4_1:
                parts = [_nibbles(blocks[..., 4:], n_out, n_in), scale, f16(2)]
            else:  # Q4_0: levels 0..15 around 8
                parts = [_nibbles(blocks[..., 2:], n_out, n_in), scale, -8.0 * scale]
        if self.arch == "llama" and gguf_suffix in ("attn_q.weight", "attn_k.weight"):
            heads = self.config.num_heads if gguf_suffix == "attn_q.weight" else self.config.num_kv_heads
            parts = [unpermute_qk(a, heads) for a in parts]
        parts = [np.ascontiguousarray(a.T) for a in parts]
        if t.tensor_type == GGMLQuantizationType.Q8_0:
            return compact_scales(Int8Weight(*parts))
        return int4_from_levels(*parts)

    def load_params(self, dtype, progress=None) -> dict:
        names = self.hf_names()
        return build_params(
            self.config, sorted(names), lambda n: self.read(names[n]), lambda n: str(self.path), dtype, progress
        )

    # ---- tokenizer -------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        model = self.meta("tokenizer.ggml.model")
        tokens = list(self.meta("tokenizer.ggml.tokens"))
        if model == "llama":
            tok = self._sentencepiece(tokens)
        elif model == "gpt2":
            pre_name = self.meta("tokenizer.ggml.pre", "default")
            pre = _pre_tokenizer(pre_name)
            if pre is None:
                raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre_name!r}", file=str(self.path))
            merges = [tuple(m.split(" ", 1)) for m in self.meta("tokenizer.ggml.merges") or []]
            tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
            tok.pre_tokenizer = pre
            tok.decoder = decoders.ByteLevel()
        else:
            raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2 byte-level BPE, "
                                 "llama SentencePiece BPE)", file=str(self.path))
        types = list(self.meta("tokenizer.ggml.token_type") or [])
        special = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == 3]
        user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == 4]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        return tok

    def _sentencepiece(self, tokens: list[str]) -> Tokenizer:
        """SentencePiece BPE (Llama 2, Mistral): "▁" for spaces and before the text, pieces merged
        best score first, bytes (<0x..> tokens) for what the pieces do not cover."""
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self.meta("tokenizer.ggml.merges") or []]
        if not merges:
            merges = _merges_from_scores(vocab, list(self.meta("tokenizer.ggml.scores") or [0.0] * len(tokens)))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
        prefix = bool(self.meta("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * prefix)
        return tok

    def tokenizer_config(self) -> dict:
        tokens = self.meta("tokenizer.ggml.tokens")

        def token(key):
            idx = self.meta(f"tokenizer.ggml.{key}_token_id")
            return tokens[idx] if idx is not None else None

        return {
            "bos_token": token("bos"),
            "eos_token": token("eos"),
            "unk_token": token("unknown"),
            "pad_token": token("padding"),
            # llama.cpp adds BOS for a SentencePiece vocabulary whose file does not say otherwise
            "add_bos_token": bool(self.meta("tokenizer.ggml.add_bos_token",
                                            self.meta("tokenizer.ggml.model") == "llama")),
            "add_eos_token": bool(self.meta("tokenizer.ggml.add_eos_token", False)),
            "chat_template": self.meta("tokenizer.chat_template"),
        }
