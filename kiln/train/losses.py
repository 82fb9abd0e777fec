"""The one loss core every trainer uses (SFT, GRPO, on-policy distillation).

Shapes: logits [B, S, V] float32; per-token arrays [B, S]; `mask` [B, S] weights the tokens
that count (0 for prompt, padding and untrained turns). Token means divide by the mask's sum,
so a batch's loss does not depend on how much padding it carries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per token [B, S]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked next-token cross-entropy (completion-only SFT): mean -log p(target) over the mask."""
    return masked_mean(-token_logprobs(logits, targets), mask)


def token_accuracy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Share of masked tokens whose argmax is the target."""
    return masked_mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32), mask)


def clipped_surrogate(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                      clip_low: float = 0.2, clip_high: float | None = None) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped surrogate per token, to minimise: -min(r A, clip(r, 1 - clip_low,
    1 + clip_high) A), r = exp(logprobs - old_logprobs); and where the clip is active (1.0).

    advantages: per token, or one per sequence ([B] against [B, S] logprobs)."""
    if advantages.ndim == logprobs.ndim - 1:
        advantages = advantages[..., None]
    ratio = jnp.exp(logprobs - old_logprobs)
    high = clip_low if clip_high is None else clip_high
    unclipped, clipped = ratio * advantages, jnp.clip(ratio, 1.0 - clip_low, 1.0 + high) * advantages
    return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


def policy_gradient(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
                    clip_low: float = 0.2, clip_high: float | None = None) -> jax.Array:
    """The clipped surrogate's mean over the mask."""
    return masked_mean(clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)[0], mask)


def truncated_importance_weights(logprobs: jax.Array, sampler_logprobs: jax.Array, cap: float) -> jax.Array:
    """Per-token importance weights min(exp(logprobs - sampler_logprobs), cap), held constant:
    they correct for the sampler (the serving engine) computing slightly different
    probabilities than the trainer, and the cap bounds their variance."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(logprobs - sampler_logprobs), cap))


def group_advantages(rewards: np.ndarray, scale: str = "group", eps: float = 1e-4) -> np.ndarray:
    """GRPO advantages of rewards [prompts, G]: each reward minus its group's mean, divided by
    the group's standard deviation ("group"), the whole batch's ("batch"), or nothing ("none").
    On the host, in NumPy, as `sequence_loss_weights`."""
    rewards = np.asarray(rewards, np.float32)
    centred = rewards - rewards.mean(axis=-1, keepdims=True)
    if scale == "group":
        return centred / (rewards.std(axis=-1, keepdims=True, ddof=1) + eps)
    if scale == "batch":
        return centred / (rewards.std(ddof=1) + eps)
    if scale == "none":
        return centred
    raise ValueError(f"unknown scale_rewards {scale!r} (group, batch or none)")


def sequence_loss_weights(mask: np.ndarray, sequence: np.ndarray, num_sequences: int, loss_type: str,
                          max_completion_tokens: int) -> np.ndarray:
    """Per-token weights that turn a policy loss's per-token terms into the batch loss by a plain
    sum, so micro-batches of one generation batch add up to the same loss:
    "dapo" (and "bnpo"): a mean over all the batch's completion tokens; "grpo": each sequence's
    token mean, averaged over sequences; "dr_grpo": a sum divided by sequences x the maximum
    completion length (no length bias). mask, sequence: per token (sequence: its sequence's
    index among `num_sequences`). On the host, in NumPy: every generation batch has a new token
    count, and JAX would compile (and keep) each eager operation anew for it."""
    mask, sequence = np.asarray(mask, np.float32), np.asarray(sequence)
    if loss_type in ("dapo", "bnpo"):
        return mask / max(float(mask.sum()), 1.0)
    if loss_type == "grpo":
        lengths = np.bincount(sequence, weights=mask, minlength=num_sequences).astype(np.float32)
        return mask / (np.maximum(lengths[sequence], 1.0) * num_sequences)
    if loss_type == "dr_grpo":
        return mask / (num_sequences * max_completion_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r} (grpo, dr_grpo, dapo or bnpo)")


def entropy(logits: jax.Array) -> jax.Array:
    """Per-token entropy of the distribution the logits define."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    With log r = ref_logprobs - logprobs: k1 = -log r (unbiased, high variance),
    k2 = (log r)^2 / 2 (biased, low variance), k3 = r - 1 - log r (unbiased, low variance, >= 0)."""
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return jnp.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


def reverse_kl(student_logprobs: jax.Array, teacher_logprobs: jax.Array) -> jax.Array:
    """Per-token reverse KL term of on-policy distillation on student-sampled tokens:
    log p_student - log p_teacher. Its negative, held constant, is the per-token advantage of
    `policy_gradient`, so distillation needs no loss of its own."""
    return student_logprobs - teacher_logprobs


def distillation_advantages(student_logprobs: jax.Array, teacher_logprobs: jax.Array) -> jax.Array:
    return jax.lax.stop_gradient(-reverse_kl(student_logprobs, teacher_logprobs))


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, beta: float = 0.5) -> jax.Array:
    """Per-token generalized Jensen-Shannon divergence over the full vocabulary (GKD's):
    with M = beta * P_teacher + (1 - beta) * P_student, beta KL(teacher || M) + (1 - beta)
    KL(student || M). beta = 0 is KL(teacher || student) (forward), beta = 1 KL(student ||
    teacher) (reverse); the teacher is held constant."""
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    t = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1))
    if beta == 0.0:
        return jnp.sum(jnp.exp(t) * (t - s), axis=-1)
    if beta == 1.0:
        return jnp.sum(jnp.exp(s) * (s - t), axis=-1)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * jnp.sum(jnp.exp(t) * (t - m), axis=-1) + (1 - beta) * jnp.sum(jnp.exp(s) * (s - m), axis=-1)
