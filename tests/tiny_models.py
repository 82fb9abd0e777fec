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
    # attention_bias: Llama's puts biases on q, k, v and the output projection
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32}},
    ),
    "llama-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # fused qkv_proj and gate_up_proj; a window shorter than the tests' sequences
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 24, "pad_token_id": 0}),
    # LongRoPE past 64 positions, on half of each head's dims (Phi-4-mini's layout)
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {
        "pad_token_id": 0, "sliding_window": None, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
                         "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 64}}),
    # GeGLU, (1 + w) sandwich norms, scaled embeddings, q/k norms, query_pre_attn_scalar; a windowed
    # layer with its own RoPE base, then a global one with linear scaling
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "rope_theta": None,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # Gemma 2: Gemma 3's layout without q/k norms, one RoPE base, every other layer windowed; weights
    # large enough that the soft caps on attention scores and logits bite
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.0,
        "final_logit_softcapping": 2.0, "initializer_range": 0.2, "attn_implementation": "eager"}),
    # mixtures of experts: top 2 of 4 experts, renormalized (Mixtral) or not (Qwen3-MoE's default)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": None}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 48, "head_dim": 32}),
    # Qwen2-MoE: q/k/v biases, top 2 of 4 unnormalized, and a shared expert with its sigmoid gate
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 48,
                                                            "shared_expert_intermediate_size": 96}),
    # gpt-oss: attention sinks, biases everywhere, YaRN (untruncated), every other layer windowed, and a
    # clamp low enough to bite on these weights
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48, "head_dim": 16,
        "sliding_window": 24, "swiglu_limit": 0.1, "attn_implementation": "eager",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64}}),
}


def make_hf_model(variant: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = VARIANTS[variant]
    kwargs = {k: v for k, v in {**BASE, **extra, **overrides}.items() if v is not None or k != "rope_theta"}
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
            elif "sinks" in name:  # gpt-oss: logits as large as the attention scores'
                p.copy_(torch.randn_like(p))
    return model


def save_hf_model(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def served_hf_dir(variant: str, path: Path, kiln_cache: Path, **overrides) -> Path:
    """A tiny HF model directory with the suite's byte-level tokenizer (taken from a tiny GGUF's
    conversion in `kiln_cache`, which the tiny_model fixture makes), loadable by the server."""
    import json
    import shutil

    save_hf_model(make_hf_model(variant, vocab_size=260, **overrides), path)
    converted = next(p for p in sorted((kiln_cache / "converted").iterdir()) if (p / "tokenizer.json").exists()
                     and json.loads((p / "config.json").read_text())["vocab_size"] == 260)  # not the default model's
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, path / name)
    return path


def byte_vocab() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def llama_permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (for writing test GGUFs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A small SentencePiece vocabulary: llama.cpp's special and byte tokens, single characters, and
# every prefix of a few words after the space marker (so that BPE merges reach each word).
_SPM_WORDS = ["the", "and", "hello", "world", "is", "it", "in", "on", "an", "of", "to", "kiln"]
SPM_PIECES = list(dict.fromkeys(
    ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz0123456789,.!?'")
    + [("\u2581" + w)[:n] for w in _SPM_WORDS for n in range(2, len(w) + 2)] + ["he", "ll", "llo", "or", "ld"]))
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES


# HF per-layer suffix -> llama.cpp's tensor name (every family the tests write)
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3: fused in the file too
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a mixture of experts' router
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",  # Qwen2-MoE's shared expert and its gate
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi3": "phi3",
              "gemma2": "gemma2", "gpt_oss": "gpt-oss",
              "gemma3_text": "gemma3"}
# gpt-oss: its MLP's norm, sinks, the router and the experts' biases (gate's and up's apart, below)
_GGUF_GPT_OSS_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                       "self_attn.sinks": "attn_sinks.weight", "self_attn.o_proj.bias": "attn_output.bias",
                       "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                       "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
_GGUF_GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def llama3_rope_factors(cfg):
    """llama.cpp's converter's rope_freqs for a Llama 3 rope_scaling: each frequency's divisor."""
    import math

    import numpy as np

    rs = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rs["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def on_mxfp4_grid(model) -> None:
    """Rounds a gpt-oss model's experts to MXFP4 (32 inputs per block, as llama.cpp's file holds each
    output row), so that writing them as MXFP4 loses nothing."""
    import gguf
    import numpy as np

    with torch.no_grad():
        for layer in model.model.layers:
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)  # [E, in, out]
                rows = param.detach().numpy().transpose(0, 2, 1).astype(np.float32)
                grid = gguf.quants.dequantize(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4),
                                              gguf.GGMLQuantizationType.MXFP4).reshape(rows.shape)
                param.copy_(torch.from_numpy(np.ascontiguousarray(grid.transpose(0, 2, 1))))


def q4_k_blocks(w):
    """Q4_K super-blocks of a float [rows, cols] (cols a multiple of 256), as a simple quantizer makes
    them: each group of 32 its range over 15 levels, the 8 groups' scales and mins in 6 bits against
    the super-block's float16 d and dmin; bytes: d, dmin, 12 bytes of packed scales and mins, then
    32 bytes per pair of groups (the first in the low nibbles)."""
    import numpy as np

    rows, cols = w.shape
    blocks = cols // 256
    g = w.astype(np.float32).reshape(rows, blocks, 8, 32)
    lo, hi = np.minimum(g.min(-1), 0.0), g.max(-1)
    scale, mins = (hi - lo) / 15.0, -lo
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)

    def six_bits(x, unit):
        unit = unit.astype(np.float32)[..., None]
        return np.clip(np.rint(x / np.where(unit == 0, 1, unit)), 0, 63).astype(np.uint8)

    sc, m = six_bits(scale, d), six_bits(mins, dmin)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.rint((g + offset[..., None]) / np.where(step == 0, 1, step)[..., None]), 0, 15).astype(np.uint8)
    packed = [sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
              (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4]
    pairs = q.reshape(rows, blocks, 4, 2, 32)
    levels = (pairs[..., 0, :] | pairs[..., 1, :] << 4).reshape(rows, blocks, 128)
    halves = [x[..., None].view(np.uint8) for x in (d, dmin)]
    return np.concatenate([*halves, *packed, levels], axis=-1).reshape(rows, blocks * 144)


def write_gguf(model, path: Path, quant=None, tokenizer: str = "gpt2", extra=None, pre: str = "smollm",
               fuse_gate_up: bool = False, types: dict | None = None) -> Path:
    """Writes an HF model (Llama, Mixtral, Qwen3-MoE, Phi-3, Gemma 3 or gpt-oss) as llama.cpp's
    converter would (its architecture's keys and tensor names; Llama 3's scaling as rope_freqs, Phi-3's
    LongRoPE factors as tensors, Gemma's norms as the 1 + w they scale by, gpt-oss's experts as MXFP4
    with gate and up apart; optionally Q8_0 matrices), with the byte-level BPE test tokenizer (and
    pre-tokenizer `pre`), or with `tokenizer="llama"` the SentencePiece one (SPM_TOKENS).
    `fuse_gate_up`: gpt-oss's gate and up experts in one tensor, gate's rows first (llama.cpp's option).
    `extra(writer)` adds keys of a test's own; `types` gives tensors (by GGUF name) a type of their own."""
    import gguf
    import numpy as np

    cfg = model.config
    arch = _GGUF_ARCH[cfg.model_type]
    rope = cfg.rope_parameters
    if arch == "gemma3":  # one set per layer kind; llama.cpp keeps the global one (and its linear scaling)
        rope = rope["full_attention"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch in ("qwen2moe", "qwen3moe"):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "gpt-oss":
            w.add_expert_feed_forward_length(cfg.intermediate_size)
            w.add_sliding_window(cfg.sliding_window)
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tensors, mxfp4 = {}, {}
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(cfg)
    if arch == "phi3":
        partial = getattr(cfg, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
        w.add_rope_dimension_count(int(head_dim * partial))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        if rope.get("rope_type") == "longrope":
            import math

            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            orig = cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
            tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
            tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    if tokenizer == "llama":
        assert len(SPM_TOKENS) == cfg.vocab_size
        w.add_tokenizer_model("llama")
        w.add_token_list(SPM_TOKENS)
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
        # longer pieces score better, so that merges build words (a log-probability in real files)
        w.add_token_scores([0.0] * 259 + [-1000.0 + 10 * len(t) - i * 1e-3 for i, t in enumerate(SPM_PIECES)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        tokens = byte_vocab() + SPECIALS
        assert len(tokens) == cfg.vocab_size
        w.add_token_list(tokens)
        w.add_token_types([1] * 256 + [3] * len(SPECIALS))
        w.add_token_merges([])
        w.add_bos_token_id(256)
        w.add_eos_token_id(258)
        w.add_pad_token_id(259)
        w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    if extra is not None:
        extra(w)
    for name, tensor in model.state_dict().items():
        arr = tensor.detach().numpy().astype(np.float32)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + 1.0
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = arr
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = arr
        elif name == "lm_head.weight":
            tensors["output.weight"] = arr
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            if arch == "gpt-oss" and rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                rows = arr.transpose(0, 2, 1)  # [E, in, out] -> [E, out, in]; gate's and up's rows interleaved
                parts = {"ffn_down_exps": rows} if rest.endswith("down_proj") else {
                    "ffn_gate_exps": rows[:, 0::2], "ffn_up_exps": rows[:, 1::2]}
                if fuse_gate_up and "ffn_gate_exps" in parts:
                    parts = {"ffn_gate_up_exps": np.concatenate([rows[:, 0::2], rows[:, 1::2]], axis=1)}
                for gname, part in parts.items():
                    mxfp4[f"blk.{layer}.{gname}.weight"] = np.ascontiguousarray(part)
                continue
            if arch == "gpt-oss" and rest == "mlp.experts.gate_up_proj_bias" and fuse_gate_up:
                tensors[f"blk.{layer}.ffn_gate_up_exps.bias"] = np.concatenate([arr[:, 0::2], arr[:, 1::2]], axis=-1)
                continue
            if arch == "gpt-oss" and rest == "mlp.experts.gate_up_proj_bias":
                tensors[f"blk.{layer}.ffn_gate_exps.bias"] = np.ascontiguousarray(arr[:, 0::2])
                tensors[f"blk.{layer}.ffn_up_exps.bias"] = np.ascontiguousarray(arr[:, 1::2])
                continue
            if rest == "mlp.experts.gate_up_proj":  # [E, 2 * ff, hidden]: gate, then up
                gate, up = np.split(arr, 2, axis=1)
                tensors[f"blk.{layer}.ffn_gate_exps.weight"], tensors[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
                continue
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                arr = llama_permute(arr, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                arr = llama_permute(arr, cfg.num_key_value_heads)
            names = {**_GGUF_LAYER_NAMES, **_GGUF_GEMMA_NORMS} if arch.startswith("gemma") else _GGUF_LAYER_NAMES
            if arch == "gpt-oss":
                names = {**_GGUF_LAYER_NAMES, **_GGUF_GPT_OSS_NAMES}
            tensors[f"blk.{layer}.{names[rest]}"] = arr
    for gname, arr in tensors.items():
        qtype = (types or {}).get(gname, quant)
        if qtype == gguf.GGMLQuantizationType.Q4_K and arr.ndim == 2:  # gguf-py cannot encode K-quants
            if arr.shape[1] % 256:
                w.add_tensor(gname, arr)  # llama.cpp too stores a row that super-blocks do not divide otherwise
            else:
                w.add_tensor(gname, q4_k_blocks(arr), raw_dtype=qtype)
        elif qtype is not None and arr.ndim == 2:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            try:
                raw = gguf.quants.quantize(arr, qtype)
            except NotImplementedError:  # a type gguf-py cannot encode: write zeroed blocks
                raw = np.zeros((arr.shape[0], arr.shape[1] // block * type_size), np.uint8)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    for gname, arr in mxfp4.items():
        raw = gguf.quants.quantize(arr.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
