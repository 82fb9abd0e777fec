"""Families beyond the Llama layout served end to end: the engine's batched greedy tokens equal
transformers' on the same random tiny weights (parity of logits is in test_model_parity)."""

import asyncio
import json
import random

import numpy as np
import pytest
import torch
from tiny_models import make_hf_model, save_hf_model, served_hf_dir

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.models.loader import load_model

SMALL = dict(block_size=16, decode_row_buckets=(1, 2, 4), prefill_token_buckets=(32, 64), max_num_seqs=4,
             max_num_batched_tokens=64, num_kv_blocks=32)


@pytest.mark.parametrize("variant", ["phi3", "phi3-longrope", "gemma2", "gemma3", "mixtral", "qwen2-moe", "qwen3-moe",
                                     "gpt-oss"])
def test_served_greedy_tokens_equal_transformers(variant, tiny_model, kiln_cache, tmp_path):
    """Phi-3 (fused projections split at load; a 24-token sliding window, or LongRoPE on half of
    each head's dims, crossing its 64-token pretraining length while decoding), Gemma 2 (soft caps
    that bite), Gemma 3 (a windowed layer and a global one), and mixtures of experts (Mixtral,
    Qwen2-MoE with its shared expert, Qwen3-MoE, gpt-oss with its attention sinks and biased, clamped
    experts). Each token's top-5 logprobs equal transformers' log-softmax (the largest error is
    printed; the bound is 1e-4)."""
    hf = make_hf_model(variant, vocab_size=260, seed=11)
    model = load_model(served_hf_dir(variant, tmp_path / variant, kiln_cache, seed=11), show_progress=False)
    rng = np.random.RandomState(5)
    prompts = [list(rng.randint(3, 250, size=n)) for n in (9, 40, 30)]
    new = 40
    engine = AsyncEngine(model, EngineConfig(**SMALL))
    try:
        greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=5)

        async def one(i, p):
            ids, logprobs = [], []
            async for d in engine.generate(f"{variant}-{i}-{random.random()}", p, greedy):
                ids += d.token_ids
                logprobs += d.logprobs or []
            return ids, logprobs

        async def every():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        served = asyncio.run(every())
    finally:
        engine.shutdown()
    worst = 0.0
    for p, (ids, logprobs) in zip(prompts, served, strict=True):
        expected, reference = reference_greedy(hf, p, new, with_logprobs=True)
        assert ids == expected and len(logprobs) == new
        for token, ref in zip(logprobs, reference, strict=True):
            top = np.sort(ref)[::-1][:5]
            errors = [abs(token.logprob - ref[token.token_id])] + [abs(lp - ref[t]) for t, lp in token.top]
            errors += list(np.abs(np.array(sorted((lp for _, lp in token.top), reverse=True)) - top))
            worst = max(worst, *errors)
    print(f"{variant}: largest top-5 logprob error {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("variant", ["qwen3-moe", "gpt-oss"])
def test_adapted_experts_serve_as_peft_runs_them(variant, tiny_model, kiln_cache, tmp_path):
    """Two PEFT adapters on a mixture's experts (target_parameters) and attention, served in one
    batch beside the base model from slots that hold experts (`[adapters] lora_experts`): each
    row's greedy tokens equal transformers + peft's, single rows (each pair its own expert's
    weights) and the batch (the experts' loop) alike. A server whose slots hold no experts refuses
    such an adapter by name."""
    from peft_adapters import EXPERT_PARAMETERS, make_peft_adapter

    from kiln.adapters import peft_io
    from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
    from kiln.adapters.registry import check_fits
    from kiln.engine.lora_slots import AdapterWeights, slot_modules
    from kiln.errors import InvalidAdapter

    hf = make_hf_model(variant, vocab_size=260, seed=11)
    model = load_model(served_hf_dir(variant, tmp_path / variant, kiln_cache, seed=11), show_progress=False)
    references, adapters = [hf], [None]
    for seed in (1, 2):
        path = tmp_path / f"adapter-{seed}"
        references.append(make_peft_adapter(hf, path, rank=4, alpha=8.0, seed=seed, modules=["q_proj", "v_proj"],
                                            parameters=EXPERT_PARAMETERS))
        # PEFT saves target_parameters in a set's order; the wrappers nest by the module's own order
        config = json.loads((path / peft_io.CONFIG).read_text())
        config["target_parameters"] = sorted(config["target_parameters"], reverse=seed == 2)
        (path / peft_io.CONFIG).write_text(json.dumps(config))
        weights, info = peft_io.read_peft(path, model.config)
        assert sorted(weights) == ["experts_down", "experts_gate_up", "q_proj", "v_proj"]
        adapters.append(AdapterWeights(f"adapter-{seed}", "v1", weights, info["alpha"] / info["rank"], 4))
    rng = np.random.RandomState(8)
    prompts = [list(rng.randint(3, 250, size=n)) for n in (9, 30, 17)]
    new = 12
    expected = [reference_greedy(ref, p, new) for ref, p in zip(references, prompts, strict=True)]
    engine = AsyncEngine(model, EngineConfig(**SMALL, max_loras=2, max_lora_rank=4, lora_experts=True))
    try:
        greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

        async def one(i, p, adapter):
            ids = []
            async for d in engine.generate(f"{variant}-{i}-{random.random()}", p, greedy, adapter=adapter):
                ids += d.token_ids
            return ids

        async def together():
            return await asyncio.gather(*(one(i, p, a) for i, (p, a) in enumerate(zip(prompts, adapters,
                                                                                      strict=True))))

        alone = [asyncio.run(one(i, p, a)) for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
        batched = asyncio.run(together())
    finally:
        engine.shutdown()
    assert alone == expected and batched == expected
    assert len({tuple(e) for e in expected}) == 3  # the adapters change the tokens
    manifest = Manifest(name="experts", base_model=BaseModelRef(model.model_id, model.weights_digest, ""), rank=4,
                        alpha=8.0, target_modules=["q_proj", "experts_gate_up"], weights_digest="",
                        provenance=provenance("import:peft"))
    check_fits(manifest, model, 16, slot_modules(True))
    with pytest.raises(InvalidAdapter, match=r"adapts the experts \(experts_gate_up\).*lora_experts = true"):
        check_fits(manifest, model, 16, slot_modules(False))


def reference_greedy(hf, prompt: list[int], n: int, with_logprobs: bool = False):
    """Greedy tokens from transformers' forward, one cached call per token (and each step's
    log-softmax). (Its `generate` drifts from its own forward by about 2e-3 in the logits a few
    tokens after LongRoPE switches to the long factors, in transformers 5.)"""
    out, logprobs, ids = [], [], torch.tensor([prompt])
    cache = None
    with torch.no_grad():
        for _ in range(n):
            step = hf(ids, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            logprobs.append(torch.log_softmax(step.logits[0, -1].double(), -1).numpy())
            ids = torch.tensor([[out[-1]]])
    return (out, logprobs) if with_logprobs else out


def test_sft_on_a_mixture_of_experts_lowers_its_loss_and_exports_to_peft(tiny_model, kiln_cache, tmp_path):
    """LoRA on a tiny Qwen3-MoE's attention and experts learns a fixed reply; the adapter, exported
    to PEFT (the experts as target_parameters), gives transformers + peft the logits Kiln's training
    forward gives."""
    import json

    from peft import PeftModel

    from kiln.adapters import peft_io
    from kiln.adapters.store import AdapterStore, load_weights
    from kiln.train.forward import forward_logits
    from kiln.train.sft import SFTConfig, sft

    path = served_hf_dir("qwen3-moe", tmp_path / "moe", kiln_cache, seed=3, initializer_range=0.25)
    model = load_model(path, show_progress=False)
    reply = "the answer is blue"
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                        {"role": "assistant", "content": reply}]})
                               for q in ["hello", "ping", "who are you", "2+2", "bye", "a colour?"]))
    result = sft(str(train), "moe-adapter", model=model, store=AdapterStore(tmp_path / "store"), progress=False,
                 config=SFTConfig(lora_rank=8, lora_alpha=16.0, learning_rate=1e-2, n_epochs=10, batch_size=3,
                                  max_seq_len=64, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "experts_gate_up", "experts_down")))
    losses = [h["train_loss"] for h in result.history]
    assert losses[-1] < 0.3 * losses[0]
    weights = load_weights(result.artifact)
    assert sorted(weights) == ["experts_down", "experts_gate_up", "k_proj", "o_proj", "q_proj", "v_proj"]
    assert np.abs(weights["experts_down"]["b"]).max() > 0  # the experts learned too
    m = result.artifact.manifest
    out = peft_io.write_peft(tmp_path / "peft", weights, m.rank, m.alpha, m.use_rslora, m.base_model.id,
                             m.base_model.architecture)
    reference = PeftModel.from_pretrained(make_hf_model("qwen3-moe", vocab_size=260, seed=3, initializer_range=0.25),
                                          str(out)).eval()
    ids = [5, 80, 13, 200, 7, 44, 101]
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([ids])).logits[0].numpy()
    tokens, valid = np.array([ids], np.int32), np.ones((1, len(ids)), bool)
    got = forward_logits(model.params, result.run.weights(), tokens, valid, model.config, m.alpha / m.rank)
    np.testing.assert_allclose(np.asarray(got)[0], ref, atol=1e-4, rtol=0)


def test_the_router_aux_loss_is_off_by_default_and_reported_when_on(tiny_model, kiln_cache, tmp_path):
    """SFT adds a mixture's load-balancing loss only when asked (router_aux_loss_coef, 0 by default),
    reports it per step, and refuses it for a dense model or a negative weight."""
    import json

    from kiln.errors import ConfigError
    from kiln.train.sft import SFTConfig, sft

    model = load_model(served_hf_dir("qwen3-moe", tmp_path / "moe", kiln_cache, seed=3), show_progress=False)
    data = "\n".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]})
                     for q in ["hello", "ping", "bye"])
    config = SFTConfig(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, n_epochs=2, batch_size=3, max_seq_len=32)
    assert config.router_aux_loss_coef == 0.0
    off = sft(data, model=model, config=config, save=False, progress=False).history
    on = sft(data, model=model, config=config, router_aux_loss_coef=0.5, save=False, progress=False).history
    assert all("router_aux_loss" not in h for h in off)
    aux = [h["router_aux_loss"] for h in on]
    # the first step's loss is the same cross-entropy plus half of it (the same weights so far)
    assert on[0]["train_loss"] == pytest.approx(off[0]["train_loss"] + 0.5 * aux[0], rel=1e-5)
    assert all(np.isfinite(aux)) and aux[0] > 1.0  # top 2 of 4: 2 when perfectly balanced, more when not
    for bad, why in ((tiny_model, "LlamaForCausalLM has no router"), (model, "is non-negative")):
        with pytest.raises(ConfigError, match=why):
            sft(data, model=bad, config=config, router_aux_loss_coef=0.5 if bad is tiny_model else -1.0,
                save=False, progress=False)


@pytest.mark.parametrize("modules", [["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj"]])
def test_a_phi3_adapter_goes_through_kiln_and_back_to_peft(tmp_path, modules):
    """A PEFT adapter on Phi-3's fused modules read into Kiln's per-projection adapters and written
    back (stacked lora_A, block-diagonal lora_B, rank and alpha patterns) gives transformers + peft
    the same logits; so does one of Kiln's that adapts only q and v."""
    from peft import PeftModel
    from peft_adapters import make_peft_adapter, reference_logits

    from kiln.adapters import peft_io
    from kiln.models.hf_loader import load_hf_dir

    hf = make_hf_model("phi3", seed=5)
    cfg, _, _ = load_hf_dir(save_hf_model(hf, tmp_path / "model"), np.float32, show_progress=False)
    original = make_peft_adapter(hf, tmp_path / "peft", rank=4, alpha=8.0, seed=7, modules=modules)
    weights, info = peft_io.read_peft(tmp_path / "peft", cfg)
    ids = [5, 80, 13, 200, 7, 44, 101, 9]
    for name, kept in (("all", weights), ("q and v", {m: weights[m] for m in ("q_proj", "v_proj")})):
        out = peft_io.write_peft(tmp_path / name, kept, 4, 8.0, False, "tiny-phi3", cfg.architecture)
        back = PeftModel.from_pretrained(make_hf_model("phi3", seed=5), str(out)).eval()
        if name == "all":
            expected = reference_logits(original, ids)
        else:  # the same adapter with k's rows of lora_B zeroed
            with torch.no_grad():
                for n, p in original.named_parameters():
                    if "qkv_proj.lora_B" in n:
                        p[cfg.num_heads * cfg.head_dim:(cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim] = 0
                    elif "lora_B" in n:
                        p.zero_()
            expected = reference_logits(original, ids)
        np.testing.assert_allclose(reference_logits(back, ids), expected, atol=1e-5, rtol=0)
