"""On-policy distillation: the JSD term of the loss core, a student adapter closing the gap to a
teacher adapter on its own samples, and teachers that cannot be used."""

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_prompts

from kiln.engine.lora_slots import AdapterWeights
from kiln.errors import AdapterNotFound, InvalidRequest
from kiln.train import losses
from kiln.train.data import load_examples
from kiln.train.grpo import rollout_batches
from kiln.train.opd import OPDConfig, OPDRun, Teacher
from kiln.train.sft import SFTConfig, SFTRun


def test_generalized_jsd_spans_forward_and_reverse_kl():
    s, t = jnp.log(jnp.array([[0.7, 0.2, 0.1]])), jnp.log(jnp.array([[0.2, 0.5, 0.3]]))
    p, q = np.exp(np.asarray(s)), np.exp(np.asarray(t))
    np.testing.assert_allclose(losses.generalized_jsd(s, t, 0.0), [np.sum(q * np.log(q / p))], rtol=1e-5)
    np.testing.assert_allclose(losses.generalized_jsd(s, t, 1.0), [np.sum(p * np.log(p / q))], rtol=1e-5)
    m = 0.5 * (p + q)
    jsd = 0.5 * np.sum(q * np.log(q / m)) + 0.5 * np.sum(p * np.log(p / m))
    np.testing.assert_allclose(losses.generalized_jsd(s, t, 0.5), [jsd], rtol=1e-5)
    assert float(losses.generalized_jsd(s, s, 0.5)[0]) == pytest.approx(0.0, abs=1e-6)
    grad = jax.grad(lambda x: losses.generalized_jsd(s, x, 0.5).sum())(t)
    assert float(jnp.abs(grad).max()) == 0.0  # the teacher is held constant


def sft_teacher(model, ps):
    """A teacher that answers every prompt with one reply: an adapter trained with SFT."""
    text = "\n".join(json.dumps({"prompt": model.tokenizer.decode(p), "completion": "kiln says hi"}) for p in ps)
    run = SFTRun(model.params, model.config, load_examples(text, model.tokenizer, 64),
                 SFTConfig(lora_rank=8, lora_alpha=16, batch_size=8, n_epochs=30, learning_rate=1e-2, warmup_ratio=0))
    while not run.done:
        metrics = run.advance()
    assert metrics["train_loss"] < 0.05
    return AdapterWeights("teacher", "v1", run.weights(), 2.0, 8)


def test_the_student_closes_the_gap_to_the_teacher(policy_engine, expressive_model):
    """The full-distribution term pulls the student to the teacher on the student's own
    samples; the sampled-token reverse KL is the metric (and the policy-gradient advantage)."""
    ps = random_prompts(8, seed=11)
    teacher = Teacher.adapter(expressive_model, sft_teacher(expressive_model, ps))
    config = OPDConfig(lora_rank=8, lora_alpha=16, num_generations=4, prompts_per_step=4, max_completion_tokens=8,
                       learning_rate=1e-2, max_steps=16, micro_batch_rows=16, jsd_beta=1.0, jsd_coef=100.0, seed=1)
    run = OPDRun(policy_engine, ps, teacher, config, name="student")
    gaps = [run.advance(policy_engine.ownership)["reverse_kl"] for _ in range(config.max_steps)]
    assert np.mean(gaps[-4:]) < 0.8 * np.mean(gaps[:4]), gaps
    assert run.done and run.trained_tokens > 0
    policy_engine.retire_adapter(run.adapter).result()


def test_the_sampled_token_advantage_is_the_teachers_minus_the_students(policy_engine, expressive_model):
    ps = random_prompts(4, seed=13)
    teacher = Teacher.adapter(expressive_model, sft_teacher(expressive_model, ps))
    config = OPDConfig(lora_rank=8, lora_alpha=16, num_generations=2, prompts_per_step=4, max_completion_tokens=6,
                       micro_batch_rows=16, baseline=False)
    run = OPDRun(policy_engine, ps, teacher, config, name="student-advantages")
    rollouts = [r for g in run.sample([0, 1, 2, 3]) for r in g]
    [batch] = rollout_batches(rollouts, np.zeros(len(rollouts), np.float32), config)
    [scored], extra = run._with_logprobs([batch], lambda _: contextlib.nullcontext())
    real = batch.loss_weight > 0
    teacher_lp = np.asarray(run._jitted["teacher"](teacher.lora, teacher.params, batch))
    np.testing.assert_allclose(scored.advantages[real], teacher_lp[real] - batch.sampler_logprobs[real], atol=1e-5)
    assert extra["reverse_kl"] == pytest.approx(float(np.mean(-scored.advantages[real])), rel=1e-5)
    assert extra["reverse_kl"] > 1.0  # the fresh student is far from the teacher's one reply
    policy_engine.retire_adapter(run.adapter).result()


def test_a_teacher_with_another_tokenizer_is_refused(expressive_model, other_tokenizer_gguf):
    from kiln.models.loader import load_model

    other = load_model(other_tokenizer_gguf, show_progress=False, model_id="other")
    with pytest.raises(InvalidRequest) as err:
        Teacher.model(expressive_model, other)
    assert err.value.code == "teacher_tokenizer_mismatch" and err.value.param == "teacher"
    same = Teacher.model(expressive_model, expressive_model)
    assert same.cfg is expressive_model.config


def test_distill_in_process_from_a_saved_teacher_adapter(policy_engine, expressive_model, tmp_path):
    """`distill()`: prompts from JSONL, the teacher an SFT adapter read from the store, the
    student saved with a manifest that names its teacher."""
    from kiln.adapters.store import AdapterStore
    from kiln.train.artifact import adapter_manifest
    from kiln.train.opd import distill

    ps = random_prompts(4, seed=17)
    weights = sft_teacher(expressive_model, ps)
    store = AdapterStore(tmp_path / "store")
    teacher = store.save(adapter_manifest("teacher", expressive_model, method="supervised", source="sft", config={},
                                          rank=8, alpha=16, modules=tuple(weights.weights), inputs=[], training={},
                                          steps=1, trained_tokens=1, final_metrics={}), weights.weights)
    data = "\n".join(json.dumps({"prompt": expressive_model.tokenizer.decode(p)}) for p in ps)
    result = distill(data, teacher, "student", engine=policy_engine, store=store, progress=False, lora_rank=8,
                     lora_alpha=16, num_generations=2, prompts_per_step=2, max_completion_tokens=4, max_steps=2)
    assert [h["step"] for h in result.history] == [1, 2] and all(h["reverse_kl"] > 0 for h in result.history)
    saved = store.latest("student")
    assert saved.manifest.config["method"] == "distillation" and saved.manifest.config["teacher"] == "teacher"
    assert saved.manifest.provenance.source == "training:opd"
    with pytest.raises(AdapterNotFound):
        distill(data, tmp_path / "no-such-adapter", engine=policy_engine, save=False, progress=False)
