"""Weight-only int8 quantization: the round trip's bound, the logits' distance from float32, greedy
agreement, and the quantized weights' layouts (stacked under scan, one dict per layer)."""

import asyncio

import jax
import numpy as np
import pytest
from conftest import jit_forward
from tiny_models import make_hf_model, write_gguf

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.errors import ConfigError
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.generate import greedy_generate
from kiln.models.loader import layer_param, load_model
from kiln.models.quant import Int8Weight, dequantize, quantize_int8

# a logprob of the int8 model stays this close to float32's (measured at most 0.007 on these tiny models)
LOGPROB_BOUND = 0.05


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


def test_int8_round_trip_is_within_half_a_step_per_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 40, 24)).astype(np.float32) * rng.random(24).astype(np.float32)
    w[..., 5] = 0.0  # an all-zero channel stays exactly zero
    q = quantize_int8(w)
    assert q.q.dtype == np.int8 and q.scale.shape == (3, 24) and np.abs(q.q).max() <= 127
    err = np.abs(dequantize(q) - w)
    assert np.all(err <= q.scale[:, None, :] / 2 + 1e-7)
    assert np.all(dequantize(q)[..., 5] == 0.0)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_int8_logits_stay_near_float32_and_greedy_agrees(model_file, kiln_cache, layer_loop):
    ref = load_model(model_file, show_progress=False, layer_loop=layer_loop)
    q8 = load_model(model_file, show_progress=False, layer_loop=layer_loop, quantization="int8")
    assert q8.quantization == "int8" and isinstance(layer_param(q8.params, "q_proj", 1), Int8Weight)
    assert not isinstance(q8.params.get("lm_head"), Int8Weight)  # the head keeps the model's dtype
    rng = np.random.default_rng(1)
    agree, worst = 0, 0.0
    prompts = [rng.integers(0, 260, 24).tolist() for _ in range(8)]
    for ids in prompts:
        want, got = logprobs(ref, ids), logprobs(q8, ids)
        worst = max(worst, float(np.abs(want - got).max()))
        agree += int(np.mean(want.argmax(-1) == got.argmax(-1)) >= 0.9)
    assert worst < LOGPROB_BOUND, worst
    assert agree >= 7, agree


def test_unknown_quantization_is_refused(model_file):
    with pytest.raises(ConfigError, match="model.quantization"):
        load_model(model_file, show_progress=False, quantization="int3")


def test_the_engine_serves_int8_weights_as_the_reference_decodes_them(model_file, kiln_cache):
    """Served greedy tokens of the int8 model are the int8 reference's, row for row in a batch."""
    q8 = load_model(model_file, show_progress=False, quantization="int8")
    engine = AsyncEngine(q8, EngineConfig(num_kv_blocks=64, block_size=16, decode_row_buckets=(1, 4),
                                          prefill_token_buckets=(32, 64), max_num_seqs=4, max_num_batched_tokens=64))
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
