"""Logits parity with transformers (torch CPU) on random tiny models of every architecture."""

import numpy as np
import pytest
import torch
from conftest import jit_forward
from tiny_models import VARIANTS, make_hf_model, save_hf_model

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.hf_loader import load_hf_dir

TOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    model = make_hf_model(request.param)
    path = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    cfg, params, _ = load_hf_dir(path, np.float32, show_progress=False)
    return request.param, model, cfg, params


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()


def test_config_reads_architecture_features(tiny):
    variant, _, cfg, _ = tiny
    scaled = ("llama-linear", "llama3-rope", "llama-yarn", "phi3-longrope", "gemma3", "gpt-oss")
    assert (cfg.rope_scaling is not None) == (variant in scaled)
    assert cfg.sliding_window == (24 if variant in ("phi3", "gemma2", "gemma3", "gpt-oss") else None)
    assert cfg.sliding_layers == ((True, False) if variant in ("gemma2", "gemma3", "gpt-oss") else None)
    assert cfg.attention_sinks == cfg.expert_bias == (variant == "gpt-oss")
    assert cfg.final_logit_softcapping == (2.0 if variant == "gemma2" else None)
    assert cfg.rotary_dim == (cfg.head_dim // 2 if variant == "phi3-longrope" else cfg.head_dim)
    assert cfg.attention_bias == (variant in ("llama-bias", "qwen2", "qwen2-moe", "gpt-oss"))
    assert cfg.o_bias == (variant in ("llama-bias", "gpt-oss"))
    assert cfg.qk_norm == (variant in ("qwen3", "gemma3", "qwen3-moe"))
    assert cfg.num_experts == (4 if variant in ("mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss") else 0)
    assert cfg.shared_expert_intermediate_size == (96 if variant == "qwen2-moe" else 0)
    assert cfg.tie_word_embeddings == (variant in ("llama-tied", "gemma2", "gemma3"))
    if variant in ("qwen3", "qwen3-moe"):
        assert cfg.head_dim * cfg.num_heads != cfg.hidden_size


def test_full_prefill_with_scattered_blocks(tiny):
    _, model, cfg, params = tiny
    ids = np.random.RandomState(1).randint(3, cfg.vocab_size, size=45)  # past llama3's original 32
    kv = init_kv_cache(cfg, num_blocks=9, block_size=BLOCK)
    inputs = build_step_inputs([RowWork(list(ids), 0, [6, 1, 4])], BLOCK)
    logits, _ = jit_forward(params, kv, inputs, cfg)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model, ids), atol=TOL, rtol=0)


def test_token_by_token_decode_through_paged_cache(tiny):
    _, model, cfg, params = tiny
    ids = np.random.RandomState(2).randint(3, cfg.vocab_size, size=38)
    ref = hf_logits(model, ids)
    table = [7, 2, 5]  # non-contiguous, out of order
    kv = init_kv_cache(cfg, num_blocks=8, block_size=BLOCK)
    # a 5-token prefill chunk, then one token per step; every step pads to one shape bucket
    logits, kv = jit_forward(params, kv, build_step_inputs([RowWork(list(ids[:5]), 0, table)], BLOCK), cfg)
    np.testing.assert_allclose(np.asarray(logits), ref[:5], atol=TOL, rtol=0)
    for pos in range(5, len(ids)):
        step = build_step_inputs([RowWork([int(ids[pos])], pos, table)], BLOCK, num_tokens=4, num_tiles=2, tile_size=1)
        logits, kv = jit_forward(params, kv, step, cfg)
        np.testing.assert_allclose(np.asarray(logits)[0], ref[pos], atol=TOL, rtol=0, err_msg=f"position {pos}")


def test_mixed_batch_of_decode_rows_and_prefill_chunks(tiny):
    """Decode rows and chunked-prefill rows of different lengths share one padded step."""
    _, model, cfg, params = tiny
    rng = np.random.RandomState(3)
    seqs = [rng.randint(3, cfg.vocab_size, size=n) for n in (30, 21, 12)]
    refs = [hf_logits(model, s) for s in seqs]
    tables = [[3, 9], [1, 6], [11]]  # block 0 is the padding target, never a row's
    kv = init_kv_cache(cfg, num_blocks=12, block_size=BLOCK)
    # step 1: row 0 prefills 20 tokens, row 1 prefills its first chunk of 16
    step1 = [RowWork(list(seqs[0][:20]), 0, tables[0]), RowWork(list(seqs[1][:16]), 0, tables[1])]
    logits, kv = jit_forward(params, kv, build_step_inputs(step1, BLOCK), cfg)
    # step 2: row 0 decodes one token, row 1 prefills its second chunk, row 2 prefills whole
    step2 = [
        RowWork([int(seqs[0][20])], 20, tables[0]),
        RowWork(list(seqs[1][16:]), 16, tables[1]),
        RowWork(list(seqs[2]), 0, tables[2]),
    ]
    inputs = build_step_inputs(step2, BLOCK, num_tokens=32, num_tiles=6, tile_size=8)
    logits, kv = jit_forward(params, kv, inputs, cfg)
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[0], refs[0][20], atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1:6], refs[1][16:21], atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[6:18], refs[2], atol=TOL, rtol=0)


def test_longrope_decodes_past_the_pretraining_length_with_the_long_factors(tmp_path):
    """Decoding past original_max_position_embeddings (64), every new token rotates with LongRoPE's
    long factors and the cached keys keep the short ones, as transformers' cached generation does."""
    import dataclasses

    model = make_hf_model("phi3-longrope")
    cfg, params, _ = load_hf_dir(save_hf_model(model, tmp_path), np.float32, show_progress=False)
    ids = np.random.RandomState(4).randint(3, cfg.vocab_size, size=80)
    with torch.no_grad():
        out = model(torch.tensor(ids[None, :50]), use_cache=True)
        ref, cache = [out.logits[0].numpy()], out.past_key_values
        for pos in range(50, len(ids)):
            out = model(torch.tensor([[int(ids[pos])]]), past_key_values=cache, use_cache=True)
            ref.append(out.logits[0].numpy())
            cache = out.past_key_values
    ref = np.concatenate(ref)
    short_only = dict(cfg.rope_scaling_dict, long_factor=cfg.rope_scaling_dict["short_factor"])
    short_cfg = dataclasses.replace(cfg, rope_scaling=tuple(sorted(short_only.items())))
    for config, same in ((cfg, True), (short_cfg, False)):
        table = [5, 1, 3, 2, 4, 6]
        kv = init_kv_cache(config, num_blocks=8, block_size=BLOCK)
        logits, kv = jit_forward(params, kv, build_step_inputs([RowWork(list(ids[:50]), 0, table)], BLOCK), config)
        got = [np.asarray(logits)]
        for pos in range(50, len(ids)):
            step = build_step_inputs([RowWork([int(ids[pos])], pos, table)], BLOCK, num_tokens=4, num_tiles=2,
                                     tile_size=1)
            logits, kv = jit_forward(params, kv, step, config)
            got.append(np.asarray(logits)[:1])
        got = np.concatenate(got)
        np.testing.assert_allclose(got[:64], ref[:64], atol=TOL, rtol=0)  # before 64: the short factors
        assert np.allclose(got[64:], ref[64:], atol=TOL, rtol=0) == same  # from 64 on: the long ones matter


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss"])
def test_routing_equals_transformers_token_by_token(variant, tmp_path):
    """Kiln's router picks each token's experts with transformers' weights, on the first layer's MLP
    inputs of a fixed batch and on inputs every token of which prefers one expert; the layer's output
    equals transformers' either way: no capacity, no token dropped however unevenly they route. One
    token alone takes the per-pair path (fewer pairs than experts) of serving on the CPU."""
    import jax

    from kiln.models.decoder import experts_mlp, route

    hf = make_hf_model(variant, seed=5)
    cfg, params, _ = load_hf_dir(save_hf_model(hf, tmp_path / variant), np.float32, show_progress=False)
    layer = jax.tree.map(lambda a: a[0], params["layers"])
    block = hf.model.layers[0].mlp
    router = block.router if variant == "gpt-oss" else block.gate  # gpt-oss: biased, softmax over the top k
    seen = []
    handle = block.register_forward_hook(lambda module, args, out: seen.append(args[0][0].detach()))
    hf_logits(hf, np.random.RandomState(3).randint(3, cfg.vocab_size, size=40))
    handle.remove()
    rng = np.random.RandomState(4)
    favourite = router.weight[2].detach().numpy()  # inputs along expert 2's router row
    lopsided = torch.tensor(favourite / np.linalg.norm(favourite) ** 2 * 6 + rng.normal(0, 0.05, (40, cfg.hidden_size)),
                            dtype=torch.float32)
    picks = {}
    # one token: fewer (token, expert) pairs than experts
    for case, x in {"batch": seen[0], "lopsided": lopsided, "one token": seen[0][:1]}.items():
        with torch.no_grad():
            _, ref_weights, ref_experts = router(x)
            ref_out = block(x[None])
            ref_out = (ref_out[0] if isinstance(ref_out, tuple) else ref_out)[0].numpy()
        weights, experts = route(jax.numpy.asarray(x.numpy()), layer, cfg)
        np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
        np.testing.assert_allclose(np.asarray(weights), ref_weights.numpy(), atol=1e-6, rtol=0)
        for loops in (False, True):  # ragged_dot (training, accelerators), and loops (serving on the CPU)
            np.testing.assert_allclose(np.asarray(experts_mlp(jax.numpy.asarray(x.numpy()), layer, cfg, loops)),
                                       ref_out, atol=1e-5, rtol=0)
        picks[case] = ref_experts
    assert (picks["lopsided"][:, 0] == 2).all()  # every token's first pick is expert 2
