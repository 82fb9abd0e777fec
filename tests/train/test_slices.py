"""Training steps in bounded slices: gradients equal to the fused step's (SFT and the GRPO loss, on
list and stacked layers), a stopped step that applies nothing, and slices that take turns with
a running engine's serving steps."""

import functools
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.engine.ownership import Ownership
from kiln.models.loader import load_model
from kiln.train import losses
from kiln.train.data import length_buckets, load_examples, make_batch
from kiln.train.forward import init_lora
from kiln.train.grpo import GRPOConfig, Rollout, make_policy_steps, rollout_batches
from kiln.train.optim import adamw
from kiln.train.sft import SFTConfig, SFTRun, head_loss, trained_logits
from kiln.train.slices import SlicedStep, SlicePlan, StepAbandoned, Turns

PLANS = [SlicePlan(1, 4), SlicePlan(2, 16), SlicePlan(1, 7)]  # per layer; whole; a chunk that pads
RTOL = {"float32": 1e-4, "bfloat16": 3e-4}  # see assert_trees_close
LLAMA = ("unrolled", "scan")


def plans_for(request) -> list[SlicePlan]:
    """How a plan cuts the step is the same code in every family: the tiny llama (list and stacked
    layers) takes every plan, the other variants one cut per layer with a chunk that pads."""
    return PLANS if request.node.callspec.params["model"] in LLAMA else PLANS[2:]


def examples(tokenizer, n=6):
    data = "\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} " * (i + 1)},
                                              {"role": "assistant", "content": f"answer {i} " * (2 + i)}]})
                     for i in range(n))
    return load_examples(data, tokenizer, 256)


def nudged(lora, seed=2):
    """LoRA params with B != 0, so that every gradient is non-zero."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), lora)


def assert_trees_close(a, b, rtol=1e-4):
    """Within rtol of b's largest value; a bfloat16 model's sliced products are summed in another
    order than the whole step's, and bfloat16's rounding of them moves a few gradients by ~1e-4."""
    scale = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
    assert scale > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=rtol * scale)


def no_turns(what):
    import contextlib

    return contextlib.nullcontext()


@pytest.fixture(scope="module", params=["unrolled", "scan", "int4", "gemma3", "qwen3-moe", "gpt-oss"])
def model(request, tiny_model, kiln_cache, tmp_path_factory):
    """The tiny llama with its layers as a list and stacked (scanned), and in int4 and bfloat16 (q/k/v
    and gate/up held fused; head chunks of fewer rows than serving multiplies in bfloat16); a tiny
    Gemma 3 (windowed and global layers, sandwich norms), a tiny Qwen3-MoE and a tiny gpt-oss (sinks,
    biases)."""
    if request.param == "int4":
        return load_model(tiny_model.source, show_progress=False, quantization="int4", dtype="bfloat16")
    if request.param in ("gemma3", "qwen3-moe", "gpt-oss"):
        from tiny_models import served_hf_dir

        path = served_hf_dir(request.param, tmp_path_factory.mktemp(request.param), kiln_cache, seed=3)
        return load_model(path, show_progress=False, layer_loop="scan")
    return load_model(tiny_model.source, show_progress=False, layer_loop=request.param)


def test_sliced_sft_gradients_equal_the_fused_step(model, request):
    cfg = model.config
    batch = make_batch(examples(model.tokenizer), 6, length_buckets(256))
    lora = nudged(init_lora(cfg, 4, seed=1))

    def loss(lora):  # SFT's loss as the fused step computes it
        out = trained_logits(model.params, lora, batch, cfg, 2.0)
        return losses.cross_entropy(out, batch.loss_targets, batch.loss_mask)

    reference, expected = jax.jit(jax.value_and_grad(loss))(lora)
    norm = 1.0 / float(batch.loss_mask.sum())
    # products replayed over the variant's plans, or multiplied again over two layers a slice (how a
    # plan cuts the step does not depend on the replay)
    for remat, plans in ((False, plans_for(request)), (True, PLANS[1:2])):
        sliced = SlicedStep(cfg, 2.0, functools.partial(head_loss, cfg=cfg), max_slice_ms=100, remat=remat)
        for plan in plans:
            grads, value, aux = sliced.grads(model.params, lora, batch, norm, plan, no_turns)
            assert float(value) == pytest.approx(float(reference), rel=1e-5)
            assert_trees_close(grads, expected, rtol=RTOL[model.dtype])
        per_plan = [2 * cfg.num_layers // p.group + -(-len(batch.loss_index) // p.chunk) for p in plans]
        assert sliced.slices == sum(per_plan)


# the GRPO head over the trunk the SFT test slices in every family: stacked layers, int4 in bfloat16,
# and Gemma 3's softcapped logits
@pytest.mark.parametrize("model", ["scan", "int4", "gemma3"], indirect=True)
def test_sliced_grpo_gradients_equal_the_fused_step(model, request):
    cfg = model.config
    config = GRPOConfig(lora_rank=4, lora_alpha=8, micro_batch_rows=8, loss_type="dapo", beta=0.0)
    rng = np.random.default_rng(0)
    rollouts = [Rollout(list(map(int, rng.integers(3, 250, 5 + i))), list(map(int, rng.integers(3, 250, 3 + 2 * i))),
                        list(-rng.random(3 + 2 * i) * 3), False, float(i)) for i in range(5)]
    (batch,) = rollout_batches(rollouts, np.linspace(-1, 1, 5).astype(np.float32), config)
    grads_fn, _, _, grpo_head_loss = make_policy_steps(cfg, adamw(1e-3, 0.0, 1.0), config)
    lora = nudged(init_lora(cfg, 4, seed=3))
    expected, aux = grads_fn(lora, model.params, batch)
    sliced = SlicedStep(cfg, config.scale, grpo_head_loss, max_slice_ms=100)
    for plan in plans_for(request):
        grads, value, sliced_aux = sliced.grads(model.params, lora, batch, 1.0, plan, no_turns)
        assert float(value) == pytest.approx(float(aux["loss"]), rel=1e-4, abs=1e-6)
        assert float(sliced_aux["weight"]) == pytest.approx(float(aux["weight"]))
        assert_trees_close(grads, expected, rtol=RTOL[model.dtype])


def sft_run(model, **overrides):
    config = SFTConfig(lora_rank=4, lora_alpha=8, batch_size=3, n_epochs=1, max_seq_len=256, learning_rate=1e-2,
                       **overrides)
    return SFTRun(model.params, model.config, examples(model.tokenizer), config, name="sliced")


def test_sliced_sft_steps_train_like_fused_ones(tiny_model):
    fused, sliced = sft_run(tiny_model), sft_run(tiny_model, max_slice_ms=1e-3)  # every step sliced, per layer
    ownership = Ownership()  # nobody serving: slices run back to back
    for _ in range(2):
        assert fused.advance(None)["train_loss"] == pytest.approx(sliced.advance(ownership)["train_loss"], rel=1e-4)
    assert_trees_close(sliced.lora, fused.lora, rtol=1e-3)
    slices = ownership.snapshot()["training_slices"]
    assert slices["count"] == sliced._sliced.slices + 2  # and one update per step
    assert slices["count"] > 2 * (2 * tiny_model.config.num_layers + 1)
    assert slices["p50_ms"] > 0


def test_a_step_stopped_between_slices_applies_nothing(tiny_model):
    run, twin = sft_run(tiny_model, max_slice_ms=1e-3), sft_run(tiny_model, max_slice_ms=1e-3)
    before = jax.tree.map(np.asarray, run.lora)
    writes = 0

    def stop_after_three():
        nonlocal writes
        writes += 1
        return writes > 3

    turns = Turns(Ownership(), stop=stop_after_three)
    assert run.advance(turns) is None  # stopped in the middle of the step
    assert turns.stopped and run.micro_step == 0 and run.trained_tokens == 0
    for x, y in zip(jax.tree.leaves(run.lora), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    with pytest.raises(StepAbandoned):  # a stop stays a stop
        turns.write("more")
    # resumed, the run takes the same step on the same batch as a run never stopped
    assert run.advance(Ownership())["train_loss"] == pytest.approx(twin.advance(Ownership())["train_loss"])
    assert_trees_close(run.lora, twin.lora, rtol=1e-5)


def test_a_slice_waits_for_a_serving_step_while_serving_is_busy():
    ownership = Ownership()
    busy = threading.Event()
    busy.set()
    ownership.serving_busy = busy.is_set
    order = []

    def serve():
        for _ in range(3):
            with ownership.inference():
                order.append("serve")
                time.sleep(0.02)
            time.sleep(0.001)
        busy.clear()

    with ownership.training_slice("first", share=0.5):  # no slice before it: no turn to wait for
        order.append("train")
    server = threading.Thread(target=serve)
    server.start()
    for _ in range(2):
        with ownership.training_slice("next", share=0.0):
            order.append("train")
    server.join()
    assert order.count("train") == 3 and order.count("serve") == 3
    assert "train, train" not in ", ".join(order)  # a serving step between any two slices
    assert ownership.snapshot()["training_slices"]["serving_steps_between"] >= 2


def test_grpo_micro_batches_shrink_until_a_layer_fits_a_slice(policy_engine):
    from conftest import random_prompts

    from kiln.train.grpo import GRPORun

    config = GRPOConfig(lora_rank=8, lora_alpha=16, micro_batch_rows=16, max_slice_ms=50)
    run = GRPORun(policy_engine, random_prompts(2), [None] * 2, None, config, name="slice-rows")
    try:
        rollouts = [Rollout([5, 6, 7, 8], [9 + i] * 12, [-1.0] * 12, False, float(i)) for i in range(16)]
        adv = np.linspace(-1, 1, 16).astype(np.float32)
        assert [b.tokens.shape[0] for b in run.micro_batches(rollouts, adv, shared=True)] == [16]  # nothing measured
        S = run.micro_batches(rollouts, adv, shared=True)[0].tokens.shape[1]
        for kind in ("forward", "backward"):  # one layer of 16 rows measured at 3 slices' length
            run._sliced.costs.record(kind, 16 * S, 3 * 0.05)
        parts = run.micro_batches(rollouts, adv, shared=True)
        assert [b.tokens.shape[0] for b in parts] == [4] * 4
        assert [b.tokens.shape[0] for b in run.micro_batches(rollouts, adv, shared=False)] == [16]  # alone: as asked
        whole = run.micro_batches(rollouts, adv, shared=False)[0]
        assert sum(float(b.loss_weight.sum()) for b in parts) == pytest.approx(float(whole.loss_weight.sum()))
    finally:
        run.close()
