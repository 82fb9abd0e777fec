"""GRPO on the serving engine: the loss core's policy pieces, the engine's logprobs of sampled
tokens against the trainer's, the policy's slot swapped after each step, and a learnable
reward rising on a tiny model."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_prompts

from kiln.engine.steps import COUNTER
from kiln.train import losses
from kiln.train.grpo import GRPOConfig, GRPORun, Rollout, rollout_batches


def test_group_advantages_and_loss_weights():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = losses.group_advantages(rewards, "group")
    np.testing.assert_allclose(adv[0], (rewards[0] - 0.5) / (np.std([1, 0, 0, 1], ddof=1) + 1e-4), rtol=1e-6)
    assert float(jnp.abs(adv[1]).max()) == 0.0  # a group with one reward teaches nothing
    np.testing.assert_allclose(losses.group_advantages(rewards, "none")[0], [0.5, -0.5, -0.5, 0.5])
    mask = jnp.array([1.0, 1, 1, 0, 1])
    seq = jnp.array([0, 0, 0, 0, 1])
    # dapo: a token mean over the batch; grpo: a token mean per sequence, then over sequences
    np.testing.assert_allclose(losses.sequence_loss_weights(mask, seq, 2, "dapo", 8), mask / 4)
    np.testing.assert_allclose(losses.sequence_loss_weights(mask, seq, 2, "grpo", 8), [1 / 6, 1 / 6, 1 / 6, 0, 1 / 2])
    np.testing.assert_allclose(losses.sequence_loss_weights(mask, seq, 2, "dr_grpo", 8), mask / 16)
    lp, old = jnp.log(jnp.array([0.5, 0.9])), jnp.log(jnp.array([0.25, 0.9]))
    per_token, clipped = losses.clipped_surrogate(lp, old, jnp.array([1.0, -1.0]), 0.2)
    np.testing.assert_allclose(per_token, [-1.2, 1.0], rtol=1e-6)  # ratio 2 clipped to 1.2 for A > 0
    np.testing.assert_allclose(clipped, [1.0, 0.0])
    np.testing.assert_allclose(losses.truncated_importance_weights(jnp.log(jnp.array([0.9, 0.1])),
                                                                   jnp.log(jnp.array([0.3, 0.1])), 2.0), [2.0, 1.0])


def test_micro_batches_add_up_to_the_generation_batch():
    rollouts = [Rollout([5, 6, 7], [8 + i] * (i + 1), [-1.0] * (i + 1), False, float(i)) for i in range(5)]
    adv = np.arange(5, dtype=np.float32)
    whole = rollout_batches(rollouts, adv, GRPOConfig(micro_batch_rows=8, loss_type="grpo", lora_rank=8))
    parts = rollout_batches(rollouts, adv, GRPOConfig(micro_batch_rows=2, loss_type="grpo", lora_rank=8))
    assert len(whole) == 1 and len(parts) == 3
    assert sum(float(b.loss_weight.sum()) for b in parts) == pytest.approx(float(whole[0].loss_weight.sum()))
    assert float(whole[0].loss_weight.sum()) == pytest.approx(1.0)
    b = whole[0]
    S = b.tokens.shape[1]
    row, pos = divmod(int(b.loss_index[0]), S)
    assert (row, pos) == (0, 2) and b.loss_targets[0] == 8  # the first completion token is predicted at 2


def test_a_generation_batch_of_new_lengths_compiles_nothing_on_the_host():
    # every generation batch has its own token count: host-side weights and advantages computed with
    # JAX's eager operations compiled (and kept) each operation anew for it, 0.8 s and ~19 MiB a batch
    builds = COUNTER.builds
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        for n in (3, 4):
            rollouts = [Rollout([5, 6, 7], [8] * (n + 2 * i + 1), [-1.0] * (n + 2 * i + 1), False, float(i))
                        for i in range(n)]
            adv = losses.group_advantages(np.array([[r.reward for r in rollouts]], np.float32)).reshape(-1)
            rollout_batches(rollouts, adv, GRPOConfig(micro_batch_rows=8, loss_type=loss_type, lora_rank=8))
    assert COUNTER.builds == builds


def test_engine_logprobs_of_sampled_tokens_equal_the_trainers(policy_engine):
    config = GRPOConfig(lora_rank=8, lora_alpha=16, num_generations=4, prompts_per_step=3, max_completion_tokens=12,
                        micro_batch_rows=8)
    run = GRPORun(policy_engine, random_prompts(3, seed=1), [None] * 3, None, config, name="policy-logprobs")
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    run.lora = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), run.lora)  # adapter on
    run.publish()
    groups = run.sample([0, 1, 2])
    rollouts = [r for g in groups for r in g]
    assert all(len(r.logprobs) == len(r.completion_ids) > 0 for r in rollouts)
    for batch in rollout_batches(rollouts, np.zeros(len(rollouts), np.float32), config):
        trainer = np.asarray(run._jitted["logprobs"](run.lora, run.params, batch))
        base = np.asarray(run._jitted["logprobs"](None, run.params, batch))
        real = batch.loss_weight > 0
        np.testing.assert_allclose(trainer[real], batch.sampler_logprobs[real], atol=1e-4)
        assert np.abs(base[real] - batch.sampler_logprobs[real]).max() > 1e-2  # the adapter matters


def test_each_step_publishes_a_new_policy_version(policy_engine):
    config = GRPOConfig(lora_rank=8, lora_alpha=16, num_generations=2, prompts_per_step=2, max_completion_tokens=4,
                        learning_rate=1e-2)
    run = GRPORun(policy_engine, random_prompts(2, seed=2), [None] * 2,
                  lambda texts, items: [len(t) for t in texts], config, name="policy-versions")
    first = run.adapter
    metrics = run.advance(policy_engine.ownership)
    assert run.adapter is not first and first.retired and run.adapter.version == "step-1"
    resident = policy_engine.at_boundary(policy_engine._core.lora_slots.resident).result()
    assert [r["version"] for r in resident if r["adapter"] == "policy-versions"] == ["step-1"]
    assert {"reward_mean", "reward_std", "kl", "clip_fraction", "entropy", "completion_length", "rollout_seconds",
            "train_seconds", "tokens_per_second"} <= set(metrics)
    policy_engine.retire_adapter(run.adapter).result()


def test_overlapped_rollouts_pin_their_version_until_they_are_done(policy_engine):
    config = GRPOConfig(lora_rank=8, lora_alpha=16, num_generations=2, prompts_per_step=2, max_completion_tokens=4,
                        learning_rate=1e-2, max_steps=3, overlap_rollouts=True)
    run = GRPORun(policy_engine, random_prompts(4, seed=2), [None] * 4,
                  lambda texts, items: [len(t) for t in texts], config, name="policy-overlap")
    first = run.adapter
    metrics = [run.advance(policy_engine.ownership)]
    # step 2's rollouts were started on the first version, before step 1 published the second
    assert run._ahead is not None and run._ahead[0] == 1
    run._ahead[1].result()
    assert first.retired and run.adapter.version == "step-1"
    metrics += [run.advance(policy_engine.ownership), run.advance(policy_engine.ownership)]
    assert [m["rollout_staleness"] for m in metrics] == [0, 1, 1] and run.done and run._ahead is None
    run.close()
    resident = policy_engine.at_boundary(policy_engine._core.lora_slots.resident).result()
    assert not [r for r in resident if r["adapter"] == "policy-overlap"]


def test_a_learnable_reward_rises(policy_engine):
    """Reward: the share of completion tokens equal to the token the base model samples most.
    A fixed, seeded run on the tiny model raises it in trend."""
    ps = random_prompts(8, seed=3)
    config = GRPOConfig(lora_rank=8, lora_alpha=16, num_generations=8, prompts_per_step=4, max_completion_tokens=8,
                        learning_rate=2e-2, max_steps=14, micro_batch_rows=32, seed=5)
    probe = GRPORun(policy_engine, ps, [None] * 8, None, config, name="policy-probe")
    counts = collections.Counter(t for g in probe.sample(list(range(4))) for r in g for t in r.completion_ids)
    policy_engine.retire_adapter(probe.adapter).result()
    target = counts.most_common(1)[0][0]
    run = GRPORun(policy_engine, ps, [None] * 8, None, config, name="policy-learns")
    history = []
    while not run.done:  # rollouts scored by the caller, from their token ids
        groups = run.sample(run.step_prompts())
        for r in (r for g in groups for r in g):
            r.reward = float(np.mean([t == target for t in r.completion_ids]))
        history.append(run.train_step(groups, policy_engine.ownership)["reward_mean"])
    assert run.done
    first, last = np.mean(history[:3]), np.mean(history[-3:])
    assert last > first + 0.2, history
    assert np.polyfit(np.arange(len(history)), history, 1)[0] > 0, history
    policy_engine.retire_adapter(run.adapter).result()


def test_grpo_in_process_trains_and_saves_a_policy(policy_engine, tmp_path):
    """`grpo()`: prompts from JSONL, an OpenAI grader as reward (a score_model judged by the
    served base model, combined in a multi), the adapter saved with its manifest."""
    import json

    from kiln.adapters.store import AdapterStore
    from kiln.train.grpo import grpo

    data = "\n".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": "k"})
                     for q in ("hi", "say k", "k?", "hello"))
    grader = {"type": "multi", "name": "both", "calculate_output": "0.5 * has_k + 0.5 * judged", "graders": {
        "has_k": {"type": "string_check", "name": "has_k", "input": "{{ sample.output_text }}",
                  "reference": "{{ item.answer }}", "operation": "like"},
        "judged": {"type": "score_model", "name": "judged", "model": "tiny-llama", "range": [0, 1],
                   "input": [{"role": "user", "content": "Score {{ sample.output_text }}"}]}}}
    result = grpo(data, grader, "tiny-grpo", engine=policy_engine, store=tmp_path / "store", progress=False,
                  lora_rank=8, lora_alpha=16, num_generations=2, prompts_per_step=2, max_completion_tokens=4,
                  max_steps=2)
    assert [h["step"] for h in result.history] == [1, 2]
    assert all(0.0 <= h["reward_mean"] <= 1.0 for h in result.history)
    # the multi grader's parts are reported per step (and written to TensorBoard as train/reward/<name>)
    assert all(set(h["reward_components"]) == {"has_k", "judged"} for h in result.history)
    assert all(h["reward_mean"] == pytest.approx(0.5 * h["reward_components"]["has_k"] + 0.5 * h["reward_components"][
        "judged"], abs=1e-5) for h in result.history)
    artifact = AdapterStore(tmp_path / "store").latest("tiny-grpo")
    assert artifact.version == result.artifact.version and artifact.manifest.config["method"] == "reinforcement"
    assert artifact.manifest.provenance.source == "training:grpo" and artifact.manifest.training["steps"] == 2
