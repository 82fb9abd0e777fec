"""A correctness gate per compiled bucket on an IREE route: before a bucket serves, it runs twice
on a synthetic batch that fills its shape (random KV, real weights, greedy sampling) and its
results are compared with the portable XLA step on the same inputs: the same greedy tokens, close
logprobs and the same K/V written. A bucket that fails never serves; its batches run in a bigger
bucket that passed, or split (see `Runner.bucket_for` and the scheduler's split).

Driver and compiler bugs can be shape-specific or show only from a module's second call (on Mesa's
lavapipe an 8-row prefill step gives other tokens than XLA; a step compiled with constant hoisting
was right once, then wrong), so buckets are qualified per shape and twice, not once per route.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from kiln.engine.faults import as_device_lost, first_line, is_device_loss
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import KVCache

if TYPE_CHECKING:
    from kiln.engine.backends import Backend
    from kiln.engine.buckets import StepBucket
    from kiln.engine.step_inputs import StepLayout
    from kiln.models.config import ModelConfig


class GatedRunner(Protocol):
    """What a gate reads of the runner whose step it checks (kiln/engine/runner.py's Runner)."""

    cfg: ModelConfig
    params: Any
    backend: Backend
    layout: StepLayout
    abstract: tuple
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    table_columns: int

LOGPROB_TOL = 2e-3
# Another greedy token than XLA's passes only in a tie: its logprob this close to XLA's choice's.
TIE_TOL = 1e-4
# K/V relative to the largest magnitude compared (with a floor of 1): a real model's K/V reach
# tens, and float32 sums in another order differ by a few 1e-3 there; a miscompile is off by the
# values' own size.
KV_RTOL = 1e-3


def gate_signature() -> str:
    """What a recorded verdict was judged by: the tolerances and this module's source."""
    return hashlib.sha256(f"{LOGPROB_TOL} {TIE_TOL} {KV_RTOL} ".encode() + Path(__file__).read_bytes()).hexdigest()[:16]


def gate_batch(runner: GatedRunner, bucket: StepBucket) -> list[RowWork]:
    """Rows that fill the bucket: as many rows as fit, each with as many new tokens as fit, at
    random positions of their blocks (attention also reads the context before them)."""
    rng = np.random.default_rng(hash((bucket.kind, bucket.tokens, bucket.rows)) & 0xFFFFFFFF)
    n_rows = bucket.max_rows
    per_row = 1 if bucket.kind == "decode" else min(bucket.tokens // n_rows,
                                                    bucket.tile_size * (bucket.tiles // n_rows))
    blocks = min(runner.max_blocks_per_seq, math.ceil(per_row / runner.block_size) + 2)
    rows = []
    for i in range(n_rows):
        start = int(rng.integers(0, blocks * runner.block_size - per_row + 1))
        table = [1 + (i * blocks + b) % (runner.num_blocks - 1) for b in range(blocks)]
        tokens = rng.integers(0, runner.cfg.vocab_size, per_row).tolist()
        rows.append(RowWork(tokens, start, table, 0))
    return rows


def check_bucket(runner: GatedRunner, bucket: StepBucket, executable, lora) -> str | None:
    """None if the bucket's executable agrees with XLA on a synthetic batch; else what differed. A
    module that fails on the device fails its gate (IREE 3.13 on lavapipe refuses some of the default
    settings' modules: "transient buffer has no staged Vulkan backing"); a lost device is raised."""
    try:
        return measure_bucket(runner, bucket, executable, lora)["why"]
    except Exception as exc:  # the IREE runtime raises plain RuntimeErrors: any failure is the gate's finding
        if is_device_loss(exc):
            raise as_device_lost(exc) from exc
        return f"the module failed on the device: {first_line(exc)}"


def _layout(runner: GatedRunner, bucket: StepBucket, rows: list[RowWork]):
    return build_step_inputs(rows, runner.block_size, num_tokens=bucket.tokens, num_tiles=bucket.tiles,
                             tile_size=bucket.tile_size, table_columns=runner.table_columns)


def measure_bucket(runner: GatedRunner, bucket: StepBucket, executable, lora) -> dict:
    """The bucket's executable (forward pass and sampling) against XLA's forward on a synthetic batch,
    called twice (a module whose state changes with a call fails the second): whether the greedy
    tokens agree (of its logits and of its own sampler), the largest logprob and K/V differences,
    and `why` it fails (None: it passes)."""
    from kiln.engine.steps import forward_step

    rows = gate_batch(runner, bucket)
    inputs = _layout(runner, bucket, rows)
    _, last_index, targets, _ = runner.layout.padding_inputs(bucket)
    last_index[: len(rows)] = np.cumsum([len(r.tokens) for r in rows]) - 1
    # Only the blocks the rows use hold random K/V, and XLA's reference runs on a pool of just those
    # (renumbered 1..n; block 0 takes padding writes): the bucket's own executable needs a pool of
    # the serving size, but untouched zero pages cost no host memory.
    used = sorted({b for r in rows for b in r.block_table})
    renumber = {b: i + 1 for i, b in enumerate(used)}
    compact_inputs = _layout(runner, bucket, [dataclasses.replace(r, block_table=[renumber[b] for b in r.block_table])
                                              for r in rows])
    rng = np.random.default_rng(1)
    compact_kv, kv_host = [], []
    for a in runner.abstract[1]:
        compact = np.zeros((*a.shape[:2], len(used) + 1, *a.shape[3:]), a.dtype)
        compact[:, :, 1:] = 0.5 * rng.standard_normal(compact[:, :, 1:].shape)
        full = np.zeros(a.shape, a.dtype)
        full[:, :, used] = compact[:, :, 1:]
        compact_kv.append(compact)
        kv_host.append(full)
    # LoRA slots as zeros of their shapes: the slot state belongs to the engine thread
    lora = None if lora is None else jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), lora)
    static = {"cfg": runner.cfg, "prompt_logprobs": False}
    want_logits, _, want_kv = forward_step(runner.params, KVCache(*jax.device_put(compact_kv)), compact_inputs,
                                           last_index, targets, lora, None, **static)
    want = (np.asarray(want_logits), [np.asarray(x)[:, :, 1:] for x in want_kv])
    result = {"rows": len(rows), "tokens_equal": True, "max_logprob_error": 0.0, "max_k_error": 0.0,
              "max_v_error": 0.0, "why": None}
    greedy = runner.layout.sampling_arrays([], bucket.rows)  # padding rows sample greedily
    for i in range(2):
        logits, sampled, _, kv = executable(runner.params, KVCache(*kv_host), inputs, last_index, lora, greedy)
        why = _compare((logits, sampled, kv), want, len(rows), used, runner.backend.device, result)
        if why and result["why"] is None:
            result["why"] = f"call {i + 1}: {why}"
    result["passed"] = result["why"] is None
    return result


def _scale(x: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(x), initial=0.0)))


def _host(x, device) -> np.ndarray:
    return device.to_host(x) if isinstance(x, device.rt.DeviceArray) else np.asarray(x)


def _greedy(row_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's greedy token and its logprob."""
    tokens = row_logits.argmax(-1)
    top = row_logits.max(-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(row_logits - top).sum(-1))
    return tokens, row_logits[np.arange(len(tokens)), tokens] - log_norm


def _compare(got, want, n: int, used: list[int], device, result: dict) -> str | None:
    """What differs between one call's results and XLA's (whose K/V holds only the `used` blocks),
    if anything; keeps the largest errors."""
    got_tokens, got_lp = _greedy(_host(got[0], device)[:n].astype(np.float32))  # got: (logits, sampled, kv)
    want_tokens, want_lp = _greedy(want[0][:n])
    sampled_tokens, sampled_lp = np.asarray(got[1].tokens)[:n], np.asarray(got[1].logprobs)[:n]
    lp_err = float(np.max(np.abs(np.concatenate([got_lp, sampled_lp]) - np.tile(want_lp, 2)), initial=0.0))
    same = bool(np.array_equal(got_tokens, want_tokens) and np.array_equal(sampled_tokens, want_tokens))
    result["tokens_equal"] &= same
    result["max_logprob_error"] = max(result["max_logprob_error"], lp_err)
    errors = {}
    for name, g, w in zip(("k", "v"), got[2], want[1], strict=True):  # want: (logits, kv)
        g = _host(g, device)[:, :, used]
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


class BucketFailedGate(Exception):
    def __init__(self, shape: StepBucket, why: str):
        super().__init__(f"step bucket {shape.describe()} failed its correctness gate: {why}")
        self.shape, self.why = shape, why
