"""Runner: executes one planned batch as one jitted step, and owns the KV state.

It pads the batch into a shape bucket and calls that bucket's executable; it never splits or
reorders what the scheduler planned. Each bucket (tokens T, rows S, query length Q, blocks per
row M, sampling flags and array widths, prompt logprobs, LoRA groups) is one executable
compiled ahead of time: Kiln's graph capture.

Capture does not stall a batch that can run cheaply padded: one whose bucket is not compiled
yet runs in a compiled bucket that fits it at little extra cost while its own compiles in the
background; any other waits for its bucket to compile. When the serving
profile forbids live capture, nothing new compiles: a batch runs in a compiled bucket that
fits or fails with GraphCaptureDisabled (`fits` tells the scheduler beforehand).

A failed step fails only its own rows (RequestFailed, code accelerator_error); one that took
the donated KV state with it is recovered here (`reset_kv`) and the scheduler then recomputes
the running requests. An error that means the device itself is gone (see faults.py) is raised
as DeviceLost instead: nothing runs on this process's accelerator again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch

from kiln.engine.bucket_gate import BucketFailedGate, bigger, check_bucket
from kiln.engine.config import EngineConfig
from kiln.engine.faults import DeviceLossInjector, as_device_lost, first_line, is_device_loss
from kiln.engine.grammar import MaskFiller
from kiln.engine.lora_slots import LoraSlots
from kiln.engine.output import TokenLogprob
from kiln.engine.request import Request
from kiln.engine.routes import XLA, RouteCannotRun, RouteChoice, StepRoute, xla_capabilities
from kiln.engine.sampling import MAX_TOP_LOGPROBS, RowSampling, Sampled, SamplingFlags, sample
from kiln.engine.scheduler import Batch, Rows, StepFailure
from kiln.errors import GraphCaptureDisabled, RequestFailed
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.config import ModelConfig
from kiln.models.decoder import KVCache, StepInputs, forward_hidden, init_kv_cache, logits
from kiln.models.lora import module_shapes

log = logging.getLogger("kiln.engine")

# Step cost model, in FLOP-equivalents, calibrated on XLA:CPU with the default model: a step pays
# a fixed cost (streaming every weight once) worth about 48 tokens of matmuls, each token's
# matmuls, each row's read of its context's K/V (memory-bound: a byte costs about 32 matmul
# FLOPs) and the query-key products.
FIXED_STEP_TOKENS = 48
KV_BYTE_FLOPS = 32
# A batch runs padded in a bigger compiled bucket while its own compiles in the background only
# if that costs at most this much more; otherwise it waits for its own bucket (on a small CPU a
# background compile also slows the steps it overlaps).
CHEAP_PADDING = 1.25
# Prefill and mixed steps pad each row's new tokens to at least 32 query positions and its context
# to at least 4 blocks: their matmuls over all T tokens dominate, so the padding costs little, and
# far fewer distinct steps need compiling (several seconds each on a CPU).
PREFILL_MIN_QUERY = 32
PREFILL_MIN_BLOCKS = 4
# The share of the process's memory-mapping limit (vm.max_map_count) that compiled steps may use.
MAPPING_SHARE = 0.7


class StepShape(NamedTuple):
    tokens: int
    rows: int
    query: int
    blocks: int
    flags: SamplingFlags
    prompt_logprobs: bool
    lora: int = 0  # adapter groups (distinct adapters) the step applies; 0: none
    widths: tuple[int, int, int, int] = (1, 1, 1, 1)  # logit bias, banned ids, output and prompt history

    def fits(self, other: StepShape) -> bool:
        """True if a batch of shape `other` can run padded to this shape."""
        same = (self.flags, self.prompt_logprobs) == (other.flags, other.prompt_logprobs)
        return same and all(a >= b for a, b in zip(self[:4] + self.widths, other[:4] + other.widths, strict=True)) and (
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


def _forward(params, kv, inputs, last_index, prompt_targets, lora, cfg, with_prompt_logprobs):
    """The forward pass: each row's last logits, prompt logprobs if asked, and the new KV."""
    hidden, kv = forward_hidden(params, kv, inputs, cfg, lora)
    with jax.named_scope("lm_head"):
        row_logits = logits(params, hidden[last_index])
    prompt = None
    if with_prompt_logprobs:
        lp = jax.nn.log_softmax(logits(params, hidden), axis=-1)
        target = jnp.take_along_axis(lp, jnp.maximum(prompt_targets, 0)[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]))
        prompt = PromptLogprobs(target, top_ids.astype(jnp.int32), top_lp)
    return row_logits, prompt, kv


@functools.partial(jax.jit, static_argnames=("cfg", "flags", "with_prompt_logprobs"), donate_argnames=("kv",))
def model_step(params, kv: KVCache, inputs: StepInputs, last_index, rs: RowSampling, prompt_targets, lora, *,
               cfg: ModelConfig, flags: SamplingFlags, with_prompt_logprobs: bool):
    """Forward + on-device sampling; only sampled ids and requested logprobs leave the device."""
    with _trace_lock:
        COUNTER.traces += 1  # runs at trace time only
    row_logits, prompt, kv = _forward(params, kv, inputs, last_index, prompt_targets, lora, cfg, with_prompt_logprobs)
    with jax.named_scope("sampling"):
        sampled = sample(row_logits, rs, flags)
    return sampled, prompt, kv


@functools.partial(jax.jit, static_argnames=("cfg", "with_prompt_logprobs"), donate_argnames=("kv",))
def forward_step(params, kv, inputs: StepInputs, last_index, prompt_targets, lora, *, cfg: ModelConfig,
                 with_prompt_logprobs: bool):
    """The forward half of a masked step: its logits stay on the device for sample_step."""
    with _trace_lock:
        COUNTER.traces += 1
    return _forward(params, kv, inputs, last_index, prompt_targets, lora, cfg, with_prompt_logprobs)


@functools.partial(jax.jit, static_argnames=("flags",))
def sample_step(row_logits, rs: RowSampling, *, flags: SamplingFlags) -> Sampled:
    return sample(row_logits, rs, flags)


class MaskedStep:
    """A step whose rows follow grammars, run in two executables: while the forward pass runs
    (dispatched asynchronously), the host computes the rows' token masks; sampling then
    applies them."""

    def __init__(self, forward, sampler):
        self.forward, self.sampler = forward, sampler

    def __call__(self, params, kv, inputs, last_index, rs: RowSampling, targets, lora, masks: Callable[[], np.ndarray]):
        row_logits, prompt, kv = self.forward(params, kv, inputs, last_index, targets, lora)
        return self.sampler(row_logits, rs._replace(allowed=masks())), prompt, kv


def _abstract(x):
    """What a compile needs to know of an array: shape, dtype and placement."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _read_max_mappings() -> int:
    try:
        return int(open("/proc/sys/vm/max_map_count").read())
    except (OSError, ValueError):  # not Linux: no such limit known
        return 1 << 30


_MAX_MAPPINGS = _read_max_mappings()


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _describe(s: StepShape) -> str:
    extra = [name for name, on in (*s.flags._asdict().items(), ("prompt_logprobs", s.prompt_logprobs)) if on]
    extra += [f"lora={s.lora}"] * bool(s.lora) + [f"widths={s.widths}"] * (s.widths != (1, 1, 1, 1))
    return f"T={s.tokens} S={s.rows} Q={s.query} M={s.blocks}" + "".join(f" {e}" for e in extra)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    return 1 << (n - 1).bit_length()


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def block_bucket(n: int) -> int:
    """Blocks per row, rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: two buckets per octave,
    so padding is at most a third of the attention a decode row pays for."""
    b = 1
    while b < n:
        b = 2 if b == 1 else b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return b


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
                 eos_ids: tuple[int, ...], lora_slots: LoraSlots, kv_dtype: str = "float32",
                 route: StepRoute = XLA):
        self.cfg = cfg
        self.route = route
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
        self.executables: collections.OrderedDict[StepShape, Callable] = collections.OrderedDict()  # LRU first
        self._map_samples: list[int] = []  # memory mappings the first executables added
        self._capturing: dict[StepShape, concurrent.futures.Future] = {}  # compiling in the background
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-capture")
        self.abstract = jax.tree.map(_abstract, (params, self.kv))  # what compiles see of params and KV
        self.padded_steps = 0  # steps run in a bigger compiled bucket while theirs compiled
        self.gate_failed: dict[StepShape, str] = {}  # IREE buckets that failed their correctness gate, and why
        self.quarantined: str | None = None  # the route an accelerator failure took out of service, and why
        self.masks = MaskFiller()
        self.device_loss = DeviceLossInjector(config.inject_device_loss_after_steps)  # [debug] fault injection
        layer_params = sum(i * o for i, o in module_shapes(cfg).values())
        self.flops_per_token = 2 * cfg.num_layers * layer_params
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv_dtype.itemsize
        self.flops_per_key_read = kv_bytes * KV_BYTE_FLOPS
        self.flops_per_query_key = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim

    @property
    def compiled(self) -> set[StepShape]:
        return set(self.executables)

    @property
    def capturing(self) -> int:
        """Buckets still compiling in the background."""
        return sum(not f.done() for f in self._capturing.values())

    def reset_kv(self) -> None:
        """A fresh, empty KV state (after a failed step consumed the donated one)."""
        self.kv = init_kv_cache(self.cfg, self.num_blocks, self.block_size, self.kv_dtype)

    def installed_buckets(self) -> list[tuple[StepShape, dict | None]]:
        """The compiled buckets with their LoRA argument as compiles see it (engine thread)."""
        return [(s, self._lora_abstract(s)) for s in self.executables]

    def compile_for_pool(self, num_blocks: int, buckets: list[tuple[StepShape, dict | None]]
                         ) -> dict[StepShape, Callable]:
        """The executables of these buckets for a KV pool of `num_blocks` (any thread: a resize
        compiles ahead, so serving never waits for it)."""
        params, kv = self.abstract
        kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], num_blocks, *a.shape[2:]), a.dtype,
                                                         sharding=a.sharding), kv)
        return {s: self._compile(s, lora, (params, kv)) for s, lora in buckets}

    def resize_kv(self, num_blocks: int, moves: dict[int, int], executables: dict[StepShape, Callable]) -> None:
        """Gives the KV pool `num_blocks` blocks (engine thread, under writer ownership): the moved
        blocks' K/V are copied first, then the pool is cut or padded with empty blocks. The step
        executables of the old pool size are dropped for `executables`, compiled for the new."""
        for future in self._capturing.values():
            future.cancel()
        self._capturing.clear()
        if self.route.is_iree:  # resized with XLA on the host; the next step uploads it again
            self.kv = KVCache(*(jnp.asarray(self.route.device.to_host(x)) for x in self.kv))

        def resized(x: jax.Array) -> jax.Array:
            if moves:
                src, dst = np.fromiter(moves, np.int32), np.fromiter(moves.values(), np.int32)
                x = x.at[:, dst].set(x[:, src])
            if num_blocks <= x.shape[1]:
                y = x[:, :num_blocks]
            else:
                y = jnp.concatenate([x, jnp.zeros((x.shape[0], num_blocks - x.shape[1], *x.shape[2:]), x.dtype)], 1)
            return jax.device_put(y, x.sharding)

        self.kv = jax.tree.map(resized, self.kv)
        jax.block_until_ready(self.kv)
        self.num_blocks = num_blocks
        self.abstract = (self.abstract[0], jax.tree.map(_abstract, self.kv))
        self.executables.clear()
        jax.clear_caches()  # JAX's own caches hold the old pool's executables too
        for shape, executable in executables.items():
            self._install(shape, executable)

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)

    # ---- shapes ------------------------------------------------------------------------

    def shape_for(self, rows: Rows) -> StepShape:
        n_rows = len(rows)
        total = sum(n for _, n in rows)
        S = _bucket(n_rows, self.row_buckets)
        decode = all(n == 1 for _, n in rows)
        if decode:
            T, Q = S, 1
        else:
            T = _bucket(total, self.token_buckets)
            Q = min(max(_pow2(max(n for _, n in rows)), PREFILL_MIN_QUERY), T)
        M = self._blocks(max(len(r.block_ids) for r, _ in rows), prefill=not decode)
        params = [r.params for r, _ in rows]
        flags = SamplingFlags(
            penalties=any(p.needs_penalties for p in params),
            filtering=any(p.needs_filtering for p in params),
            top_logprobs=any((p.logprobs or 0) > 0 for p in params),
            mask=any(r.matcher is not None or r.forced for r, _ in rows),
        )
        prompt_lp = any(r.params.prompt_logprobs is not None and r.in_prefill for r, _ in rows)
        adapters = len({r.adapter_slot for r, _ in rows if r.adapter_slot})
        lora = min(_pow2(adapters), self.lora_slots.n_slots) if adapters else 0
        widths = (_pow2(max(len(r.params.logit_bias or ()) for r, _ in rows)),
                  _pow2(max(len(self._banned(r)) for r, _ in rows)),
                  _pow2(max(len(r.output_ids) for r, _ in rows), 8) if flags.penalties else 1,
                  _pow2(max(len(r.prompt_ids) for r, _ in rows), 8) if flags.penalties else 1)
        return StepShape(T, S, Q, M, flags, prompt_lp, lora, widths)

    def _blocks(self, blocks: int, prefill: bool) -> int:
        """The blocks-per-row bucket of a step whose longest row holds `blocks` blocks."""
        return min(block_bucket(max(blocks, PREFILL_MIN_BLOCKS if prefill else 1)),
                   block_bucket(self.max_blocks_per_seq))

    def resolve(self, shape: StepShape) -> StepShape:
        """The bucket to run a batch of this shape in, now: its own when compiled; else a compiled
        one that fits at little extra cost (capturing its own in the background); else its own,
        compiled now. With live capture off: the cheapest compiled one that fits, or
        GraphCaptureDisabled."""
        self._install_captured()
        passing = self._passing(shape)
        if passing is None:
            raise RouteCannotRun(f"no step bucket of the {self.route.name} route that fits this batch passed its "
                                 f"correctness gate ({self.gate_failed[shape]})")
        shape = passing
        if shape in self.executables:
            return shape
        fitting = [s for s in self.executables if s.fits(shape)]
        best = min(fitting, key=self._shape_cost, default=None)
        if not self.config.allow_live_capture:
            if best is None:
                raise GraphCaptureDisabled(
                    f"no compiled step bucket fits tokens={shape.tokens} rows={shape.rows} "
                    f"query={shape.query} blocks={shape.blocks}, and live graph capture is disabled")
            return best
        if best is not None and self._shape_cost(best) <= CHEAP_PADDING * self._shape_cost(shape):
            if shape not in self._capturing:
                self._capturing[shape] = self._compiler.submit(self._compile, shape, self._lora_abstract(shape))
                log.info("capturing step bucket %s in the background; meanwhile its batches run in %s",
                         _describe(shape), _describe(best))
            self.padded_steps += 1
            return best
        pending = self._capturing.pop(shape, None)
        t0 = time.perf_counter()
        try:
            self._install(shape, pending.result() if pending else self._compile(shape, self._lora_abstract(shape)))
        except BucketFailedGate as exc:
            self._gate_failed(exc)
            return self.resolve(shape)
        log.info("captured step bucket %s in %.1fs (the step waited)", _describe(shape), time.perf_counter() - t0)
        return shape

    def _passing(self, shape: StepShape) -> StepShape | None:
        """The bucket a batch of this shape may run in as far as the correctness gates know: its
        own, else the next bigger one where its own failed; None when every one that fits failed."""
        while shape is not None and shape in self.gate_failed:
            shape = bigger(shape, self.row_buckets)
        return shape

    def fits(self, rows: Rows) -> bool:
        """Whether the rows can run as one step: not when every bucket that fits them failed its
        correctness gate (the scheduler splits them); else always with live capture, else in a
        compiled bucket."""
        shape = self.shape_for(rows)
        if self._passing(shape) is None:
            return False
        if self.config.allow_live_capture:
            return True
        return any(s.fits(shape) for s in self.executables)

    def step_cost(self, rows: Rows) -> float:
        """Estimated cost of running the rows as one step, padding included (see the cost model above)."""
        return self._shape_cost(self.shape_for(rows))

    def _shape_cost(self, s: StepShape) -> float:
        keys = s.rows * s.blocks * self.block_size
        return ((s.tokens + FIXED_STEP_TOKENS) * self.flops_per_token + keys * self.flops_per_key_read
                + keys * s.query * self.flops_per_query_key)

    # ---- compiling -----------------------------------------------------------------------

    def _lora_abstract(self, shape: StepShape) -> dict | None:
        """The LoRA argument as a compile sees it (engine thread: the slot state is its own)."""
        if not shape.lora:
            return None
        return {**jax.tree.map(_abstract, self.lora_slots.ensure_state()), "active": np.zeros(shape.lora, np.int32)}

    def _compile(self, shape: StepShape, lora: dict | None, abstract=None) -> Callable:
        """The executable of one bucket (any thread; the persistent compilation cache applies)."""
        params, kv = abstract or self.abstract
        inputs, last_index, rs, targets = self.padding_inputs(shape)
        if self.route.is_iree:
            executable = self._compile_iree(shape, params, kv, inputs, last_index, rs, targets, lora)
            if abstract is None and (why := check_bucket(self, shape, executable, lora)):
                raise BucketFailedGate(shape, why)
            return executable
        before = _mapped_regions()
        if shape.flags.mask:
            forward = forward_step.lower(params, kv, inputs, last_index, targets, lora, cfg=self.cfg,
                                         with_prompt_logprobs=shape.prompt_logprobs).compile()
            row_logits = jax.ShapeDtypeStruct((shape.rows, self.cfg.vocab_size), jnp.float32)
            executable = MaskedStep(forward, sample_step.lower(row_logits, rs, flags=shape.flags).compile())
        else:
            executable = model_step.lower(params, kv, inputs, last_index, rs, targets, lora, cfg=self.cfg,
                                          flags=shape.flags, with_prompt_logprobs=shape.prompt_logprobs).compile()
        if len(self._map_samples) < 3:
            self._map_samples.append(_mapped_regions() - before)
        return executable

    def _compile_iree(self, shape: StepShape, params, kv, inputs, last_index, rs, targets, lora) -> Callable:
        """The bucket on an IREE route: one module, or the forward pass on the device and sampling
        with XLA on the host where the device's sampling cannot be trusted (see routes.py)."""
        route = self.route
        if shape.prompt_logprobs and not route.gate("top_k"):
            raise RouteCannotRun(f"prompt logprobs are not available on the {route.name} route: its top-k "
                                 "failed the correctness gate")
        host_sampling = (shape.flags.mask or (shape.flags.filtering and not route.gate("sort"))
                         or (shape.flags.top_logprobs and not route.gate("top_k")))
        static = {"cfg": self.cfg, "with_prompt_logprobs": shape.prompt_logprobs}
        if not host_sampling:
            return route.compile(model_step, (params, kv, inputs, last_index, rs, targets, lora),
                                 {**static, "flags": shape.flags}, device_outputs=(2,))
        from kiln.iree.step import HostSampling

        forward = route.compile(forward_step, (params, kv, inputs, last_index, targets, lora), static,
                                device_outputs=(0, 2))
        row_logits = jax.ShapeDtypeStruct((shape.rows, self.cfg.vocab_size), jnp.float32)
        sampler = HostSampling(route.device, sample_step.lower(row_logits, rs, flags=shape.flags).compile())
        masked = MaskedStep(forward, sampler)
        if shape.flags.mask:
            return masked
        return lambda params, kv, inputs, last_index, rs, targets, lora: masked(
            params, kv, inputs, last_index, rs, targets, lora, masks=lambda: rs.allowed)

    def _gate_failed(self, exc: BucketFailedGate) -> None:
        self.gate_failed[exc.shape] = exc.why
        log.warning("route %s: step bucket %s failed its correctness gate (%s); its batches run padded in a "
                    "bigger bucket", self.route.name, _describe(exc.shape), exc.why)

    def compile_bucket(self, shape: StepShape) -> Callable:
        """Compiles one bucket without keeping it (`kiln warmup`: the persistent cache keeps it)."""
        return self._compile(shape, self._lora_abstract(shape))

    def _install(self, shape: StepShape, executable: Callable) -> None:
        """Keeps an executable, evicting the least recently used ones beyond what the process may
        map: each executable holds hundreds of memory mappings (its compiled kernels) and the
        kernel caps a process's mappings (vm.max_map_count); an evicted bucket is reloaded from
        the persistent compilation cache when needed again."""
        self.executables[shape] = executable
        keep = max(8, int(MAPPING_SHARE * _MAX_MAPPINGS) // max([1, *self._map_samples]))
        if len(self.executables) > keep:
            while len(self.executables) > keep * 3 // 4:  # evict a batch: clearing JAX's caches costs retraces
                evicted, _ = self.executables.popitem(last=False)
                log.info("evicted step bucket %s (at most %d are kept)", _describe(evicted), keep)
            jax.clear_caches()  # JAX's own caches hold the evicted executables too

    def _install_captured(self) -> None:
        for shape, future in list(self._capturing.items()):
            if future.done():
                del self._capturing[shape]
                try:
                    self._install(shape, future.result())
                except BucketFailedGate as exc:
                    self._gate_failed(exc)
                except Exception:  # the bucket stays uncaptured; batches keep running padded
                    log.exception("compiling step bucket %s failed", shape)

    def warm(self, shapes: list[StepShape], workers: int = 1) -> None:
        """Compiles the given buckets now, `workers` at a time (or loads them from the persistent
        compilation cache)."""
        todo = [(s, self._lora_abstract(s)) for s in dict.fromkeys(shapes) if s not in self.executables]

        def compile_one(job):
            try:
                return self._compile(*job)
            except BucketFailedGate as exc:
                return exc

        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kiln-warm") as pool:
            for (shape, _), executable in zip(todo, pool.map(compile_one, todo), strict=True):
                if isinstance(executable, BucketFailedGate):
                    self._gate_failed(executable)
                else:
                    self._install(shape, executable)

    def warmup_shapes(self, context_tokens: int, lora: bool = False) -> list[StepShape]:
        """The configured buckets: decode (each row bucket) and single-row prefill (each token
        bucket), for every blocks-per-row bucket up to `context_tokens` of context; with `lora`,
        also the decode buckets of batches that carry one adapter."""
        top = min(block_bucket(math.ceil(context_tokens / self.block_size)), block_bucket(self.max_blocks_per_seq))
        block_buckets = sorted({block_bucket(m) for m in range(1, top + 1)})
        flags = SamplingFlags()
        shapes = [StepShape(s, s, 1, m, flags, False) for s in self.row_buckets for m in block_buckets]
        for t in self.token_buckets:
            prefill_blocks = {self._blocks(m, prefill=True) for m in block_buckets if m * self.block_size >= t}
            shapes += [StepShape(t, 1, t, m, flags, False) for m in sorted(prefill_blocks)]
        if lora:
            shapes += [StepShape(s, s, 1, m, flags, False, 1) for s in self.row_buckets for m in block_buckets]
        return shapes

    def fallback_shapes(self, context_tokens: int) -> list[StepShape]:
        """Buckets that every plain decode batch and single-prompt prefill up to `context_tokens`
        can run padded in while their own buckets compile: one decode bucket per row bucket and
        one prefill bucket per token bucket, each with room for the whole context."""
        blocks = min(block_bucket(math.ceil(context_tokens / self.block_size)), block_bucket(self.max_blocks_per_seq))
        flags = SamplingFlags()
        return ([StepShape(s, s, 1, blocks, flags, False) for s in self.row_buckets]
                + [StepShape(t, 1, t, self._blocks(max(blocks, math.ceil(t / self.block_size)), prefill=True), flags,
                             False) for t in self.token_buckets])

    # ---- inputs ------------------------------------------------------------------------

    def padding_inputs(self, shape: StepShape) -> tuple[StepInputs, np.ndarray, RowSampling, np.ndarray]:
        """Inputs of an all-padding batch of this shape (what a compile sees)."""
        S, T = shape.rows, shape.tokens
        inputs = StepInputs(np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32),
                            np.zeros(T, np.int32), np.full((S, shape.query), T, np.int32),
                            np.zeros((S, shape.blocks), np.int32), np.zeros(S, np.int32))
        return inputs, np.zeros(S, np.int32), self._sampling_arrays([], shape), np.full(T, -1, np.int32)

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
        kb, kn, p_out, p_in = shape.widths
        bias_ids, bias_values = np.full((S, kb), V, np.int32), np.zeros((S, kb), np.float32)
        banned_ids = np.full((S, kn), V, np.int32)
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
        # a masked step gets its masks while its forward pass runs (MaskedStep); compiles see zeros
        allowed = np.zeros((S, (V + 31) // 32 if shape.flags.mask else 0), np.int32)
        return RowSampling(temperature, top_k, top_p, min_p, presence, frequency, repetition, seed, step,
                           bias_ids, bias_values, banned_ids, output_ids, prompt_ids, allowed)

    def _masks(self, rows: Rows, shape: StepShape) -> np.ndarray:
        """The rows' allowed-token bitmasks: their grammars', or only their next forced token."""
        constrained = [(r.matcher, i) for i, (r, _) in enumerate(rows) if r.matcher is not None]
        allowed = self.masks.fill(constrained, shape.rows, self.cfg.vocab_size)
        for i, (r, _) in enumerate(rows):
            if r.forced:
                allowed[i] = 0
                allowed[i, r.forced[0] // 32] = np.uint32(1 << (r.forced[0] % 32)).view(np.int32)
        return allowed

    def _banned(self, r: Request) -> list[int]:
        """Stop tokens are masked until min_tokens have been generated (not in constrained rows:
        their grammar decides when they may end)."""
        if len(r.output_ids) >= r.params.min_tokens or r.matcher is not None or r.forced:
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
        """Runs one planned batch; a failure fails its rows, never the process. Raises DeviceLost
        when the error says the device is gone."""
        rows = batch.rows
        own = self.shape_for(rows)
        try:
            shape = self.resolve(own)
        except (GraphCaptureDisabled, RouteCannotRun) as exc:
            # a batch whose buckets just failed their gates runs again split (see fits); one row cannot
            return StepFailure(exc, retry=len(rows) > 1 and self._passing(own) is None)
        try:
            result = self._run(rows, shape)
        except Exception as exc:
            if is_device_loss(exc):
                raise as_device_lost(exc) from exc
            log.exception("step failed")
            kv_lost = self.route.is_iree or self.kv.k.is_deleted()  # IREE consumed it in place
            if self.route.is_iree:
                self._quarantine_route(exc)
            if kv_lost:
                self.reset_kv()
            return StepFailure(RequestFailed(f"the accelerator step failed: {type(exc).__name__}",
                                             code="accelerator_error"), kv_lost)
        self.device_loss.step_succeeded()
        return result

    def _quarantine_route(self, exc: Exception) -> None:
        """An accelerator failure on an IREE route takes that route out of service for the life of
        the process: later steps run on XLA (on the host), every compiled IREE bucket and the
        device's copies of the weights are dropped. XLA itself is the route of last resort: its
        failures fail their requests only."""
        failed, why = self.route, first_line(exc)
        self.quarantined = f"{failed.name}: {why}"
        log.error("route %s quarantined after an accelerator failure (%s); serving goes on with XLA on %s until "
                  "a restart", failed.name, why, jax.default_backend())
        for future in self._capturing.values():
            future.cancel()
        self._capturing.clear()
        self.executables.clear()
        self.gate_failed.clear()
        if failed.resident is not None:
            failed.resident.clear()
        self.route = StepRoute(RouteChoice(
            "xla", f"fallback: route {failed.name} was quarantined after an accelerator failure ({why})",
            xla_capabilities(), {}))

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
        step = self.executables[shape]
        self.executables.move_to_end(shape)
        args = (self.params, self.kv, inputs, last_index, rs, targets, self._lora(rows, shape))
        self.device_loss.before_step()
        if shape.flags.mask:
            sampled, prompt, self.kv = step(*args, masks=lambda: self._masks(rows, shape))
        else:
            sampled, prompt, self.kv = step(*args)
        return StepResult(rows, sampled, prompt, targets)


