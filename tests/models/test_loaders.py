"""HF-directory and GGUF loading: equal logits, sharded checkpoints, dtypes, and clear errors."""

import json
import shutil

import gguf
import jax
import numpy as np
import pytest
import torch
from conftest import jit_forward
from safetensors.numpy import save_file
from tiny_models import SPECIALS, make_hf_model, on_mxfp4_grid, save_hf_model, write_gguf

from kiln.errors import ModelLoadError
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.hf_loader import load_hf_dir
from kiln.models.loader import cache_dir, layer_param, load_model

IDS = [5, 77, 200, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50]


def logits_of(cfg, params, ids=IDS, blocks=4):
    kv = init_kv_cache(cfg, num_blocks=blocks, block_size=16)
    out, _ = jit_forward(params, kv, build_step_inputs([RowWork(list(ids), 0, list(range(blocks)))], 16), cfg)
    return np.asarray(out, np.float32)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("llama", vocab_size=260, seed=7)


@pytest.fixture
def hf_dir(hf_model, tmp_path):
    return save_hf_model(hf_model, tmp_path / "hf")


def test_sharded_checkpoint_equals_single_file(hf_model, tmp_path):
    single = save_hf_model(hf_model, tmp_path / "single")
    sharded = save_hf_model(hf_model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    cfg, p1, _ = load_hf_dir(single, np.float32, show_progress=False)
    _, p2, _ = load_hf_dir(sharded, np.float32, show_progress=False)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_supplied_params_are_neither_read_nor_required(hf_model, tmp_path):
    """A GGUF file's stored layers and tables come from the file's own blocks: the converted
    directory's float copies of them are skipped, unread, and may be absent."""
    from safetensors import safe_open

    from kiln.models.weights import build_params

    single = save_hf_model(hf_model, tmp_path / "single")
    cfg, whole, _ = load_hf_dir(single, np.float32, show_progress=False)
    with safe_open(str(single / "model.safetensors"), "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    supplied = {"q_proj", "down_proj", "embed"}
    kept = {name: t for name, t in tensors.items()
            if not name.endswith(("q_proj.weight", "down_proj.weight", "embed_tokens.weight"))}
    read: list[str] = []
    params = build_params(cfg, sorted(kept), lambda name: read.append(name) or kept[name], str, np.float32,
                          supplied=supplied)
    assert "embed" not in params and not supplied & set(params["layers"])
    assert not any(name.endswith(("q_proj.weight", "down_proj.weight", "embed_tokens.weight")) for name in read)
    for key, value in params["layers"].items():
        np.testing.assert_array_equal(value, whole["layers"][key])
    np.testing.assert_array_equal(params["final_norm"], whole["final_norm"])
    with pytest.raises(ModelLoadError, match="missing tensor"):  # what is not supplied is still required
        build_params(cfg, sorted(kept), kept.__getitem__, str, np.float32, supplied={"q_proj", "embed"})


def test_gguf_and_hf_dir_give_identical_logits(hf_model, hf_dir, tmp_path, kiln_cache):
    gguf_path = write_gguf(hf_model, tmp_path / "tiny.gguf")
    from_gguf = load_model(gguf_path, show_progress=False)
    # the converted cache dir is an HF dir; give the HF copy the same tokenizer
    converted = cache_dir() / "converted" / from_gguf.weights_digest[:32]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, hf_dir / name)
    from_hf = load_model(hf_dir, show_progress=False)
    np.testing.assert_array_equal(logits_of(from_gguf.config, from_gguf.params),
                                  logits_of(from_hf.config, from_hf.params))
    with torch.no_grad():
        ref = hf_model(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(logits_of(from_gguf.config, from_gguf.params), ref, atol=1e-4, rtol=0)
    # tokenizer and template come from GGUF metadata
    tok = from_gguf.tokenizer
    assert tok.encode("hi <|im_start|>x") == [ord("h"), ord("i"), tok.tokenizer.token_to_id("Ġ"), 257, ord("x")]
    assert tok.eos_token == SPECIALS[2] and tok.bos_token == SPECIALS[0]
    expected = "<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == expected
    assert from_gguf.weights_digest != from_hf.weights_digest


def test_quantized_gguf_dequantizes_and_unpermutes(hf_model, tmp_path, kiln_cache):
    path = write_gguf(hf_model, tmp_path / "q8.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    model = load_model(path, show_progress=False)
    w = hf_model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    expected = gguf.quants.dequantize(gguf.quants.quantize(w, q8_0), q8_0)
    np.testing.assert_array_equal(np.asarray(layer_param(model, "q_proj", 1)), expected.T)
    assert np.abs(expected - w).max() > 0  # really quantized


def test_second_gguf_load_reuses_the_converted_cache(hf_model, tmp_path, kiln_cache):
    path = write_gguf(hf_model, tmp_path / "again.gguf")
    first = load_model(path, show_progress=False)
    marker = cache_dir() / "converted" / first.weights_digest[:32]  # content-keyed
    stamp = (marker / "model.safetensors").stat().st_mtime_ns
    second = load_model(path, show_progress=False)
    assert (marker / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.weights_digest == second.weights_digest


# Each family's GGUF form, written as llama.cpp's converter writes it: Llama 3's scaling as a rope_freqs
# tensor, Mixtral as a llama file with stacked experts, Qwen3-MoE (renormalized top k, as llama.cpp
# runs it), Phi-3 with its fused projections, sliding window and LongRoPE factors as tensors, Gemma 2
# and 3 with their norms stored as 1 + w (and the layer kinds and attention scale llama.cpp assumes for
# them: every other / every sixth layer global, 1 / sqrt(head_dim)); Gemma 2's soft caps as keys;
# gpt-oss with its experts in MXFP4 (its weights rounded to that grid first, so the file loses
# nothing), gate and up apart, YaRN as keys (and the clamp llama.cpp assumes, 7: no key holds it).
GEMMA3_AS_LLAMA_CPP_RUNS_IT = {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 16}
GGUF_FAMILIES = [("llama3-rope", {}), ("mixtral", {}), ("qwen2-moe", {}), ("qwen3-moe", {"norm_topk_prob": True}),
                 ("phi3", {}),
                 ("phi3-longrope", {}), ("gemma2", {"query_pre_attn_scalar": 16}),
                 ("gemma3", GEMMA3_AS_LLAMA_CPP_RUNS_IT), ("gpt-oss", {"intermediate_size": 64, "swiglu_limit": 7.0})]


@pytest.mark.parametrize(("variant", "overrides"), GGUF_FAMILIES, ids=[v for v, _ in GGUF_FAMILIES])
def test_gguf_of_each_family_equals_its_hf_checkpoint(variant, overrides, tmp_path, kiln_cache):
    hf = make_hf_model(variant, vocab_size=260, seed=3, **overrides)
    if variant == "gpt-oss":
        on_mxfp4_grid(hf)
    path = write_gguf(hf, tmp_path / f"{variant}.gguf")
    first = load_model(path, show_progress=False)
    again = load_model(path, show_progress=False)  # from the converted cache: its config.json round trip
    assert again.config == first.config
    hf_dir = save_hf_model(hf, tmp_path / "hf")
    converted = cache_dir() / "converted" / first.weights_digest[:32]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, hf_dir / name)
    from_hf = load_model(hf_dir, show_progress=False)
    # 90 tokens: past Llama 3's and LongRoPE's pretraining lengths (32, 64)
    ids = list(np.random.RandomState(0).randint(3, 250, size=90))
    ours = logits_of(again.config, again.params, ids, blocks=8)
    # (Gemma's norms lose a bit to the file's 1 + w)
    np.testing.assert_allclose(ours, logits_of(from_hf.config, from_hf.params, ids, blocks=8), atol=1e-5, rtol=0)
    # transformers over a prompt within the pretraining length (one forward over a longer one rotates
    # all of it with LongRoPE's long factors; Kiln keeps the short ones for its first part)
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:60]])).logits[0].numpy()
    np.testing.assert_allclose(logits_of(again.config, again.params, ids[:60], blocks=4), ref, atol=1e-4, rtol=0)
    if variant == "llama3-rope":
        assert again.config.rope_freq_factors is not None and max(again.config.rope_freq_factors) == 8.0
    if variant in ("mixtral", "qwen3-moe"):
        assert again.config.num_experts == 4 and again.config.norm_topk_prob
    if variant == "qwen2-moe":
        assert again.config.shared_expert_intermediate_size == 96 and not again.config.norm_topk_prob
    if variant == "gemma3":
        assert again.config.sliding_layers == (True,) * 5 + (False,) and again.config.rope_scaling_dict["factor"] == 2
    if variant == "gemma2":
        assert (again.config.attn_logit_softcapping, again.config.final_logit_softcapping) == (1.0, 2.0)
    if variant == "gpt-oss":
        same = ("sliding_layers", "sliding_window", "attention_sinks", "router_bias", "expert_bias", "hidden_act",
                "num_experts", "expert_intermediate_size", "norm_topk_prob", "head_dim", "o_bias", "swiglu_limit")
        assert {k: getattr(again.config, k) for k in same} == {k: getattr(from_hf.config, k) for k in same}
        assert again.config.rope_scaling_dict["truncate"] is False  # as gpt-oss's own config says


def test_a_gpt_oss_gguf_with_gate_and_up_fused_loads_as_one_with_them_apart(tmp_path, kiln_cache):
    hf = make_hf_model("gpt-oss", vocab_size=260, seed=4, intermediate_size=64)
    on_mxfp4_grid(hf)
    apart = load_model(write_gguf(hf, tmp_path / "apart.gguf"), show_progress=False)
    fused = load_model(write_gguf(hf, tmp_path / "fused.gguf", fuse_gate_up=True), show_progress=False)
    assert fused.weights_digest != apart.weights_digest  # two files, each read
    for name in ("experts_gate", "experts_up", "experts_gate_bias", "experts_up_bias"):
        np.testing.assert_array_equal(np.asarray(layer_param(fused, name, 1)),
                                      np.asarray(layer_param(apart, name, 1)))


def test_a_gguf_with_shared_experts_is_refused_by_name(tmp_path, kiln_cache):
    hf = make_hf_model("qwen3-moe", vocab_size=260, seed=3)
    path = write_gguf(hf, tmp_path / "shared.gguf", extra=lambda w: w.add_expert_shared_count(1))
    with pytest.raises(ModelLoadError, match="shared experts are supported in qwen2moe files only") as e:
        load_model(path, show_progress=False)
    assert e.value.file == str(path)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "phi3", "gemma3"])
def test_a_quantized_gguf_of_a_new_family_holds_its_layers_as_stored(variant, tmp_path, kiln_cache):
    """Q8_0 matrices: the attention (Phi-3: split from its fused tensor) and dense MLPs held as int8,
    a mixture's experts, stacked, as float (float biases do not make `auto` float); the logits are
    those of the file dequantized."""
    from kiln.models.quant import Int8Weight

    hf = make_hf_model(variant, vocab_size=260, seed=3, **(GEMMA3_AS_LLAMA_CPP_RUNS_IT if variant == "gemma3" else {}))
    path = write_gguf(hf, tmp_path / "q8.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    model = load_model(path, show_progress=False, quantization="auto")
    assert model.quantization == "int8"
    assert isinstance(layer_param(model, "q_proj", 0), Int8Weight)
    dense = variant in ("phi3", "gemma3")
    assert isinstance(layer_param(model, "down_proj" if dense else "o_proj", 1), Int8Weight)
    dequantized = load_model(path, show_progress=False)
    np.testing.assert_allclose(logits_of(model.config, model.params),
                               logits_of(dequantized.config, dequantized.params), atol=1e-5, rtol=0)


def test_gpt_oss_experts_in_mxfp4_load_as_transformers_dequantizes_them(tmp_path):
    """gpt-oss's release format: each layer's experts as MXFP4 blocks and scales (4-bit values, 32
    per block of input features, a power-of-two scale each). Kiln's dequantization equals
    transformers' own, and the model it loads gives the logits of transformers' model holding those
    dequantized weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kiln.models.weights import dequantize_mxfp4

    hf = make_hf_model("gpt-oss", vocab_size=260, seed=3, intermediate_size=64)
    path = save_hf_model(hf, tmp_path / "gpt-oss")
    rng = np.random.RandomState(0)
    packed = {}
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [E, in, out]
            E, n_in, n_out = param.shape
            blocks = rng.randint(0, 256, size=(E, n_out, n_in // 32, 16)).astype(np.uint8)
            scales = rng.randint(119, 124, size=(E, n_out, n_in // 32)).astype(np.uint8)  # 2^-8 .. 2^-4
            ref = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
            np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), ref.numpy())
            with torch.no_grad():
                param.copy_(ref)
            packed[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)

    def as_mxfp4(tensors):
        for name, (blocks, scales) in packed.items():
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales

    _rewrite(path, as_mxfp4)
    cfg, params, _ = load_hf_dir(path, np.float32, show_progress=False)
    ids = list(np.random.RandomState(1).randint(3, 250, size=40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits_of(cfg, params, ids), ref, atol=1e-4, rtol=0)


def test_bfloat16_params(hf_model, hf_dir):
    cfg, p32, _ = load_hf_dir(hf_dir, np.float32, show_progress=False)
    _, p16, _ = load_hf_dir(hf_dir, jax.numpy.bfloat16, show_progress=False)
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(p16))
    np.testing.assert_allclose(logits_of(cfg, p16), logits_of(cfg, p32), atol=0.1, rtol=0)


# ---- bad input -----------------------------------------------------------------------------


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a model directory") as e:
        load_model(tmp_path / "nope", show_progress=False)
    assert str(tmp_path / "nope") in str(e.value)
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(tmp_path / "nope.gguf", show_progress=False)


def test_missing_weights_file_and_tensor(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_hf_dir(hf_dir, np.float32, show_progress=False)


def test_corrupt_safetensors(hf_dir):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt safetensors") as e:
        load_hf_dir(hf_dir, np.float32, show_progress=False)
    assert str(path) in str(e.value)


def _rewrite(hf_dir, change):
    from safetensors.numpy import load_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(hf_dir / "model.safetensors"))


def test_wrong_shape_names_file_and_tensor(hf_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(hf_dir, lambda t: t.__setitem__(name, np.zeros((3, 3), np.float32)))
    with pytest.raises(ModelLoadError, match="wrong shape \\(3, 3\\), expected \\(128, 64\\)") as e:
        load_hf_dir(hf_dir, np.float32, show_progress=False)
    assert e.value.tensor == name and e.value.file.endswith("model.safetensors")


def test_missing_tensor_is_named(hf_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(hf_dir, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match="missing tensor") as e:
        load_hf_dir(hf_dir, np.float32, show_progress=False)
    assert e.value.tensor == name


def test_unknown_architecture(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture \\['GPT2LMHeadModel'\\]") as e:
        load_hf_dir(hf_dir, np.float32, show_progress=False)
    assert e.value.file.endswith("config.json")


def test_unsupported_gguf_quantization_leaves_nothing_cached(hf_model, tmp_path, kiln_cache):
    path = write_gguf(hf_model, tmp_path / "q81.gguf", quant=gguf.GGMLQuantizationType.Q8_1)
    before = set((kiln_cache / "converted").iterdir()) if (kiln_cache / "converted").exists() else set()
    with pytest.raises(ModelLoadError, match="unsupported GGUF quantization Q8_1") as e:
        load_model(path, show_progress=False)
    assert (e.value.file == str(path) and e.value.tensor in ("output.weight", "token_embd.weight")
            or e.value.tensor.startswith("blk."))
    assert set((kiln_cache / "converted").iterdir()) == before  # no half-written cache entry


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ModelLoadError, match="corrupt or unreadable GGUF") as e:
        load_model(path, show_progress=False)
    assert e.value.file == str(path)


def test_unsupported_dtype(hf_dir):
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int3'"):
        load_model(hf_dir, dtype="int3", show_progress=False)
