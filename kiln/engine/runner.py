"""Runner: executes one planned batch as one step of the bounded executable set, and owns the KV state.

It lays the batch out in the smallest step bucket that fits it (see buckets.py), dispatches that
bucket's forward executable, computes grammar masks on the host while the forward pass runs,
then dispatches the sampler of the bucket's row count (`dispatch`); `fetch` brings the sampled
rows to the host. Between the two the host is free: the engine plans and lays out the next step
while this one runs, whose rows may take their last token from this step's sampler on the device
(a `TokenFeed`). It never splits or reorders what the scheduler planned.

The whole set is built (or loaded from disk, see executables.py) by `warm` before a server
reports ready (what the serving profile calls graph capture). An engine used without warming
(tests, scripts) builds a step's executable the first time it needs it, which only live compiling
allows; when the serving profile forbids it, nothing new compiles: a batch runs in a built bucket
that fits or fails with GraphCaptureDisabled (`fits` tells the scheduler beforehand).

A failed step fails only its own rows (RequestFailed, code accelerator_error); one that took
the donated KV state with it (any failure found when its results are fetched: the steps
dispatched after it ran on that state too) is recovered here (`reset_kv`) and the scheduler
then recomputes the running requests. An error that means the device itself is gone (see faults.py) is raised
as DeviceLost instead: nothing runs on this process's accelerator again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kiln.engine.backends import XLA, Backend, BackendChoice, xla_capabilities
from kiln.engine.bucket_gate import BucketFailedGate, check_bucket, gate_signature
from kiln.engine.buckets import BucketSet, StepBucket
from kiln.engine.config import EngineConfig
from kiln.engine.executables import ExecutableStore, executable_key
from kiln.engine.faults import DeviceLossInjector, as_device_lost, first_line, is_device_loss
from kiln.engine.host_memory import release_pages
from kiln.engine.lora_slots import LoraSlots
from kiln.engine.request import Request
from kiln.engine.step_inputs import StepLayout
from kiln.engine.step_types import Batch, PendingStep, Rows, StepFailure, StepResult
from kiln.engine.steps import (
    COUNTER,
    TokenFeed,
    forward_sample_step,
    forward_step,
    on_mesh,
    prompt_logprobs_step,
    sample_step,
)
from kiln.errors import BackendCannotRun, GraphCaptureDisabled, RequestFailed
from kiln.kernels import cpu as kernels
from kiln.models.config import ModelConfig
from kiln.models.decoder import CHUNK_KEYS, FIRST_KEYS, KVCache, init_kv_cache, table_width
from kiln.models.lora import EXPERT_MODULES, module_shapes
from kiln.models.paged_attention import kernel_for
from kiln.models.sharding import kv_sharding, replicated

__all__ = ["COUNTER", "Runner", "SamplerKey", "StepBucket"]

log = logging.getLogger("kiln.engine")

# Step cost model, in FLOP-equivalents, calibrated on XLA:CPU with the default model: a step pays
# a fixed cost (streaming every weight once) worth about 48 tokens of matmuls, each token's
# matmuls, each tile's read of its context's K/V (memory-bound: a byte costs about 32 matmul
# FLOPs) and the query-key products.
FIXED_STEP_TOKENS = 48
KV_BYTE_FLOPS = 32
FIRST_CONTACT_TOKENS = 64  # a short chat turn's prompt: its prefill steps are primed before ready


def _abstract(x):
    """What a compile needs to know of an array: shape, dtype and placement."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@dataclasses.dataclass(frozen=True)
class PromptLogprobsKey:
    """Prompt logprobs of a T-token step's hidden states, with XLA on the host (IREE routes)."""

    tokens: int

    def describe(self) -> str:
        return f"prompt logprobs tokens={self.tokens}"


@dataclasses.dataclass(frozen=True)
class SamplerKey:
    """The sampler of R rows (XLA; on an IREE route it samples on the host what the device may not)."""

    rows: int

    def describe(self) -> str:
        return f"sampler rows={self.rows}"


class Runner:
    def __init__(self, cfg: ModelConfig, params, config: EngineConfig, max_model_len: int,
                 eos_ids: tuple[int, ...], lora_slots: LoraSlots, kv_dtype: str = "float32",
                 backend: Backend = XLA, mesh: jax.sharding.Mesh | None = None):
        self.cfg = cfg
        self.backend = backend
        # a tensor-parallel mesh (params arrive sharded): the KV pool is sharded too, and every other
        # input and output of a step is replicated over it
        self.mesh = mesh
        self.step_fns = ((forward_step, sample_step) if mesh is None
                         else on_mesh(kv_sharding(cfg, mesh), replicated(mesh)))
        # Kiln's CPU kernels (decode attention, quantized products): registered before any step
        # is traced or loaded
        self.cpu_kernels = kernels.wanted(config.cpu_kernels, backend.is_iree, mesh) and kernels.enable()
        # the paged attention's kernel: XLA's on IREE routes (over a mesh, Pallas's runs per device on its
        # KV heads: the steps compile under the mesh, see _compile_xla)
        self.attention = ("xla" if backend.is_iree else
                          kernel_for(config.attention, head_dim=cfg.head_dim, block_size=config.block_size,
                                     cpu_kernels=self.cpu_kernels))
        self.params = params
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks
        self.eos_ids = eos_ids
        self.lora_slots = lora_slots
        self.kv_dtype = jnp.dtype(kv_dtype)
        self.kv = self._empty_kv()
        self.buckets = BucketSet(config.decode_row_buckets, config.prefill_token_buckets, config.max_num_seqs,
                                 config.max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.table_columns = table_width(self.max_blocks_per_seq, self.block_size)
        # a TokenFeed holds the largest sampler's rows
        self.layout = StepLayout(cfg, self.block_size, self.table_columns, max_model_len, eos_ids,
                                 feed_rows=max(self.buckets.sampler_rows))
        self._empty_feed: jax.Array | None = None
        self.forwards: dict[StepBucket, Callable] = {}
        self.unprimed: set[StepBucket] = set()  # installed forward steps that have not run yet (see `prime`)
        # samplers and (IREE routes) prompt-logprob steps: small, one per row or token count
        self.auxiliary: dict[SamplerKey | PromptLogprobsKey, Callable] = {}
        # over several processes each compiles its steps (a stored one would load onto this process's devices)
        self.store = ExecutableStore.beside_jax_cache() if jax.process_count() == 1 else ExecutableStore(None)
        # a server over several processes: process 0's StepMirror, which the others' engines repeat (step_mirror.py)
        self.mirror = None
        self.abstract = jax.tree.map(_abstract, (params, self.kv))  # what compiles see of params and KV
        self.compile_waits = 0  # steps that waited for their executable to compile (none once warmed)
        self.deferred: list[StepBucket] = []  # LoRA steps a start left for the first adapter to build
        self.gate_failed: dict[StepBucket, str] = {}  # IREE buckets that failed their correctness gate, and why
        self.quarantined: str | None = None  # the route an accelerator failure took out of service, and why
        self.device_loss = DeviceLossInjector(config.inject_device_loss_after_steps)  # [debug] fault injection
        self._install_lock = threading.Lock()
        self._gate_lock = threading.Lock()
        layer_params = sum(i * o for m, (i, o) in module_shapes(cfg).items() if m not in EXPERT_MODULES)
        if cfg.num_experts:  # the router and the token's experts
            experts = 3 * cfg.experts_per_token * cfg.expert_intermediate_size
            layer_params += cfg.hidden_size * (cfg.num_experts + experts)
        self.flops_per_token = 2 * cfg.num_layers * layer_params
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv_dtype.itemsize
        self.flops_per_key_read = kv_bytes * KV_BYTE_FLOPS
        self.flops_per_query_key = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim

    # ---- the executable set ------------------------------------------------------------------

    def executable_set(self) -> list[StepBucket | SamplerKey]:
        """Every executable this engine's steps can use: forward buckets and samplers (on an IREE
        route each forward bucket samples too, and prompt logprobs run on the host)."""
        keys = [*self.buckets.forwards, *(SamplerKey(r) for r in self.buckets.sampler_rows)]
        if self.backend.is_iree:
            keys += [PromptLogprobsKey(b.tokens) for b in self.buckets.base if b.kind == "prefill"]
        return keys

    def startup_set(self, defer_lora: bool) -> list[StepBucket | SamplerKey]:
        """What a start builds: the whole set, or (`defer_lora`) all but the LoRA steps, which it records
        in `deferred` for the first adapter to build (`build_deferred`)."""
        if not defer_lora:
            return self.executable_set()
        self.deferred = [b for b in self.buckets.forwards if b.lora and b not in self.forwards]
        return [k for k in self.executable_set() if k not in self.deferred]

    def build_deferred(self) -> tuple[int, dict[StepBucket, Callable]]:
        """Builds (or loads) the steps a start deferred, for the current pool (any thread: serving goes
        on meanwhile); returns the pool size they are for, and them, for `install_deferred`."""
        num_blocks, abstract, built = self.num_blocks, self.abstract, {}
        if self.mirror is not None:
            self.mirror.build(self.deferred)
        for bucket in list(self.deferred):
            try:
                built[bucket] = self._compile_forward(bucket, abstract)  # IREE: gated as at start
            except BucketFailedGate as exc:
                built[bucket] = exc
        return num_blocks, built

    def install_deferred(self, num_blocks: int, built: dict[StepBucket, Callable | BucketFailedGate]) -> bool:
        """Installs what `build_deferred` built (engine thread); False when the pool was resized since."""
        if num_blocks != self.num_blocks:
            return False
        for bucket, executable in built.items():
            if isinstance(executable, BucketFailedGate):
                self._gate_failed(executable)
            else:
                self._install(bucket, executable)
        self.deferred = []
        return True

    @property
    def executables(self) -> dict:
        """The built executables of the set, by forward bucket or sampler key."""
        return {**self.forwards, **self.auxiliary}

    @property
    def compiled(self) -> set:
        return set(self.executables)

    def warm(self, keys: list | None = None, workers: int = 1, progress: Callable[[object], None] | None = None
             ) -> None:
        """Builds (or loads from disk) the given executables, default the whole set, `workers` at a time;
        `progress(key)` after each."""
        todo = [k for k in (self.executable_set() if keys is None else keys) if k not in self.executables]
        if self.mirror is not None:
            self.mirror.build(todo)

        def build(key):
            try:
                return self._build(key)
            except BucketFailedGate as exc:
                return exc

        with concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="kiln-warm") as pool:
            for key, executable in zip(todo, pool.map(build, todo), strict=True):
                if isinstance(executable, BucketFailedGate):
                    self._gate_failed(executable)
                else:
                    self._install(key, executable)
                if progress is not None:
                    progress(key)

    def mapped_regions(self) -> int:
        """Memory mappings the process holds now (each loaded CPU executable holds hundreds)."""
        return _mapped_regions()

    def _install(self, key, executable) -> None:
        with self._install_lock:
            if isinstance(key, StepBucket):
                self.forwards[key] = executable
                if not self.backend.is_iree:
                    self.unprimed.add(key)
            else:
                self.auxiliary[key] = executable

    def _build(self, key) -> Callable:
        if isinstance(key, StepBucket):
            return self._compile_forward(key)
        if isinstance(key, PromptLogprobsKey):
            hidden = jax.ShapeDtypeStruct((key.tokens, self.cfg.hidden_size), jnp.float32)
            targets = jax.ShapeDtypeStruct((key.tokens,), jnp.int32)
            return self._compile_xla("prompt_logprobs", prompt_logprobs_step, (self.abstract[0], hidden, targets),
                                     {"cfg": self.cfg}, key)
        return self._compile_sampler(key)

    # ---- KV state ----------------------------------------------------------------------------

    def _empty_kv(self) -> KVCache:
        """A zeroed pool. On the CPU its pages go back to the OS array by array (so a start never
        holds all of it), and come back as steps write blocks: resident memory follows the KV in use."""
        shapes = jax.eval_shape(lambda: init_kv_cache(self.cfg, self.num_blocks, self.block_size, self.kv_dtype))

        def zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
            if self.mesh is None:
                x = jnp.zeros(shape.shape, shape.dtype)
            else:  # each device fills its own shard
                sharding = kv_sharding(self.cfg, self.mesh)
                x = jax.jit(lambda: jnp.zeros(shape.shape, shape.dtype), out_shardings=sharding)()
            release_pages([x.block_until_ready()])
            return x

        return KVCache(*(zeros(s) for s in shapes))

    def reset_kv(self) -> None:
        """A fresh, empty KV state (after a failed step consumed the donated one)."""
        if self.mirror is not None:
            self.mirror.send("reset_kv")
        self.kv = self._empty_kv()

    def installed_buckets(self) -> list[StepBucket]:
        """The forward buckets built for the current pool (engine thread)."""
        return list(self.forwards)

    def compile_for_pool(self, num_blocks: int, buckets: list[StepBucket]) -> dict[StepBucket, Callable]:
        """The forward executables of these buckets for a KV pool of `num_blocks` (any thread: a resize
        builds them ahead, so serving never waits for it). Samplers do not depend on the pool."""
        params, kv = self.abstract
        kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], a.shape[1], num_blocks, *a.shape[3:]), a.dtype,
                                                         sharding=a.sharding), kv)
        # no gate: it checks a module against the serving pool, which this one is not for yet
        return {b: self._compile_forward(b, (params, kv), gate=False) for b in buckets}

    def resize_kv(self, num_blocks: int, moves: dict[int, int], executables: dict[StepBucket, Callable]) -> None:
        """Gives the KV pool `num_blocks` blocks (engine thread, under writer ownership): the moved
        blocks' K/V are copied first, then the pool is cut or padded with empty blocks. The forward
        executables of the old pool size are dropped for `executables`, built for the new."""
        if self.mirror is not None:  # (fine-tuning jobs, which resize, are refused over several processes)
            raise RuntimeError("a KV pool spread over several processes is not resized")
        if self.backend.is_iree:  # resized with XLA on the host; the next step uploads it again
            self.kv = KVCache(*jax.device_put([self.backend.device.to_host(x) for x in self.kv]))

        def resized(x: jax.Array) -> jax.Array:
            if moves:
                src, dst = np.fromiter(moves, np.int32), np.fromiter(moves.values(), np.int32)
                x = x.at[:, :, dst].set(x[:, :, src])
            if num_blocks <= x.shape[2]:
                y = x[:, :, :num_blocks]
            else:
                pad = jnp.zeros((*x.shape[:2], num_blocks - x.shape[2], *x.shape[3:]), x.dtype)
                y = jnp.concatenate([x, pad], 2)
            return jax.device_put(y, x.sharding)

        self.kv = jax.tree.map(resized, self.kv)
        jax.block_until_ready(self.kv)
        self.num_blocks = num_blocks
        self.abstract = (self.abstract[0], jax.tree.map(_abstract, self.kv))
        self.forwards.clear()
        self.unprimed.clear()
        jax.clear_caches()  # JAX's own caches hold the old pool's executables too
        for bucket, executable in executables.items():
            self._install(bucket, executable)

    # ---- buckets -----------------------------------------------------------------------------

    def _candidates(self, rows: Rows) -> list[StepBucket]:
        """The buckets that fit the rows, smallest first (gate failures not excluded)."""
        counts = [n for _, n in rows]
        decode = all(n == 1 for n in counts) and not any(self._wants_targets(r, n) for r, n in rows)
        return self.buckets.candidates(counts, decode, lora=any(r.adapter_slot for r, _ in rows))

    def _wants_targets(self, r: Request, n: int) -> bool:
        """Whether the row's new tokens include prompt positions whose logprobs it asked for."""
        return r.params.prompt_logprobs is not None and r.num_scheduled + 1 < len(r.prompt_ids)

    def _runnable(self, rows: Rows) -> list[StepBucket]:
        """Buckets the rows may run in now: fitting, not refused by a gate, and built, smallest first.
        Only when none is built may live compiling build one (the smallest): a bigger built bucket
        pads more but never makes the step wait for a compiler."""
        passing = [b for b in self._candidates(rows) if b not in self.gate_failed]
        built = [b for b in passing if b in self.forwards]
        if built or not self.config.allow_live_compile:
            return built
        return passing

    def fits(self, rows: Rows) -> bool:
        """Whether the rows can run as one step (the scheduler splits them when not)."""
        return bool(self._runnable(rows))

    def bucket_for(self, rows: Rows) -> StepBucket:
        runnable = self._runnable(rows)
        if runnable:
            return runnable[0]
        candidates = self._candidates(rows)
        if candidates and all(b in self.gate_failed for b in candidates):
            raise self._no_passing_bucket(self.gate_failed[candidates[0]])
        counts = [n for _, n in rows]
        raise GraphCaptureDisabled(f"no built step bucket fits {len(rows)} rows of {sum(counts)} new tokens, and "
                                   "live graph capture is disabled")

    def step_cost(self, rows: Rows) -> float:
        """Estimated cost of running the rows as one step, padding included (see the cost model above);
        infinite when no bucket fits them."""
        candidates = self._candidates(rows)
        if not candidates:
            return math.inf
        b = candidates[0]
        context = max(r.num_scheduled + n for r, n in rows)
        keys = FIRST_KEYS + max(0, math.ceil((context - FIRST_KEYS) / CHUNK_KEYS)) * CHUNK_KEYS
        return ((b.tokens + FIXED_STEP_TOKENS) * self.flops_per_token + b.tiles * keys * self.flops_per_key_read
                + b.tiles * b.tile_size * keys * self.flops_per_query_key)

    # ---- compiling ---------------------------------------------------------------------------

    # ---- priming ------------------------------------------------------------------------------

    def prime(self, bucket: StepBucket) -> float:
        """Runs an installed forward step and its sampler once on a batch of one padding token, whose
        K/V go to block 0 (padding's block, never read); returns the seconds it took (engine thread).
        XLA:CPU prepares a loaded step's kernels (YNNPACK's) the first time the step runs, 0.1-0.6 s a
        step: a primed step's first request does not pay it (a server primes the steps a short chat
        turn runs before it is ready: `first_contact_steps`; the others pay it on their first use).
        The token sits past the first chunk of keys, so attention's loop over key chunks runs too."""
        t0 = time.perf_counter()
        inputs, last_index, targets, feed = self.layout.padding_inputs(bucket)
        inputs.positions[0] = min(FIRST_KEYS + CHUNK_KEYS, self.max_model_len) - 1
        inputs.tile_tokens[0, 0] = 0
        lora = self.lora_slots.ensure_state() if bucket.lora else None
        self.unprimed.discard(bucket)
        if self.mirror is not None:
            self.mirror.prime(bucket)
        try:
            row_logits, _, self.kv = self.forwards[bucket](self.params, self.kv, inputs, last_index, targets, lora,
                                                           feed)
            sampled, _ = self.sampler_for(bucket.rows)(row_logits, self.layout.sampling_arrays([], bucket.rows))
            np.asarray(sampled.tokens)
        except Exception as exc:  # priming is an optimisation: a failure is logged, never fatal
            if is_device_loss(exc):
                raise as_device_lost(exc) from exc
            log.warning("priming step bucket %s failed (%s); its first request runs it first", bucket.describe(),
                        first_line(exc))
            if self.kv.k.is_deleted():
                self.reset_kv()
        return time.perf_counter() - t0

    def first_contact_steps(self) -> list[StepBucket]:
        """The steps a lone short chat request runs: the smallest decode step and the prefill steps of
        up to FIRST_CONTACT_TOKENS tokens (the smallest at least)."""
        base = sorted(b for b in self.forwards if not b.lora)
        decode = [b for b in base if b.kind == "decode"][:1]
        prefill = [b for b in base if b.kind == "prefill"]
        return decode + [b for i, b in enumerate(prefill) if i == 0 or b.tokens <= FIRST_CONTACT_TOKENS]

    def _lora_abstract(self, bucket: StepBucket) -> dict | None:
        """The LoRA argument as a compile sees it (the slot state's shapes are fixed by the settings)."""
        if not bucket.lora:
            return None
        return jax.tree.map(_abstract, self.lora_slots.abstract_state())

    def forward_program(self, bucket: StepBucket, abstract=None) -> tuple[Callable, tuple, dict]:
        """One bucket's forward step as a compile sees it: the jitted function, its (abstract)
        arguments and its static arguments."""
        params, kv = abstract or self.abstract
        inputs, last_index, targets, feed = self.layout.padding_inputs(bucket)
        lora = self._lora_abstract(bucket)  # placed as the slots are (over a mesh: split like the weights)
        inputs, last_index, targets, feed = self._placed((inputs, last_index, targets, feed))
        static = {"cfg": self.cfg, "prompt_logprobs": bucket.kind == "prefill"}
        if self.attention != "xla":  # (XLA's is the default: its stored steps keep their keys)
            static["attention"] = self.attention
        if self.cpu_kernels:
            static["cpu_kernels"] = True
        return self.step_fns[0], (params, kv, inputs, last_index, targets, lora, feed), static

    def sampler_program(self, rows: int) -> tuple[Callable, tuple, dict]:
        """The sampler of `rows` rows as a compile sees it (as `forward_program`)."""
        return self.step_fns[1], self._placed(self._sampler_args(rows)), {"feed_rows": self.layout.feed_rows}

    def lowered(self, fn, args, static: dict, platforms: tuple[str, ...] | None = None):
        """A program lowered as the runner compiles it, for this process's platform or `platforms`
        (lowering for another needs no such device: the tests lower the steps for CUDA on a CPU)."""
        # a Pallas kernel finds the mesh it is split over in the context (a shard_map per device)
        under_mesh = self.mesh is not None and static.get("attention", "xla") != "xla"
        with jax.set_mesh(self.mesh) if under_mesh else contextlib.nullcontext():
            return fn.trace(*args, **static).lower(lowering_platforms=platforms)

    def _compile_forward(self, bucket: StepBucket, abstract=None, gate: bool = True) -> Callable:
        """The forward executable of one bucket (any thread): loaded from disk, else compiled (and kept).
        An IREE module is checked by its correctness gate first (`gate`)."""
        fn, args, static = self.forward_program(bucket, abstract)
        if self.backend.is_iree:
            return self._compile_iree_forward(bucket, args, check=gate)
        return self._compile_xla("forward", fn, args, static, bucket)

    def _placed(self, args):
        """A step's arguments other than params and KV as a compile sees them: as they are on one
        device; replicated over a mesh."""
        if self.mesh is None:
            return args
        everywhere = replicated(self.mesh)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere), args)

    def _sampler_args(self, rows: int) -> tuple:
        row_logits = jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32)
        return row_logits, self.layout.sampling_arrays([], rows)

    def _compile_sampler(self, key: SamplerKey) -> Callable:
        return self._compile_xla("sampler", *self.sampler_program(key.rows), key)

    def _compile_xla(self, name: str, fn, args, static: dict, key) -> Callable:
        store_key = executable_key(name, args, (key, sorted(static.items(), key=lambda kv: kv[0])))
        executable = self.store.load(store_key)
        if executable is None:
            executable = self.store.compile(store_key, self.lowered(fn, args, static))
        if self.mesh is None:
            return executable
        # over a mesh an executable takes its arguments placed as compiled (one loaded from disk does
        # not move them itself): the forward pass's after params and KV, but for the adapter slots (placed
        # already), and the sampler's all replicated
        everywhere = replicated(self.mesh)
        keep = (0, 1, 5) if name == "forward" else ()  # params, KV, LoRA slots

        def placed(*call_args):
            return executable(*(a if i in keep else jax.device_put(a, everywhere) for i, a in enumerate(call_args)))

        return placed

    def _compile_iree_forward(self, bucket: StepBucket, args, check: bool) -> Callable:
        """The bucket's forward pass and basic sampler as one IREE module, its logits, hidden states and
        KV kept on the device; checked against XLA's on a synthetic batch before it may serve (`check`)."""
        params, kv, inputs, last_index, _, lora, _ = args
        args = (params, kv, inputs, last_index, lora, self.layout.sampling_arrays([], bucket.rows))
        executable = self.backend.compile(forward_sample_step, args, {"cfg": self.cfg}, device_outputs=(0, 2, 3))
        if not check:
            return executable
        # a module's verdict on this device is kept beside it: a warm start neither compiles nor gates
        cache, device = self.backend.cache, f"{self.backend.device_id}-{gate_signature()}"
        verdict = cache.verdict(executable.module_key, device)
        if verdict is None:
            with self._gate_lock:  # modules compile side by side; the device runs one gate at a time
                verdict = {"why": check_bucket(self, bucket, executable, lora)}
            cache.record_verdict(executable.module_key, device, verdict["why"])
        if why := verdict["why"]:
            raise BucketFailedGate(bucket, why)
        return executable

    def _no_passing_bucket(self, why: str) -> BackendCannotRun:
        return BackendCannotRun(f"no step bucket of the {self.backend.name} route that fits this batch passed "
                                f"its correctness gate ({why})")

    def _gate_failed(self, exc: BucketFailedGate) -> None:
        self.gate_failed[exc.shape] = exc.why
        log.warning("route %s: step bucket %s failed its correctness gate (%s); its batches run in a bigger "
                    "bucket or split", self.backend.name, exc.shape.describe(), exc.why)

    def forward_for(self, bucket: StepBucket) -> Callable:
        forward = self.forwards.get(bucket)
        if forward is None:  # an engine that was not warmed: only live compiling gets here
            t0 = time.perf_counter()
            try:
                forward = self._build(bucket)
            except BucketFailedGate as exc:
                self._gate_failed(exc)
                raise self._no_passing_bucket(exc.why) from None
            self._install(bucket, forward)
            self.compile_waits += 1
            log.info("built step bucket %s in %.1fs (the step waited)", bucket.describe(), time.perf_counter() - t0)
        return forward

    def _auxiliary_for(self, key: SamplerKey | PromptLogprobsKey) -> Callable:
        executable = self.auxiliary.get(key)
        if executable is None:  # an engine that was not warmed
            executable = self._build(key)
            self._install(key, executable)
        return executable

    def sampler_for(self, rows: int) -> Callable:
        return self._auxiliary_for(SamplerKey(rows))

    # ---- step --------------------------------------------------------------------------------

    def execute(self, batch: Batch) -> StepResult | StepFailure:
        """Runs one planned batch to its results on the host (`dispatch`, then `fetch`)."""
        pending = self.dispatch(batch)
        return pending if isinstance(pending, StepFailure) else self.fetch(pending)

    def dispatch(self, batch: Batch, feed: jax.Array | None = None) -> PendingStep | StepFailure:
        """Starts one planned batch on the device; `feed` is the previous dispatched step's (rows whose
        last token it is sampling read it there). A failure fails the batch's rows, never the
        process. Raises DeviceLost when the error says the device is gone."""
        rows = batch.rows
        try:
            bucket = self.bucket_for(rows)
            forward = self.forward_for(bucket)
        except (GraphCaptureDisabled, BackendCannotRun) as exc:
            # a batch that no passing bucket fits runs again split (see fits); a one-token row cannot
            splittable = len(rows) > 1 or rows[0][1] > 1
            return StepFailure(exc, retry=splittable and not self.fits(rows))
        try:
            return self._launch(rows, bucket, forward, feed)
        except Exception as exc:  # the failure policy's boundary: _failed sorts device loss from a failed step
            return self._failed(exc, kv_lost=self.backend.is_iree or self.kv.k.is_deleted())  # IREE: consumed in place

    def fetch(self, pending: PendingStep) -> StepResult | StepFailure:
        """A dispatched step's results on the host (waits for the device). A step that failed on the
        device took the KV state with it: every step dispatched after it ran on that state too."""
        try:
            return pending.result()
        except Exception as exc:  # as in dispatch: runtimes raise untyped errors
            return self._failed(exc, kv_lost=True)

    def _failed(self, exc: Exception, kv_lost: bool) -> StepFailure:
        if is_device_loss(exc):
            raise as_device_lost(exc) from exc
        log.exception("step failed")
        if self.backend.is_iree:
            self._quarantine_route(exc)
        if kv_lost:
            self.reset_kv()
        return StepFailure(RequestFailed(f"the accelerator step failed: {type(exc).__name__}",
                                         code="accelerator_error"), kv_lost)

    def _quarantine_route(self, exc: Exception) -> None:
        """An accelerator failure on an IREE route takes that route out of service for the life of
        the process: later steps run on XLA (on the host), every compiled IREE bucket and the
        device's copies of the weights are dropped. XLA itself is the route of last resort: its
        failures fail their requests only."""
        failed, why = self.backend, first_line(exc)
        self.quarantined = f"{failed.name}: {why}"
        log.error("route %s quarantined after an accelerator failure (%s); serving goes on with XLA on %s until "
                  "a restart", failed.name, why, jax.default_backend())
        self.forwards.clear()
        self.unprimed.clear()
        self.gate_failed.clear()
        self.layout.drop_device_arrays()
        if failed.resident is not None:
            failed.resident.clear()
        self.backend = Backend(BackendChoice(
            "xla", f"fallback: route {failed.name} was quarantined after an accelerator failure ({why})",
            xla_capabilities(), {}))

    def _device_samples(self, rows: Rows) -> bool:
        """On an IREE route, whether the device's own (basic) sampling serves the batch: not for
        grammar masks, penalties, top-k/top-p/min-p or top logprobs, which XLA samples on the host
        (see `sampling.sample`)."""
        return not any(r.matcher is not None or r.forced or r.params.needs_filtering or r.params.needs_penalties
                       or r.params.logprobs for r, _ in rows)

    def _feed(self, feed: jax.Array | None) -> jax.Array:
        if feed is not None:
            return feed
        if self._empty_feed is None:
            self._empty_feed = jax.device_put(np.zeros(self.layout.feed_rows, np.int32))
        return self._empty_feed

    def run_forward(self, bucket: StepBucket, forward: Callable, host: tuple, feed: jax.Array | None) -> tuple:
        """Runs a bucket's forward executable on `host` (inputs, last index, prompt targets, feed sources)
        and `feed` (the earlier step's token feed it reads, or None); returns its row logits and prompt
        logprobs (on the device) and keeps its KV state."""
        inputs, last_index, targets, source = host
        lora = self.lora_slots.ensure_state() if bucket.lora else None
        row_logits, prompt, self.kv = forward(self.params, self.kv, inputs, last_index, targets, lora,
                                              TokenFeed(self._feed(feed), source))
        self.unprimed.discard(bucket)  # its first run
        return row_logits, prompt

    def _launch(self, rows: Rows, bucket: StepBucket, forward: Callable, feed: jax.Array | None) -> PendingStep:
        host = self.layout.step_inputs(rows, bucket)
        inputs, last_index, targets, source = host
        rs = self.layout.sampling_arrays(rows, bucket.rows)
        sampler = self.sampler_for(bucket.rows)
        self.device_loss.before_step()
        if self.backend.is_iree:  # never fed: the engine plans no step ahead of one on an IREE route
            lora = self.lora_slots.ensure_state() if bucket.lora else None
            row_logits, sampled, hidden, self.kv = forward(self.params, self.kv, inputs, last_index, lora, rs)
            prompt = None
            if any(self._wants_targets(r, n) for r, n in rows):
                hidden = self.backend.device.to_host(hidden)
                prompt = self._auxiliary_for(PromptLogprobsKey(bucket.tokens))(self.params, hidden, targets)
            if self._device_samples(rows):
                return PendingStep(bucket, rows, sampled, prompt, targets, None)
            row_logits = self.backend.device.to_host(row_logits)
        else:
            seq = self.mirror.forward(bucket, host, feed) if self.mirror is not None else 0
            row_logits, prompt = self.run_forward(bucket, forward, host, feed)
        if rs.constrained.any():  # computed while the forward pass runs (dispatched asynchronously)
            rs = rs._replace(allowed=self.layout.masks_for(rows, bucket.rows))
        if self.mirror is not None:
            self.mirror.sample(seq, rs)
        sampled, next_feed = sampler(row_logits, rs)
        if self.mirror is not None:
            self.mirror.sampled(seq, next_feed)
        return PendingStep(bucket, rows, sampled, prompt, targets, None if self.backend.is_iree else next_feed)
