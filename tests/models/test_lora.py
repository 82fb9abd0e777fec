"""Per-row LoRA slots equal the explicit merged weights W + scale * A @ B."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_forward
from tiny_models import make_hf_model, save_hf_model

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.hf_loader import load_hf_dir
from kiln.models.lora import empty_lora_state, module_shapes, set_slot

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("lora"))
    cfg, params, _ = load_hf_dir(path, np.float32, show_progress=False)
    return cfg, params


def random_adapter(cfg, rank, modules, seed):
    rng = np.random.RandomState(seed)
    shapes = module_shapes(cfg)
    return {
        m: {
            "a": (0.3 * rng.randn(cfg.num_layers, shapes[m][0], rank)).astype(np.float32),
            "b": (0.3 * rng.randn(cfg.num_layers, rank, shapes[m][1])).astype(np.float32),
        }
        for m in modules
    }


def merged(params, adapter, scale):
    layers = dict(params["layers"])
    for m, w in adapter.items():
        layers[m] = np.asarray(layers[m]) + scale * np.einsum("lir,lro->lio", w["a"], w["b"])
    return {**params, "layers": layers}


def run(cfg, params, rows, lora=None):
    kv = init_kv_cache(cfg, num_blocks=8, block_size=BLOCK)
    logits, _ = jit_forward(params, kv, build_step_inputs(rows, BLOCK), cfg, lora)
    return np.asarray(logits)


def test_rows_with_different_adapters_equal_merged_weights(model):
    cfg, params = model
    adapters = {
        1: (random_adapter(cfg, 4, list(module_shapes(cfg)), seed=1), 2.0),  # rank below the slot rank
        2: (random_adapter(cfg, 8, ("q_proj", "v_proj", "down_proj"), seed=2), 0.5),
    }
    state = empty_lora_state(cfg, n_slots=3, rank=8)
    for slot, (adapter, scale) in adapters.items():
        state = set_slot(state, slot, adapter, scale)
    rng = np.random.RandomState(0)
    seqs = [list(rng.randint(3, cfg.vocab_size, size=n)) for n in (11, 7, 9)]
    rows = [RowWork(seqs[0], 0, [1], 0), RowWork(seqs[1], 0, [3], 1), RowWork(seqs[2], 0, [5], 2)]
    batched = run(cfg, params, rows, state)
    base = run(cfg, params, [RowWork(seqs[0], 0, [1])])
    np.testing.assert_allclose(batched[:11], base, atol=1e-4, rtol=0)
    for i, slot in ((1, 1), (2, 2)):
        adapter, scale = adapters[slot]
        expected = run(cfg, merged(params, adapter, scale), [RowWork(seqs[i], 0, [1])])
        start = sum(len(s) for s in seqs[:i])
        got = batched[start : start + len(seqs[i])]
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        assert np.abs(expected - run(cfg, params, [RowWork(seqs[i], 0, [1])])).max() > 1e-2  # the adapter matters


def test_slot_rules(model):
    cfg, _ = model
    state = empty_lora_state(cfg, n_slots=2, rank=4, modules=("q_proj",))
    with pytest.raises(ValueError, match="outside 1..2"):
        set_slot(state, 0, random_adapter(cfg, 4, ("q_proj",), 0), 1.0)
    with pytest.raises(ValueError, match="outside 1..2"):
        set_slot(state, 3, random_adapter(cfg, 4, ("q_proj",), 0), 1.0)
    with pytest.raises(ValueError, match="rank 8 exceeds"):
        set_slot(state, 1, random_adapter(cfg, 8, ("q_proj",), 0), 1.0)
    with pytest.raises(ValueError, match="without slots"):
        set_slot(state, 1, random_adapter(cfg, 4, ("v_proj",), 0), 1.0)
    assert float(jnp.abs(state["layers"]["q_proj"]["a"]).sum()) == 0.0
    state = set_slot(state, 2, random_adapter(cfg, 4, ("q_proj",), 0), 1.5)
    assert float(jnp.abs(state["layers"]["q_proj"]["a"][:, 0]).sum()) == 0.0  # slot 1 untouched
    assert float(state["scale"][1]) == 1.5
