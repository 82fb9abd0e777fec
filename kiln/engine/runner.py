"""Runner: executes one planned batch as one jitted step, and owns the KV state.

It pads the batch into a shape bucket and calls the step; it never splits or reorders
what the scheduler planned. Each bucket tuple (tokens T, rows S, query length Q, blocks
per row M, sampling flags, prompt logprobs, LoRA groups) is one compiled executable:
Kiln's graph capture. When live capture is forbidden (the serving profile), a batch runs
in the smallest already-compiled bucket that fits it, or fails with GraphCaptureDisabled;
`fits` tells the scheduler beforehand. A failed step that took the donated KV state with
it is recovered here (`reset_kv`); the scheduler then recomputes the running requests.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch

from kiln.engine.config import EngineConfig
from kiln.engine.lora_slots import LoraSlots
from kiln.engine.output import TokenLogprob
from kiln.engine.request import Request
from kiln.engine.sampling import MAX_TOP_LOGPROBS, RowSampling, Sampled, SamplingFlags, sample
from kiln.engine.scheduler import Batch, Rows, StepFailure
from kiln.errors import GraphCaptureDisabled, RequestFailed
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.config import ModelConfig
from kiln.models.decoder import KVCache, StepInputs, forward_hidden, init_kv_cache, logits
from kiln.models.lora import module_shapes

log = logging.getLogger("kiln.engine")

# Step cost model (relative units): a step pays a fixed cost (streaming the weights once),
# a per-token cost (the matmuls) and a per attended key cost. Measured on XLA:CPU, a step's
# fixed cost is about that of 16 tokens, and attention, being memory-bound, costs about 8x
# its FLOPs relative to the matmuls.
FIXED_STEP_TOKENS = 16
ATTENTION_MEMORY_FACTOR = 8


class StepShape(NamedTuple):
    tokens: int
    rows: int
    query: int
    blocks: int
    flags: SamplingFlags
    prompt_logprobs: bool
    lora: int = 0  # adapter groups (distinct adapters) the step applies; 0: none

    def fits(self, other: StepShape) -> bool:
        """True if a batch of shape `other` can run padded to this shape."""
        same = (self.flags, self.prompt_logprobs) == (other.flags, other.prompt_logprobs)
        return same and all(a >= b for a, b in zip(self[:4], other[:4], strict=True)) and (
            self.lora >= other.lora and (self.lora > 0) == (other.lora > 0))


class PromptLogprobs(NamedTuple):
    target: jax.Array  # [T] logprob of the next prompt token at each position
    top_ids: jax.Array  # [T, K]
    top_logprobs: jax.Array  # [T, K]


class CompileCounter:
    """Counts executables built by XLA vs loaded from the persistent compilation cache."""

    def __init__(self):
        self.builds = 0
        self.cache_hits = 0
        self.traces = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            self.builds += 1

    def _on_event(self, event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    @property
    def compiled(self) -> int:
        return self.builds - self.cache_hits


COUNTER = CompileCounter()
_trace_lock = threading.Lock()


@functools.partial(jax.jit, static_argnames=("cfg", "flags", "with_prompt_logprobs"), donate_argnames=("kv",))
def model_step(params, kv: KVCache, inputs: StepInputs, last_index, rs: RowSampling, prompt_targets,
               cfg: ModelConfig, flags: SamplingFlags, with_prompt_logprobs: bool, lora=None):
    """Forward + on-device sampling; only sampled ids and requested logprobs leave the device."""
    with _trace_lock:
        COUNTER.traces += 1  # runs at trace time only
    hidden, kv = forward_hidden(params, kv, inputs, cfg, lora)
    sampled = sample(logits(params, hidden[last_index]), rs, flags)
    prompt = None
    if with_prompt_logprobs:
        lp = jax.nn.log_softmax(logits(params, hidden), axis=-1)
        target = jnp.take_along_axis(lp, jnp.maximum(prompt_targets, 0)[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]))
        prompt = PromptLogprobs(target, top_ids.astype(jnp.int32), top_lp)
    return sampled, prompt, kv


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    return 1 << (n - 1).bit_length()


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class StepResult:
    """One executed batch, on the host: each row's sampled token and, for rows that asked,
    the logprobs of their prompt tokens."""

    def __init__(self, rows: Rows, sampled: Sampled, prompt: PromptLogprobs | None, targets: np.ndarray):
        self.tokens, self.logprobs = np.asarray(sampled.tokens), np.asarray(sampled.logprobs)
        self.top_ids, self.top_lps = np.asarray(sampled.top_ids), np.asarray(sampled.top_logprobs)
        self.rows = rows
        self.prompt = None if prompt is None else tuple(np.asarray(x) for x in prompt)
        self.targets = targets
        self.offsets = np.cumsum([0] + [n for _, n in rows])
        # positions are read now: the scheduler advances the requests after this step
        self.starts = [r.num_computed for r, _ in rows]

    def token(self, i: int) -> tuple[int, float, list[tuple[int, float]]]:
        k = self.rows[i][0].params.logprobs or 0
        top = list(zip(self.top_ids[i, :k].tolist(), self.top_lps[i, :k].tolist(), strict=True)) if k else []
        return int(self.tokens[i]), float(self.logprobs[i]), top

    def prompt_logprobs(self, i: int) -> list[tuple[int, TokenLogprob]]:
        """(prompt position, logprob of the prompt token there) for the row's new tokens."""
        if self.prompt is None:
            return []
        target, ids, lps = self.prompt
        k = self.rows[i][0].params.prompt_logprobs or 0
        out = []
        for t in range(self.offsets[i], self.offsets[i + 1]):
            if self.targets[t] >= 0:
                top = list(zip(ids[t, :k].tolist(), lps[t, :k].tolist(), strict=True))
                pos = self.starts[i] + (t - self.offsets[i]) + 1
                out.append((pos, TokenLogprob(int(self.targets[t]), float(target[t]), top)))
        return out


class Runner:
    def __init__(self, cfg: ModelConfig, params, config: EngineConfig, max_model_len: int,
                 eos_ids: tuple[int, ...], lora_slots: LoraSlots, kv_dtype: str = "float32"):
        self.cfg = cfg
        self.params = params
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks
        self.eos_ids = eos_ids
        self.lora_slots = lora_slots
        self.kv_dtype = jnp.dtype(kv_dtype)
        self.kv = init_kv_cache(cfg, self.num_blocks, self.block_size, self.kv_dtype)
        self.row_buckets = tuple(sorted(set(config.decode_row_buckets) | {_pow2(config.max_num_seqs)}))
        self.token_buckets = tuple(sorted(set(config.prefill_token_buckets) | {_pow2(config.max_num_batched_tokens)}))
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.compiled: set[StepShape] = set()
        layer_params = sum(i * o for i, o in module_shapes(cfg).values())
        self.flops_per_token = 2 * cfg.num_layers * layer_params
        self.flops_per_key = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ATTENTION_MEMORY_FACTOR

    def reset_kv(self) -> None:
        """A fresh, empty KV state (after a failed step consumed the donated one)."""
        self.kv = init_kv_cache(self.cfg, self.num_blocks, self.block_size, self.kv_dtype)

    # ---- shapes ------------------------------------------------------------------------

    def shape_for(self, rows: Rows) -> StepShape:
        n_rows = len(rows)
        total = sum(n for _, n in rows)
        S = _bucket(n_rows, self.row_buckets)
        if all(n == 1 for _, n in rows):
            T, Q = S, 1
        else:
            T = _bucket(total, self.token_buckets)
            Q = min(_pow2(max(n for _, n in rows)), T)
        M = min(_pow2(max(len(r.block_ids) for r, _ in rows)), _pow2(self.max_blocks_per_seq))
        params = [r.params for r, _ in rows]
        flags = SamplingFlags(
            penalties=any(p.needs_penalties for p in params),
            filtering=any(p.needs_filtering for p in params),
            top_logprobs=any((p.logprobs or 0) > 0 for p in params),
        )
        prompt_lp = any(r.params.prompt_logprobs is not None and r.in_prefill for r, _ in rows)
        adapters = len({r.adapter_slot for r, _ in rows if r.adapter_slot})
        lora = min(_pow2(adapters), self.lora_slots.n_slots) if adapters else 0
        return StepShape(T, S, Q, M, flags, prompt_lp, lora)

    def resolve(self, shape: StepShape) -> StepShape:
        """The shape to run: itself, or with live capture off the smallest compiled one that fits."""
        if shape in self.compiled or self.config.allow_live_capture:
            return shape
        fitting = [s for s in self.compiled if s.fits(shape)]
        if not fitting:
            raise GraphCaptureDisabled(
                f"no compiled step bucket fits tokens={shape.tokens} rows={shape.rows} "
                f"query={shape.query} blocks={shape.blocks}, and live graph capture is disabled")
        return min(fitting, key=lambda s: (s.tokens * s.blocks, s.rows, s.query, s.lora))

    def fits(self, rows: Rows) -> bool:
        """Whether the rows can run as one step without compiling a step live capture forbids."""
        try:
            self.resolve(self.shape_for(rows))
        except GraphCaptureDisabled:
            return False
        return True

    def step_cost(self, rows: Rows) -> float:
        """Estimated cost of running the rows as one step, padding included (see the cost model above)."""
        s = self.shape_for(rows)
        keys = s.rows * s.query * s.blocks * self.block_size
        return (s.tokens + FIXED_STEP_TOKENS) * self.flops_per_token + keys * self.flops_per_key

    # ---- inputs ------------------------------------------------------------------------

    def _sampling_arrays(self, rows: Rows, shape: StepShape) -> RowSampling:
        S, V = shape.rows, self.cfg.vocab_size
        f32 = lambda v: np.full(S, v, np.float32)  # noqa: E731
        temperature, top_p, min_p = f32(0.0), f32(1.0), f32(0.0)
        presence, frequency, repetition = f32(0.0), f32(0.0), f32(1.0)
        top_k = np.zeros(S, np.int32)
        seed = np.zeros((S, 2), np.uint32)
        step = np.zeros(S, np.int32)
        bias = [sorted((r.params.logit_bias or {}).items()) for r, _ in rows]
        banned = [self._banned(r) for r, _ in rows]
        kb = _pow2(max((len(b) for b in bias), default=1))
        kn = _pow2(max((len(b) for b in banned), default=1))
        bias_ids, bias_values = np.full((S, kb), V, np.int32), np.zeros((S, kb), np.float32)
        banned_ids = np.full((S, kn), V, np.int32)
        if shape.flags.penalties:
            p_out = _pow2(max((len(r.output_ids) for r, _ in rows), default=0), 8)
            p_in = _pow2(max((len(r.prompt_ids) for r, _ in rows), default=0), 8)
        else:
            p_out = p_in = 1
        output_ids, prompt_ids = np.full((S, p_out), V, np.int32), np.full((S, p_in), V, np.int32)
        for i, (r, _) in enumerate(rows):
            p = r.params
            temperature[i], top_p[i], min_p[i] = p.temperature, p.top_p, p.min_p
            top_k[i] = max(p.top_k, 0)
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            seed[i] = (r.seed & 0xFFFFFFFF, (r.seed >> 32) & 0xFFFFFFFF)
            step[i] = len(r.output_ids)
            for j, (tok, val) in enumerate(bias[i]):
                bias_ids[i, j], bias_values[i, j] = int(tok), val
            banned_ids[i, : len(banned[i])] = banned[i]
            if shape.flags.penalties and p.needs_penalties:
                output_ids[i, : len(r.output_ids)] = r.output_ids
                prompt_ids[i, : len(r.prompt_ids)] = r.prompt_ids
        return RowSampling(temperature, top_k, top_p, min_p, presence, frequency, repetition, seed, step,
                           bias_ids, bias_values, banned_ids, output_ids, prompt_ids)

    def _banned(self, r: Request) -> list[int]:
        """Stop tokens are masked until min_tokens have been generated."""
        if len(r.output_ids) >= r.params.min_tokens:
            return []
        return sorted(set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(self.eos_ids)))

    def _lora(self, rows: Rows, shape: StepShape):
        """The slot state and the step's active slots; None (no LoRA work at all) without adapter rows."""
        if not shape.lora:
            return None
        active = np.zeros(shape.lora, np.int32)
        slots = sorted({r.adapter_slot for r, _ in rows if r.adapter_slot})
        active[: len(slots)] = slots
        return {**self.lora_slots.ensure_state(), "active": active}

    # ---- step --------------------------------------------------------------------------

    def execute(self, batch: Batch) -> StepResult | StepFailure:
        """Runs one planned batch; a failure fails its rows, never the process."""
        rows = batch.rows
        try:
            shape = self.resolve(self.shape_for(rows))
        except GraphCaptureDisabled as exc:
            return StepFailure(exc)
        try:
            return self._run(rows, shape)
        except Exception as exc:
            log.exception("step failed")
            kv_lost = self.kv.k.is_deleted()
            if kv_lost:
                self.reset_kv()
            return StepFailure(RequestFailed(f"request failed: {type(exc).__name__}"), kv_lost)

    def _run(self, rows: Rows, shape: StepShape) -> StepResult:
        work = [RowWork(r.all_ids[r.num_computed : r.num_computed + n], r.num_computed, r.block_ids, r.adapter_slot)
                for r, n in rows]
        inputs = build_step_inputs(work, self.block_size, self.num_blocks, shape.tokens, shape.rows, shape.query,
                                   shape.blocks)
        last_index = np.zeros(shape.rows, np.int32)
        targets = np.full(shape.tokens, -1, np.int32)
        t = 0
        for i, (r, n) in enumerate(rows):
            last_index[i] = t + n - 1
            if shape.prompt_logprobs and r.params.prompt_logprobs is not None:
                for j in range(n):
                    pos = r.num_computed + j
                    if pos + 1 < len(r.prompt_ids):
                        targets[t + j] = r.prompt_ids[pos + 1]
            t += n
        rs = self._sampling_arrays(rows, shape)
        sampled, prompt, self.kv = model_step(self.params, self.kv, inputs, last_index, rs, targets, self.cfg,
                                              shape.flags, shape.prompt_logprobs, self._lora(rows, shape))
        self.compiled.add(shape)
        return StepResult(rows, sampled, prompt, targets)

    # ---- warmup ------------------------------------------------------------------------

    def warmup_shapes(self, context_tokens: int, lora: bool = False) -> list[StepShape]:
        """The configured buckets: decode (each row bucket) and single-row prefill (each token
        bucket), for every blocks-per-row bucket up to `context_tokens` of context; with `lora`,
        also the decode buckets of batches that carry one adapter."""
        B = self.block_size
        top = min(_pow2(math.ceil(context_tokens / B)), _pow2(self.max_blocks_per_seq))
        block_buckets = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
        flags = SamplingFlags()
        shapes = [StepShape(s, s, 1, m, flags, False) for s in self.row_buckets for m in block_buckets]
        for t in self.token_buckets:
            shapes += [StepShape(t, 1, t, m, flags, False) for m in block_buckets if m * B >= t]
        if lora:
            shapes += [StepShape(s, s, 1, m, flags, False, 1) for s in self.row_buckets for m in block_buckets]
        return shapes

    def warm(self, shapes: list[StepShape]) -> None:
        """Compiles the given buckets by running them on padding (writes nothing to the cache)."""
        for shape in shapes:
            if shape in self.compiled:
                continue
            S, T = shape.rows, shape.tokens
            pad_slot = self.num_blocks * self.block_size
            inputs = StepInputs(np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, pad_slot, np.int32),
                                np.zeros(T, np.int32), np.full((S, shape.query), T, np.int32),
                                np.zeros((S, shape.blocks), np.int32), np.zeros(S, np.int32))
            rs = self._sampling_arrays([], shape)
            lora = {**self.lora_slots.ensure_state(), "active": np.zeros(shape.lora, np.int32)} if shape.lora else None
            sampled, _, self.kv = model_step(self.params, self.kv, inputs, np.zeros(S, np.int32), rs,
                                             np.full(T, -1, np.int32), self.cfg, shape.flags, shape.prompt_logprobs,
                                             lora)
            jax.block_until_ready(sampled.tokens)
            self.compiled.add(shape)

