"""Weight-only int8 and int4 quantization: the round trips' bounds, GGUF's Q4_0/Q4_1 blocks taken as
stored (against gguf's own dequantizer), the logits' distance from float32, greedy agreement, and the
quantized weights' layouts (stacked under scan, one dict per layer)."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_forward
from tiny_models import make_hf_model, write_gguf

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.errors import ConfigError
from kiln.kernels import cpu as cpu_kernel_build
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.generate import greedy_generate
from kiln.models.gguf_loader import GGUFModel
from kiln.models.loader import STORED_FORMAT, STORED_VERSION, auto_quantization, file_digest, layer_param, load_model
from kiln.models.quant import (
    FUSED,
    HEAD_CHUNK,
    MIN_ROWS_16BIT,
    Int4Table,
    Int4Weight,
    Int8Table,
    Int8Weight,
    dequantize,
    dequantize_table,
    for_matmul,
    product_dtype,
    quantize_int4,
    quantize_int8,
    quantize_params,
    quantize_table,
    table_from_weight,
    table_logits,
    table_rows,
    unfuse_projections,
    unfused,
)
from kiln.models.quant import matmul as quant_matmul
from kiln.xla_flags import CPU_SCHEDULER_FLAG, add_process_flags

# how close a quantized model's logprobs stay to float32's (measured at most 0.007 for int8 and
# 0.09 for int4 on these tiny models; greedy picks agree at 90% of int4's positions), and the
# weight type each format holds
LOGPROB_BOUND = {"int8": 0.05, "int4": 0.3}
WEIGHT = {"int8": Int8Weight, "int4": Int4Weight}
WEIGHT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_file(request, tmp_path_factory, kiln_cache):
    """A tiny llama with its tokenizer, as a GGUF file; with its own LM head, or tied to its embeddings."""
    hf = make_hf_model("llama", vocab_size=260, seed=7, tie_word_embeddings=request.param == "tied")
    return write_gguf(hf, tmp_path_factory.mktemp("q") / "tiny.gguf")


def logprobs(model, ids):
    kv = init_kv_cache(model.config, num_blocks=8, block_size=16)
    inputs = build_step_inputs([RowWork(list(ids), 0, [1, 2, 3, 4])], 16)
    out, _ = jit_forward(model.params, kv, inputs, model.config)
    return np.asarray(jax.nn.log_softmax(np.asarray(out, np.float32), axis=-1))


def test_int8_round_trip_is_within_half_a_step_per_group():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64, 24)).astype(np.float32) * rng.random(24).astype(np.float32)
    w[..., 5] = 0.0  # an all-zero channel stays exactly zero
    w[:, 7, 2] = 40.0  # an outlier coarsens only its own group
    q = quantize_int8(w)
    assert q.q.dtype == np.int8 and q.scale.shape == (3, 2, 24) and np.abs(q.q).max() <= 127
    err = np.abs(dequantize(q) - w)
    assert np.all(err <= np.repeat(q.scale, 32, axis=-2) / 2 + 1e-6)
    assert np.all(dequantize(q)[..., 5] == 0.0)
    assert np.all(q.scale[:, 1, 2] < 40.0 / 127)
    assert q.scale.dtype == np.float16  # GGUF's width: levels are computed against the scale as stored
    tiny = quantize_int8(w * 1e-8)  # float16 would flush these scales to zero: they stay float32
    assert tiny.scale.dtype == np.float32
    assert np.all(np.abs(dequantize(tiny) - w * 1e-8) <= np.repeat(tiny.scale, 32, axis=-2) * 0.5001)
    per_channel = quantize_int8(w[:, :40], group=32)  # rows that groups of 32 do not divide: one group
    assert per_channel.scale.shape == (3, 1, 24)


def test_int4_round_trip_is_within_half_a_step_per_group():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 64, 24)).astype(np.float32) * rng.random(24).astype(np.float32)
    w[..., 3] = 0.25  # a constant channel comes back exactly
    q = quantize_int4(w)
    assert q.packed.dtype == np.uint8 and q.packed.shape == (2, 32, 24)
    assert q.scale.shape == q.offset.shape == (2, 2, 24)
    assert q.scale.dtype == q.offset.dtype == np.float16
    err = np.abs(dequantize(q) - w)
    assert np.all(err <= np.repeat(q.scale, 32, axis=-2) / 2 + 1e-6)
    assert np.all(dequantize(q)[..., 3] == 0.25)


def test_int4_pairs_its_nibbles_along_the_longer_side_and_multiplies_the_same():
    """for_matmul repacks a weight wider than it is deep (pairs along its output columns); deeper ones,
    and weights already repacked, stay as they are. Dequantized and multiplied, both layouts agree."""
    rng = np.random.default_rng(1)
    wide, deep = (quantize_int4(rng.standard_normal(shape).astype(np.float32)) for shape in ((3, 64, 96), (3, 96, 64)))
    repacked = for_matmul(wide)
    assert repacked.packed.shape == (3, 64, 48) and repacked.scale.shape == wide.scale.shape
    assert for_matmul(repacked) is repacked and for_matmul(deep) is deep
    np.testing.assert_array_equal(dequantize(repacked), dequantize(wide))
    x = jnp.asarray(rng.standard_normal((5, 64)).astype(np.float32))
    for layer in range(3):
        one, other = (jax.tree.map(lambda a, i=layer: jnp.asarray(a[i]), w) for w in (wide, repacked))
        np.testing.assert_allclose(quant_matmul(x, other), quant_matmul(x, one), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(quant_matmul(x, other), x @ dequantize(one), rtol=1e-5, atol=1e-5)
    params = {"layers": {"up_proj": rng.standard_normal((2, 64, 96)).astype(np.float32),
                         "down_proj": rng.standard_normal((2, 96, 64)).astype(np.float32)},
              "embed": rng.standard_normal((8, 64)).astype(np.float32)}
    held = quantize_params(params, "int4")["layers"]  # what a model loads with
    assert held["up_proj"].packed.shape == (2, 64, 48) and held["down_proj"].packed.shape == (2, 48, 64)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_projections_of_one_input_are_held_fused_and_multiply_as_apart(quantization):
    """q/k/v and gate/up, quantized alike, are one weight: `unfused` gives each member back exactly as
    it is held apart, and the fused product, split, is each member's product. Members in different
    formats stay apart."""
    rng = np.random.default_rng(2)
    shapes = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 96, "up_proj": 96}
    params = {"layers": {name: rng.standard_normal((2, 64, out)).astype(np.float32) for name, out in shapes.items()},
              "embed": rng.standard_normal((8, 64)).astype(np.float32)}
    held = quantize_params(params, quantization)["layers"]
    assert sorted(held) == ["gate_up_proj", "o_proj", "qkv_proj"]
    quantize = quantize_int4 if quantization == "int4" else quantize_int8
    x = jnp.asarray(rng.standard_normal((9, 64)).astype(np.float32))
    for fused, members in FUSED.items():
        widths = tuple(shapes[m] for m in members)
        for i, name in enumerate(members):
            apart = quantize(params["layers"][name])
            apart = for_matmul(apart) if quantization == "int4" else apart
            member = unfused(held[fused], widths, i)
            assert all(np.array_equal(a, b) for a, b in zip(member, apart, strict=True))
            for layer in range(2):
                got = quant_matmul(x, jax.tree.map(lambda a, j=layer: jnp.asarray(a[j]), held[fused]))
                lo = sum(widths[:i])
                want = quant_matmul(x, jax.tree.map(lambda a, j=layer: jnp.asarray(a[j]), apart))
                np.testing.assert_allclose(got[:, lo:lo + widths[i]], want, rtol=1e-5, atol=1e-5)
    mixed = {**params["layers"], "v_proj": quantize_int8(params["layers"]["v_proj"])}  # as a Q4_K_M file's
    kept = quantize_params({**params, "layers": mixed}, "int4")["layers"]
    assert sorted(kept) == ["gate_up_proj", "k_proj", "o_proj", "q_proj", "v_proj"]


def test_fused_projections_take_each_members_adapter_and_bias(kiln_cache, tmp_path):
    """A quantized model with attention biases: rows with an adapter on some members of the fused
    groups give the logits of the same weights held apart."""
    from tiny_models import save_hf_model

    from kiln.models.hf_loader import load_hf_dir
    from kiln.models.lora import empty_lora_state, module_shapes, set_slot

    cfg, params, _ = load_hf_dir(save_hf_model(make_hf_model("qwen2"), tmp_path), np.float32, show_progress=False)
    fused = quantize_params(params, "int4")
    apart = {**fused, "layers": unfuse_projections(fused["layers"], cfg.projection_widths)}
    rng = np.random.RandomState(3)
    shapes = module_shapes(cfg)
    adapter = {m: {"a": (0.3 * rng.randn(cfg.num_layers, shapes[m][0], 4)).astype(np.float32),
                   "b": (0.3 * rng.randn(cfg.num_layers, 4, shapes[m][1])).astype(np.float32)}
               for m in ("k_proj", "up_proj", "o_proj")}
    state = set_slot(empty_lora_state(cfg, n_slots=2, rank=4), 1, adapter, 2.0)
    ids = list(rng.randint(3, cfg.vocab_size, size=12))
    rows = [RowWork(ids, 0, [1], 1), RowWork(ids, 0, [3], 0)]

    def run(p):
        kv = init_kv_cache(cfg, num_blocks=8, block_size=16)
        return np.asarray(jit_forward(p, kv, build_step_inputs(rows, 16), cfg, state)[0])

    got, want = run(fused), run(apart)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert np.abs(got[:12] - got[12:]).max() > 1e-2  # the adapter matters


def _rounded(a, dtype):
    return np.asarray(jnp.asarray(a).astype(dtype).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_models_quantized_multiplies_take_its_type_from_eight_rows(dtype):
    """Serving a 16-bit model, a quantized weight multiplies `MIN_ROWS_16BIT` rows or more with both
    operands rounded to its type (sums in float32): exactly the rounded dequantized weight's product
    (int8 with one scale per channel: the levels', scaled after). Fewer rows, and every float32 model,
    multiply in float32 (`product_dtype`)."""
    rng = np.random.default_rng(4)
    weights = {"int8 groups": quantize_int8(rng.standard_normal((64, 48)).astype(np.float32)),
               "int8 per channel": quantize_int8(rng.standard_normal((40, 48)).astype(np.float32)),
               "int4 deep": quantize_int4(rng.standard_normal((96, 64)).astype(np.float32)),
               "int4 wide": for_matmul(quantize_int4(rng.standard_normal((64, 96)).astype(np.float32)))}
    for name, w in weights.items():
        full = dequantize(w)
        w = jax.tree.map(jnp.asarray, w)
        for rows in (MIN_ROWS_16BIT - 1, MIN_ROWS_16BIT, 32):
            x = rng.standard_normal((rows, full.shape[0])).astype(np.float32)
            got = np.asarray(jax.jit(quant_matmul, static_argnums=2)(x, w, product_dtype(rows, dtype)))
            sixteen = rows >= MIN_ROWS_16BIT
            want = _rounded(x, dtype) @ _rounded(full, dtype) if sixteen else x @ full
            if sixteen and name == "int8 per channel":  # its one scale multiplies the product: levels are exact
                want = (_rounded(x, dtype) @ np.asarray(w.q, np.float32)) * np.asarray(w.scale[0], np.float32)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=f"{name}, {rows} rows")
            if sixteen:  # really rounded: float32 products differ
                assert np.abs(got - x @ full).max() > 1e-3, name
            np.testing.assert_allclose(np.asarray(quant_matmul(x, w)), x @ full, rtol=1e-5, atol=1e-4)
    table = table_from_weight(quantize_int4(rng.standard_normal((64, 300)).astype(np.float32)))
    full = dequantize_table(table)
    for rows in (MIN_ROWS_16BIT - 1, MIN_ROWS_16BIT):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        want = _rounded(x, dtype) @ _rounded(full, dtype).T if rows >= MIN_ROWS_16BIT else x @ full.T
        got = jax.jit(table_logits, static_argnums=2)(x, table, product_dtype(rows, dtype))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    assert product_dtype(MIN_ROWS_16BIT, jnp.float32) == jnp.float32


@pytest.mark.parametrize("rows", [260, 2 * HEAD_CHUNK + 3])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_table_looks_rows_up_and_multiplies_them_as_its_float_copy(kind, rows):
    """Rows padded to whole chunks of the head's loop: lookups and logits equal the dequantized
    table's, chunk boundaries and padding included, and the padding adds logits of 0 only."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((rows, 64)).astype(np.float32)
    table = quantize_table(w) if kind == "int8" else table_from_weight(quantize_int4(w.T))
    full = dequantize_table(table)
    assert full.shape[0] >= rows and full.shape[0] % 8 == 0 and np.all(full[rows:] == 0)
    assert np.abs(full[:rows] - w).max() < (0.02 if kind == "int8" else 0.4)
    ids = jnp.asarray(rng.integers(0, rows, (3, 5)))
    np.testing.assert_array_equal(np.asarray(table_rows(table, ids)), full[np.asarray(ids)])
    x = rng.standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(table_logits)(x, table)), x @ full.T, rtol=1e-5, atol=1e-4)
    # differentiable in x (LoRA training on a quantized base runs its head)
    grad = jax.grad(lambda x: table_logits(x, table)[:, :rows].sum())(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(grad), np.broadcast_to(full[:rows].sum(0), x.shape), rtol=1e-4, atol=1e-3)


def test_int4_needs_input_rows_that_groups_divide():
    params = {"layers": {"q_proj": np.zeros((2, 48, 64), np.float32)}}
    with pytest.raises(ConfigError, match="int4: q_proj has 48 input rows, which groups of 32 do not divide"):
        quantize_params(params, "int4")


@pytest.mark.parametrize(("qtype", "quantization"), [("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4")])
def test_gguf_blocks_load_as_stored(tmp_path, kiln_cache, qtype, quantization):
    """The file's own levels, scales and offsets: dequantized, exactly what gguf's dequantizer makes of
    them (through which the float model is converted), Q/K rows un-permuted alike."""
    import gguf

    hf = make_hf_model("llama", vocab_size=260, seed=7)
    path = write_gguf(hf, tmp_path / f"{qtype}.gguf", quant=gguf.GGMLQuantizationType[qtype])
    stored = GGUFModel(path).stored_layers(quantization)
    assert sorted(stored) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if quantization == "int4":
        assert GGUFModel(path).stored_layers("int8") == {}  # 4-bit blocks are not int8's
    else:  # int4 asked of Q8_0 layers keeps their 8 bits, as stored
        other = GGUFModel(path).stored_layers("int4")
        assert all(np.array_equal(a, b) for n in stored for a, b in zip(other[n], stored[n], strict=True))
    ref = load_model(path, show_progress=False, layer_loop="scan")
    for name, w in stored.items():
        assert isinstance(w, WEIGHT[quantization])
        assert all(a.dtype == np.float16 for a in w[1:])  # the file's float16 scales (and offsets), as stored
        np.testing.assert_allclose(dequantize(w), np.asarray(ref.params["layers"][name]), rtol=0, atol=1e-6)
    loaded = load_model(path, show_progress=False, quantization=quantization)
    for name, w in stored.items():  # int4: the same levels, paired for the multiply (for_matmul)
        for i in range(ref.config.num_layers):
            held, w_i = layer_param(loaded, name, i), type(w)(*(a[i] for a in w))
            want = for_matmul(w_i) if isinstance(w, Int4Weight) else w_i
            assert all(np.array_equal(np.asarray(a), b) for a, b in zip(held, want, strict=True))
            np.testing.assert_array_equal(dequantize(held), dequantize(w_i))
    # the embedding (and an untied head) as stored, whichever format the layers are asked in
    tables = GGUFModel(path).stored_tables()
    assert sorted(tables) == sorted(n for n in ("embed", "lm_head") if n in ref.params)
    for name, table in tables.items():
        assert isinstance(table, Int8Table if qtype == "Q8_0" else Int4Table)
        want = np.asarray(ref.params[name]) if name == "embed" else np.asarray(ref.params[name]).T
        np.testing.assert_allclose(dequantize_table(table)[: want.shape[0]], want, rtol=0, atol=1e-6)
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(loaded.params[name], table, strict=True))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_quantized_logits_stay_near_float32_and_greedy_agrees(model_file, kiln_cache, layer_loop, quantization):
    ref = load_model(model_file, show_progress=False, layer_loop=layer_loop)
    qm = load_model(model_file, show_progress=False, layer_loop=layer_loop, quantization=quantization)
    assert qm.quantization == quantization and isinstance(layer_param(qm, "q_proj", 1), WEIGHT[quantization])
    # the embedding and an untied head are int8 tables for either format (the head moves logits most)
    assert all(isinstance(qm.params[name], Int8Table) for name in ("embed", "lm_head") if name in ref.params)
    rng = np.random.default_rng(1)
    agree, worst = [], 0.0
    for ids in [rng.integers(0, 260, 24).tolist() for _ in range(8)]:
        want, got = logprobs(ref, ids), logprobs(qm, ids)
        worst = max(worst, float(np.abs(want - got).max()))
        same = want.argmax(-1) == got.argmax(-1)
        agree.append(same.mean())
        # a quantized model picks another token only where float32's top two are nearly tied
        top2 = np.sort(want, axis=-1)[:, -2:]
        assert np.all(top2[~same, 1] - top2[~same, 0] < 2 * LOGPROB_BOUND[quantization])
    assert worst < LOGPROB_BOUND[quantization], worst
    assert np.mean(agree) >= 0.85, agree  # these tiny random models' logits are nearly flat


def test_a_bfloat16_models_quantized_logits_stay_near_its_float32_ones(model_file, kiln_cache):
    """`[model] dtype = bfloat16` with int4 layers (its prefill multiplies in bfloat16, above): its
    logprobs stay near the float32 int4 model's, and so do its greedy picks (measured: 0.023 at most)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 260, 24).tolist() for _ in range(4)]
    models = [load_model(model_file, show_progress=False, quantization="int4", dtype=d)
              for d in ("float32", "bfloat16")]
    want, got = (np.stack([logprobs(model, ids) for ids in prompts]) for model in models)
    assert 0 < np.abs(got - want).max() < 0.1
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


def test_unknown_quantization_is_refused(model_file):
    with pytest.raises(ConfigError, match="model.quantization"):
        load_model(model_file, show_progress=False, quantization="int3")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_the_engine_serves_quantized_weights_as_the_reference_decodes_them(model_file, kiln_cache, quantization,
                                                                          cpu_kernels):
    """Served greedy tokens of the quantized model are its reference's, row for row in a batch, with
    the one-row decode steps' int4 products and attention in Kiln's CPU kernels (auto) or in XLA's
    path (off)."""
    q8 = load_model(model_file, show_progress=False, quantization=quantization)
    engine = AsyncEngine(q8, EngineConfig(num_kv_blocks=64, block_size=16, decode_row_buckets=(1, 4),
                                          prefill_token_buckets=(32, 64), max_num_seqs=4, max_num_batched_tokens=64,
                                          cpu_kernels=cpu_kernels))
    runner = engine._core.runner
    assert runner.cpu_kernels == (cpu_kernels == "auto" and cpu_kernel_build.enable())  # (a C++ compiler: CI has one)
    one_row = next(b for b in runner.buckets.forwards if b.kind == "decode" and b.rows == 1 and not b.lora)
    one_row_step = runner.lowered(*runner.forward_program(one_row)).as_text()
    assert ("kiln_int4_matmul" in one_row_step) == (runner.cpu_kernels and quantization == "int4")
    assert ("kiln_paged_attention" in one_row_step) == runner.cpu_kernels
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 260, int(n)).tolist() for n in rng.integers(5, 40, 4)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def one(i, ids):
        return [t async for d in engine.generate(f"q8-{i}", ids, greedy) for t in d.token_ids]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        served = asyncio.run(main())
    finally:
        engine.shutdown()
    assert served == [greedy_generate(q8.params, q8.config, [p], 8)[0] for p in prompts]


def test_quantized_weights_take_the_xla_route(model_file, tmp_path):
    from kiln.config import resolve_settings
    from kiln.engine.setup import select_backend_from_settings
    from kiln.errors import BackendUnavailable

    q8 = load_model(model_file, show_progress=False, quantization="int8")
    env = {"XDG_CACHE_HOME": str(tmp_path), "KILN_MODEL_QUANTIZATION": "int8"}
    with pytest.raises(BackendUnavailable, match="model.quantization = int8 runs on the xla route only"):
        select_backend_from_settings(resolve_settings(env={**env, "KILN_BACKEND_ROUTE": "iree-cpu"}), q8)
    assert select_backend_from_settings(resolve_settings(env=env), q8).name == "xla"


def test_q4_k_super_blocks_load_as_int4_groups(tmp_path, kiln_cache):
    """Q4_K (llama.cpp's k-quant: super-blocks of 8 groups of 32, 6-bit scales and mins under float16
    ones) is int4 groups exactly: the stored layers and embedding dequantize to what gguf's own
    dequantizer makes of the file, auto holds the file as int4, and its logits are the float ones."""
    import gguf

    hf = make_hf_model("llama", vocab_size=260, seed=7, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=1, tie_word_embeddings=True)
    path = write_gguf(hf, tmp_path / "k.gguf", quant=gguf.GGMLQuantizationType.Q4_K)
    reader = GGUFModel(path)
    assert reader.stored_quantization() == ("int4", "auto: the GGUF file's layers are Q4_K")
    ref = load_model(path, show_progress=False, layer_loop="scan")  # through gguf's dequantizer
    stored = reader.stored_layers("int4")
    assert sorted(stored) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    for name, w in stored.items():
        assert isinstance(w, Int4Weight)
        assert w.scale.dtype == np.float32  # a float16 times a 6-bit factor: not a float16 in general
        np.testing.assert_allclose(dequantize(w), np.asarray(ref.params["layers"][name]), rtol=0, atol=1e-6)
    table = reader.stored_tables()["embed"]
    assert isinstance(table, Int4Table)
    np.testing.assert_allclose(dequantize_table(table)[:260], np.asarray(ref.params["embed"]), rtol=0, atol=1e-6)
    auto = load_model(path, show_progress=False, quantization="auto")
    assert auto.quantization == "int4" and isinstance(auto.params["embed"], Int4Table)
    ids = np.random.default_rng(4).integers(0, 260, 24).tolist()
    np.testing.assert_allclose(logprobs(auto, ids), logprobs(ref, ids), rtol=0, atol=2e-4)


def test_a_q4_k_m_like_mix_holds_its_4_bit_projections_as_int4_and_the_rest_as_int8(tmp_path, kiln_cache):
    """As a Q4_K_M file keeps attn_v and some ffn_down layers in more bits: a projection all in Q8_0
    is int8 as stored, one that mixes Q8_0 and Q4_K layers is int8 from its float values, the rest
    int4 as stored; auto picks int4 for the mix, and the logits stay the file's."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = make_hf_model("llama", vocab_size=260, seed=7, hidden_size=256, intermediate_size=512,
                       tie_word_embeddings=True)
    path = write_gguf(hf, tmp_path / "km.gguf", quant=gguf.GGMLQuantizationType.Q4_K,
                      types={"blk.0.attn_v.weight": q8, "blk.1.attn_v.weight": q8, "blk.0.ffn_down.weight": q8})
    assert GGUFModel(path).stored_quantization() == (
        "int4", "auto: the GGUF file's layers are Q4_K, Q8_0; projections with more bits held as int8")
    ref = load_model(path, show_progress=False, layer_loop="scan")
    auto = load_model(path, show_progress=False, quantization="auto")
    kinds = {name: type(layer_param(auto, name, 0)).__name__ for name in WEIGHT_NAMES}
    assert kinds == {**dict.fromkeys(WEIGHT_NAMES, "Int4Weight"), "v_proj": "Int8Weight", "down_proj": "Int8Weight"}
    np.testing.assert_allclose(dequantize(auto.params["layers"]["v_proj"]), np.asarray(ref.params["layers"]["v_proj"]),
                               rtol=0, atol=1e-6)  # Q8_0 as stored
    ids = np.random.default_rng(5).integers(0, 260, 24).tolist()
    # down_proj's Q4_K layer requantized to int8 groups: within int8's rounding of float logits
    assert np.abs(logprobs(auto, ids) - logprobs(ref, ids)).max() < LOGPROB_BOUND["int8"]


@pytest.mark.parametrize(("qtype", "expected"), [(None, "none"), ("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4")])
def test_auto_holds_a_gguf_file_in_its_own_format(tmp_path, kiln_cache, qtype, expected):
    import gguf

    hf = make_hf_model("llama", vocab_size=260, seed=7)
    path = write_gguf(hf, tmp_path / "m.gguf", quant=gguf.GGMLQuantizationType[qtype] if qtype else None)
    model = load_model(path, show_progress=False, quantization="auto")
    stored = qtype or "F32"
    assert model.quantization == expected
    assert model.quantization_source == f"auto: the GGUF file's layers are {stored}" + (
        "" if qtype else ", held as float")
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    assert auto_quantization(hf_dir) == ("none", "auto: a float checkpoint")


def test_kiln_adds_its_xla_flag_and_keeps_the_users():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    add_process_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=4 {CPU_SCHEDULER_FLAG}=false"
    mine = {"XLA_FLAGS": f"{CPU_SCHEDULER_FLAG}=true"}
    add_process_flags(mine)
    assert mine["XLA_FLAGS"] == f"{CPU_SCHEDULER_FLAG}=true"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU schedule")
def test_each_dequantization_runs_next_to_its_multiply():
    """Under XLA:CPU's concurrency scheduler, every layer's dequantized weights were computed at the
    start of the step (one float32 copy of the model, out of cache by the time it was used); the flag
    kiln.xla_flags sets keeps each one just before its multiply."""
    rng = np.random.default_rng(0)
    layers = [jax.tree.map(jax.numpy.asarray, quantize_int4(rng.standard_normal((64, 64)).astype(np.float32)))
              for _ in range(3)]

    def two_layers(x, layers):
        for w in layers:
            x = x + quant_matmul(x, w)
        return x

    text = jax.jit(two_layers).lower(np.ones((1, 64), np.float32), layers).compile().as_text()
    entry = text[text.index("ENTRY"):].splitlines()
    # a dequantization is a fusion that writes a float32 [32, 64] half (even or odd input rows)
    order = ["dot" if " dot(" in line else "weights" for line in entry
             if " dot(" in line or ("= f32[32,64]" in line and "fusion(" in line)]
    assert order.count("weights") == 6 and order.count("dot") == 6
    assert order == ["weights", "dot"] * 6, order


def test_a_gguf_files_stored_layers_are_read_once_then_kept_beside_its_conversion(tmp_path, kiln_cache):
    """Parsing a GGUF file's metadata takes seconds for a real tokenizer; the first load records the
    file's own format and its stored layers in the converted directory, and later loads read those."""
    import gguf

    path = write_gguf(make_hf_model("llama", vocab_size=260, seed=7), tmp_path / "m.gguf",
                      quant=gguf.GGMLQuantizationType.Q4_1)
    first = load_model(path, show_progress=False, quantization="auto")
    converted = kiln_cache / "converted" / file_digest(path)[:32]
    record = converted.with_name(f"{converted.name}.{STORED_FORMAT}")  # beside the conversion
    assert record.is_file()
    assert {p.name for p in converted.glob("kiln_stored*")} == {f"kiln_stored_int4.{STORED_VERSION}.npz"}
    with np.load(converted / f"kiln_stored_int4.{STORED_VERSION}.npz") as kept:  # kept fused, in for_matmul's layout
        assert not any(key.startswith(("q_proj.", "gate_proj.", "up_proj.")) for key in kept.files)
        for name, along_out in (("gate_up_proj", True), ("qkv_proj", True), ("down_proj", False)):
            packed, scale = kept[f"{name}.Int4Weight.packed"], kept[f"{name}.Int4Weight.scale"]
            assert (packed.shape[-1] != scale.shape[-1]) == along_out
    again = load_model(path, show_progress=False, quantization="auto")
    assert (again.quantization, again.quantization_source) == (first.quantization, first.quantization_source)
    for name in ("q_proj", "down_proj"):
        assert isinstance(layer_param(again, name, 0), Int4Weight)
    for a, b in zip(jax.tree.leaves(first.params["layers"]), jax.tree.leaves(again.params["layers"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(again.params["embed"], Int4Table)  # the file's Q4_1 embedding, kept too
    for a, b in zip(first.params["embed"], again.params["embed"], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the recorded answer is what auto reports from then on
    record.write_text('["int4", "auto: recorded"]')
    assert load_model(path, show_progress=False, quantization="auto").quantization_source == "auto: recorded"
    assert auto_quantization(path) == ("int4", "auto: recorded")


def test_a_gguf_files_format_asked_before_any_load_is_recorded_and_the_load_still_converts(tmp_path, kiln_cache):
    """`kiln config` asks auto's answer of a file no load has converted yet: it records it beside the
    (not yet made) conversion, and a later load converts the file as usual."""
    import gguf

    path = write_gguf(make_hf_model("llama", vocab_size=260, seed=8), tmp_path / "m.gguf",
                      quant=gguf.GGMLQuantizationType.Q4_1)
    converted = kiln_cache / "converted" / file_digest(path)[:32]
    assert auto_quantization(path)[0] == "int4"
    assert converted.with_name(f"{converted.name}.{STORED_FORMAT}").is_file() and not converted.exists()
    loaded = load_model(path, show_progress=False, quantization="auto")
    assert (converted / "kiln_source.json").is_file()
    assert (loaded.quantization, loaded.quantization_source) == auto_quantization(path)
