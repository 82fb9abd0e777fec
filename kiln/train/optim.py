"""The optimiser every trainer uses: AdamW with warmup and decay, clipping, accumulation."""

from __future__ import annotations

import optax


def learning_rate_schedule(peak: float, total_steps: int, warmup_ratio: float, decay: str) -> optax.Schedule:
    """Linear warmup from 0 over warmup_ratio of the steps, then cosine or linear decay to 0
    (or constant)."""
    total_steps = max(1, total_steps)
    warmup = min(int(round(warmup_ratio * total_steps)), total_steps - 1)
    rest = total_steps - warmup
    if decay == "cosine":
        after = optax.cosine_decay_schedule(peak, rest)
    elif decay == "linear":
        after = optax.linear_schedule(peak, 0.0, rest)
    elif decay == "constant":
        after = optax.constant_schedule(peak)
    else:
        raise ValueError(f"unknown learning rate schedule {decay!r}")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def adamw(schedule: optax.Schedule, weight_decay: float, max_grad_norm: float,
          accumulation: int = 1) -> optax.GradientTransformation:
    """AdamW (state float32, as the float32 LoRA params), global-norm clipping (0 = off), and
    gradient accumulation over `accumulation` micro-batches (the schedule counts optimizer steps)."""
    tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    if max_grad_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    return optax.MultiSteps(tx, accumulation) if accumulation > 1 else tx


def apply_gradients(tx: optax.GradientTransformation):
    """One optimizer update as a function to jit: (lora, opt_state, grads) -> the new params and state,
    and the gradients' global norm."""

    def update(lora, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, optax.tree.norm(grads)

    return update
