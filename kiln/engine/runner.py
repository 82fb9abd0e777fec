"""Runner: pads a scheduled batch into a shape bucket and calls the jitted step.

Each bucket tuple (tokens T, rows S, query length Q, blocks per row M, sampling flags)
is one compiled executable: Kiln's graph capture. When live capture is forbidden
(the serving profile), a batch runs in the smallest already-compiled larger bucket,
or is refused with GraphCaptureDisabled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch

from kiln.engine.request import Request
from kiln.engine.sampling import MAX_TOP_LOGPROBS, RowSampling, Sampled, SamplingFlags, sample
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.config import ModelConfig
from kiln.models.decoder import KVCache, StepInputs, forward_hidden, init_kv_cache, logits


class GraphCaptureDisabled(RuntimeError):
    """No compiled bucket fits the batch and compiling a new one is not allowed."""


class StepShape(NamedTuple):
    tokens: int
    rows: int
    query: int
    blocks: int
    flags: SamplingFlags
    prompt_logprobs: bool
    lora: bool = False  # some row uses an adapter slot

    def fits(self, other: StepShape) -> bool:
        """True if a batch of shape `other` can run padded to this shape."""
        return (self.flags, self.prompt_logprobs) == (other.flags, other.prompt_logprobs) and self.lora >= other.lora and all(
            a >= b for a, b in zip(self[:4], other[:4], strict=True)
        )


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


@dataclasses.dataclass
class RunnerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    row_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    allow_live_capture: bool = True
    kv_dtype: str = "float32"


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    return 1 << (n - 1).bit_length()


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass
class RowResult:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # up to MAX_TOP_LOGPROBS (token id, logprob)


class Runner:
    def __init__(self, cfg: ModelConfig, params, config: RunnerConfig, eos_ids: tuple[int, ...] = (), lora_slots=None):
        self.cfg = cfg
        self.params = params
        self.config = config
        self.eos_ids = eos_ids
        self.kv = init_kv_cache(cfg, config.num_blocks, config.block_size, jnp.dtype(config.kv_dtype))
        self.row_buckets = tuple(sorted(set(config.row_buckets) | {_pow2(config.max_num_seqs)}))
        self.token_buckets = tuple(sorted(set(config.token_buckets) | {_pow2(config.max_num_batched_tokens)}))
        self.max_blocks_per_seq = math.ceil(config.max_model_len / config.block_size)
        self.compiled: set[StepShape] = set()
        self.lora_slots = lora_slots  # LoraSlots: its .state is read at every step

    def _lora(self, shape: StepShape):
        """Batches without adapter rows run the plain graph (no LoRA work at all)."""
        return self.lora_slots.state if shape.lora and self.lora_slots is not None else None

    # ---- shapes ------------------------------------------------------------------------

    def shape_for(self, rows: list[tuple[Request, int]]) -> StepShape:
        n_rows = len(rows)
        total = sum(n for _, n in rows)
        decode = all(n == 1 for _, n in rows)
        S = _bucket(n_rows, self.row_buckets)
        if decode:
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
        prompt_lp = any(p.prompt_logprobs is not None and r.in_prefill for (r, _), p in zip(rows, params, strict=True))
        lora = any(r.adapter_slot for r, _ in rows)
        return StepShape(T, S, Q, M, flags, prompt_lp, lora)

    def resolve(self, shape: StepShape) -> StepShape:
        if shape in self.compiled or self.config.allow_live_capture:
            return shape
        fitting = [s for s in self.compiled if s.fits(shape)]
        if not fitting:
            raise GraphCaptureDisabled(
                f"no compiled step bucket fits tokens={shape.tokens} rows={shape.rows} "
                f"query={shape.query} blocks={shape.blocks}, and live graph capture is disabled"
            )
        return min(fitting, key=lambda s: (s.tokens * s.blocks, s.rows, s.query))

    # ---- inputs ------------------------------------------------------------------------

    def _sampling_arrays(self, rows: list[tuple[Request, int]], shape: StepShape) -> RowSampling:
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

    # ---- step --------------------------------------------------------------------------

    def run(self, rows: list[tuple[Request, int]]) -> tuple[list[RowResult], dict[int, tuple]]:
        """Runs one scheduled batch. Returns per-row results and, for rows that asked for prompt
        logprobs, {row index: (target logprobs, top ids, top logprobs, target ids)}.

        Attention pads every row to the longest new-token run, so decode rows sharing a step
        with a long prefill chunk would each pay for the chunk's length: such a batch runs as
        a decode step plus a prefill step instead (also the fallback when live capture is off)."""
        n_rows = len(rows)
        longest = max(n for _, n in rows)
        mixed = longest > 1 and any(n == 1 for _, n in rows)
        if mixed and n_rows * longest > 2 * sum(n for _, n in rows):
            return self._run_groups(rows, self._split(rows))
        try:
            shape = self.resolve(self.shape_for(rows))
        except GraphCaptureDisabled:
            if n_rows == 1:
                raise
            return self._run_groups(rows, [[i] for i in range(n_rows)] if not mixed else self._split(rows))
        return self._run_shape(rows, shape)

    @staticmethod
    def _split(rows) -> list[list[int]]:
        decode = [i for i, (_, n) in enumerate(rows) if n == 1]
        prefill = [i for i, (_, n) in enumerate(rows) if n != 1]
        return [g for g in (decode, prefill) if g]

    def _run_groups(self, rows, groups: list[list[int]]):
        results: list = [None] * len(rows)
        prompt_out: dict[int, tuple] = {}
        for group in groups:
            sub = [rows[i] for i in group]
            res, prompt = self.run(sub) if len(group) < len(rows) else self._run_shape(sub, self.resolve(self.shape_for(sub)))
            for j, i in enumerate(group):
                results[i] = res[j]
                if j in prompt:
                    prompt_out[i] = prompt[j]
        return results, prompt_out

    def _run_shape(self, rows, shape: StepShape):
        work = [RowWork(r.all_ids[r.num_computed : r.num_computed + n], r.num_computed, r.block_ids, r.adapter_slot) for r, n in rows]
        inputs = build_step_inputs(work, self.config.block_size, self.config.num_blocks, shape.tokens, shape.rows, shape.query, shape.blocks)
        last_index = np.zeros(shape.rows, np.int32)
        targets = np.full(shape.tokens, -1, np.int32)
        t = 0
        for i, (r, n) in enumerate(rows):
            last_index[i] = t + n - 1
            if shape.prompt_logprobs and r.params.prompt_logprobs is not None:
                ids = r.all_ids
                for j in range(n):
                    pos = r.num_computed + j
                    if pos + 1 < len(r.prompt_ids):
                        targets[t + j] = ids[pos + 1]
            t += n
        rs = self._sampling_arrays(rows, shape)
        sampled, prompt, self.kv = model_step(self.params, self.kv, inputs, last_index, rs, targets,
                                              self.cfg, shape.flags, shape.prompt_logprobs, self._lora(shape))
        self.compiled.add(shape)
        return self._results(rows, shape, sampled, prompt, targets)

    def _results(self, rows, shape, sampled: Sampled, prompt, targets):
        tokens, lps = np.asarray(sampled.tokens), np.asarray(sampled.logprobs)
        top_ids, top_lps = np.asarray(sampled.top_ids), np.asarray(sampled.top_logprobs)
        results = []
        for i, (r, _) in enumerate(rows):
            k = r.params.logprobs or 0
            top = list(zip(top_ids[i, :k].tolist(), top_lps[i, :k].tolist(), strict=True)) if k else []
            results.append(RowResult(int(tokens[i]), float(lps[i]), top))
        prompt_out = {}
        if prompt is not None:
            target, p_ids, p_lps = (np.asarray(x) for x in prompt)
            t = 0
            for i, (r, n) in enumerate(rows):
                if r.params.prompt_logprobs is not None:
                    sl = slice(t, t + n)
                    prompt_out[i] = (target[sl], p_ids[sl], p_lps[sl], targets[sl])
                t += n
        return results, prompt_out

    def warmup_shapes(self, context_tokens: int, lora: bool = False) -> list[StepShape]:
        """The configured buckets: decode (each row bucket) and single-row prefill (each token
        bucket), for every blocks-per-row bucket up to `context_tokens` of context; with `lora`,
        also the decode buckets of batches that carry adapter rows."""
        B = self.config.block_size
        top = min(_pow2(math.ceil(context_tokens / B)), _pow2(self.max_blocks_per_seq))
        block_buckets = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
        flags = SamplingFlags()
        shapes = [StepShape(s, s, 1, m, flags, False) for s in self.row_buckets for m in block_buckets]
        for t in self.token_buckets:
            shapes += [StepShape(t, 1, t, m, flags, False) for m in block_buckets if m * B >= t]
        if lora and self.lora_slots is not None:
            shapes += [StepShape(s, s, 1, m, flags, False, True) for s in self.row_buckets for m in block_buckets]
        return shapes

    def warm(self, shapes: list[StepShape]) -> None:
        """Compiles the given buckets by running them on padding (writes nothing to the cache)."""
        for shape in shapes:
            if shape in self.compiled:
                continue
            S, T = shape.rows, shape.tokens
            pad_slot = self.config.num_blocks * self.config.block_size
            inputs = StepInputs(np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, pad_slot, np.int32),
                                np.zeros(T, np.int32), np.full((S, shape.query), T, np.int32),
                                np.zeros((S, shape.blocks), np.int32), np.zeros(S, np.int32))
            rs = self._sampling_arrays([], shape)
            if shape.lora:
                self.lora_slots.ensure_state()
            sampled, _, self.kv = model_step(self.params, self.kv, inputs, np.zeros(S, np.int32), rs,
                                             np.full(T, -1, np.int32), self.cfg, shape.flags, shape.prompt_logprobs, self._lora(shape))
            jax.block_until_ready(sampled.tokens)
            self.compiled.add(shape)
