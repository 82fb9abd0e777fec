"""The one loss core every trainer uses (SFT, GRPO, on-policy distillation).

Shapes: logits [B, S, V] float32; per-token arrays [B, S]; `mask` [B, S] weights the tokens
that count (0 for prompt, padding and untrained turns). Token means divide by the mask's sum,
so a batch's loss does not depend on how much padding it carries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def policy_gradient(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
                    clip_low: float = 0.2, clip_high: float | None = None) -> jax.Array:
    """PPO's clipped surrogate, to minimise: mean over the mask of
    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logprobs - old_logprobs).

    advantages: [B, S] or [B] (one per sequence, as GRPO's group-normalised rewards)."""
    if advantages.ndim == logprobs.ndim - 1:
        advantages = advantages[..., None]
    ratio = jnp.exp(logprobs - old_logprobs)
    high = clip_low if clip_high is None else clip_high
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + high)
    return masked_mean(-jnp.minimum(ratio * advantages, clipped * advantages), mask)


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
