"""A correctness gate per compiled bucket on an IREE route: before a bucket serves, it runs twice
on a synthetic batch that fills its shape (random KV, real weights, greedy sampling) and its
results are compared with the portable XLA step on the same inputs: the same greedy tokens, close
logprobs and the same K/V written. A bucket that fails never serves; its batches run padded in a
bigger bucket that passed (see `Runner.resolve`).

Driver and compiler bugs can be shape-specific or show only from a module's second call (on Mesa's
lavapipe an 8-row prefill step gives other tokens than XLA; a step compiled with constant hoisting
was right once, then wrong), so buckets are qualified per shape and twice, not once per route.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import KVCache

if TYPE_CHECKING:
    from kiln.engine.runner import Runner, StepShape

LOGPROB_TOL = 2e-3
# Another greedy token than XLA's passes only in a tie: its logprob this close to XLA's choice's.
TIE_TOL = 1e-4
# K/V relative to the largest magnitude compared (with a floor of 1): a real model's K/V reach
# tens, and float32 sums in another order differ by a few 1e-3 there; a miscompile is off by the
# values' own size.
KV_RTOL = 1e-3


def gate_batch(runner: Runner, shape: StepShape) -> list[RowWork]:
    """Rows that fill the shape: as many rows as fit, each with as many new tokens as fit, at
    random positions of their blocks (attention also reads the context before them)."""
    rng = np.random.default_rng(hash(shape[:4]) & 0xFFFFFFFF)
    n_rows = min(shape.rows, shape.tokens)
    per_row = min(shape.query, shape.tokens // n_rows)
    context = shape.blocks * runner.block_size
    rows = []
    for i in range(n_rows):
        start = int(rng.integers(0, context - per_row + 1))
        table = [1 + (i * shape.blocks + b) % (runner.num_blocks - 1) for b in range(shape.blocks)]
        tokens = rng.integers(0, runner.cfg.vocab_size, per_row).tolist()
        rows.append(RowWork(tokens, start, table, 0))
    return rows


def check_bucket(runner: Runner, shape: StepShape, executable, lora) -> str | None:
    """None if the bucket's executable agrees with XLA on a synthetic batch; else what differed."""
    return measure_bucket(runner, shape, executable, lora)["why"]


def measure_bucket(runner: Runner, shape: StepShape, executable, lora) -> dict:
    """The bucket's executable against XLA's step on a synthetic batch, called twice (a module whose
    state changes with a call fails the second): whether tokens agree, the largest logprob and K/V
    differences, and `why` it fails (None: it passes)."""
    from kiln.engine.runner import MaskedStep, forward_step, model_step, sample_step

    rows = gate_batch(runner, shape)
    inputs = build_step_inputs(rows, runner.block_size, runner.num_blocks, shape.tokens, shape.rows, shape.query,
                               shape.blocks)
    _, last_index, rs, targets = runner.padding_inputs(shape)
    last_index[: len(rows)] = np.cumsum([len(r.tokens) for r in rows]) - 1
    # Only the blocks the rows use hold random K/V, and XLA's reference runs on a pool of just those
    # (renumbered 1..n; block 0 takes padding writes): the bucket's own executable needs a pool of
    # the serving size, but untouched zero pages cost no host memory.
    used = sorted({b for r in rows for b in r.block_table})
    renumber = {b: i + 1 for i, b in enumerate(used)}
    compact_rows = [dataclasses.replace(r, block_table=[renumber[b] for b in r.block_table]) for r in rows]
    compact_inputs = build_step_inputs(compact_rows, runner.block_size, len(used) + 1, shape.tokens, shape.rows,
                                       shape.query, shape.blocks)
    rng = np.random.default_rng(1)
    compact_kv, kv_host = [], []
    for a in runner.abstract[1]:
        compact = np.zeros((a.shape[0], len(used) + 1, *a.shape[2:]), a.dtype)
        compact[:, 1:] = 0.5 * rng.standard_normal(compact[:, 1:].shape)
        full = np.zeros(a.shape, a.dtype)
        full[:, used] = compact[:, 1:]
        compact_kv.append(compact)
        kv_host.append(full)
    # LoRA slots as zeros of their shapes: the slot state belongs to the engine thread
    lora = None if lora is None else jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), lora)
    args = (runner.params, KVCache(*kv_host), inputs, last_index, rs, targets, lora)
    xla_args = (runner.params, KVCache(*map(jnp.asarray, compact_kv)), compact_inputs, last_index, rs, targets, lora)
    static = {"cfg": runner.cfg, "with_prompt_logprobs": shape.prompt_logprobs}
    if shape.flags.mask:
        row_logits, prompt, kv = forward_step(*xla_args[:4], targets, lora, **static)
        want = (sample_step(row_logits, rs, flags=shape.flags), prompt, kv)
    else:
        want = model_step(*xla_args, **static, flags=shape.flags)
    want = (want[0], want[1], KVCache(*(np.asarray(x)[:, 1:] for x in want[2])))
    result = {"rows": len(rows), "tokens_equal": True, "max_logprob_error": 0.0, "max_k_error": 0.0,
              "max_v_error": 0.0, "why": None}
    for i in range(2):
        got = executable(*args, masks=lambda: rs.allowed) if isinstance(executable, MaskedStep) else executable(*args)
        why = _compare(got, want, len(rows), used, runner.route.device, result)
        if why and result["why"] is None:
            result["why"] = f"call {i + 1}: {why}"
    result["passed"] = result["why"] is None
    return result


def _scale(x: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(x), initial=0.0)))


def _compare(got, want, n: int, used: list[int], device, result: dict) -> str | None:
    """What differs between one call's results and XLA's (whose K/V holds only the `used` blocks),
    if anything; keeps the largest errors."""
    got_sampled, want_sampled = got[0], want[0]
    got_tokens, want_tokens = np.asarray(got_sampled.tokens)[:n], np.asarray(want_sampled.tokens)[:n]
    got_lp, want_lp = np.asarray(got_sampled.logprobs)[:n], np.asarray(want_sampled.logprobs)[:n]
    lp_err = float(np.max(np.abs(got_lp - want_lp), initial=0.0))
    same = bool(np.array_equal(got_tokens, want_tokens))
    result["tokens_equal"] &= same
    result["max_logprob_error"] = max(result["max_logprob_error"], lp_err)
    errors = {}
    for name, g, w in zip(("k", "v"), got[2], want[2], strict=True):
        g = (device.to_host(g) if isinstance(g, device.rt.DeviceArray) else np.asarray(g))[:, used]
        w = np.asarray(w, np.float32)
        errors[name] = (float(np.max(np.abs(g.astype(np.float32) - w))), _scale(w))
        result[f"max_{name}_error"] = max(result[f"max_{name}_error"], errors[name][0])
    # another token is fine only in a tie: it is as likely as XLA's choice
    if not same and not lp_err <= TIE_TOL:
        return f"greedy tokens {got_tokens.tolist()} != XLA's {want_tokens.tolist()}"
    if not lp_err <= LOGPROB_TOL:
        return f"logprobs differ by {lp_err:.2e}"
    for name, (err, scale) in errors.items():
        if not err <= KV_RTOL * scale:
            return f"{name} cache differs by {err:.2e} (largest value {scale:.3g})"
    return None


def bigger(shape: StepShape, row_buckets: tuple[int, ...]) -> StepShape | None:
    """The next bucket to try when a shape fails its gate: twice the rows (decode keeps one token
    per row), else None."""
    larger = [s for s in row_buckets if s > shape.rows]
    if not larger:
        return None
    rows = larger[0]
    tokens = rows if shape.tokens == shape.rows else shape.tokens
    return shape._replace(rows=rows, tokens=tokens)


class BucketFailedGate(Exception):
    def __init__(self, shape: StepShape, why: str):
        super().__init__(f"step bucket {shape} failed its correctness gate: {why}")
        self.shape, self.why = shape, why

