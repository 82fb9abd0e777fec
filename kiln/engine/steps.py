"""The two jitted halves of an engine step: the forward pass and the sampler.

`forward_step` runs the decoder over a bucket's padded batch and returns the logits of each
sampled row (kept on the device), the prompt logprobs where a row asked for them, and the
updated KV state (donated: XLA updates it in place). `sample_step` turns row logits into
tokens. They are separate executables so that the host computes grammar masks while the
forward pass runs, and so that one sampler per row count serves every forward bucket with that
many rows.

The sampler also writes its tokens into a feed of fixed size, which the next forward step takes
as a `TokenFeed`: a row whose last token is still being sampled when the next step is planned
(async scheduling, see EngineCore.step) reads it from the feed on the device, never waiting for
the host to see it.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.sharding import NamedSharding

from kiln.engine.params import MAX_TOP_LOGPROBS
from kiln.engine.sampling import RowSampling, Sampled, sample
from kiln.models.config import ModelConfig
from kiln.models.decoder import KVCache, StepInputs, forward_hidden, logits

PROMPT_CHUNK = 64  # prompt logprobs take the vocabulary's log-softmax this many tokens at a time


class TokenFeed(NamedTuple):
    """The previous step's sampled tokens, for the tokens of this step that the host does not know yet."""

    tokens: jax.Array  # [P] int32: the previous sampler's tokens, zero-padded to the feed size
    source: jax.Array  # [T] int32: for each of this step's tokens, its row in `tokens`, or -1 (its own id)


def _fed(inputs: StepInputs, feed: TokenFeed | None) -> StepInputs:
    if feed is None:
        return inputs
    source = jnp.asarray(feed.source)
    tokens = jnp.where(source >= 0, jnp.asarray(feed.tokens)[jnp.maximum(source, 0)], jnp.asarray(inputs.tokens))
    return inputs._replace(tokens=tokens)


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


def _prompt_logprobs(params, hidden: jax.Array, targets: jax.Array, cfg: ModelConfig) -> PromptLogprobs:
    """Each position's logprob of the next prompt token and its top logprobs, a chunk of tokens
    at a time (a whole step's vocabulary log-softmax would be hundreds of MB)."""
    T = hidden.shape[0]
    chunk = min(PROMPT_CHUNK, T)
    pad = -T % chunk
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[1])
    t = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, chunk)

    def one(args):
        h, t = args
        lp = jax.nn.log_softmax(logits(params, h, cfg), axis=-1)
        target = jnp.take_along_axis(lp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]))
        return target, top_ids.astype(jnp.int32), top_lp

    target, top_ids, top_lp = jax.lax.map(one, (h, t))
    K = top_ids.shape[-1]
    return PromptLogprobs(target.reshape(-1)[:T], top_ids.reshape(-1, K)[:T], top_lp.reshape(-1, K)[:T])


def _forward(params, kv: KVCache, inputs: StepInputs, last_index, prompt_targets, lora, feed: TokenFeed | None,
             cfg: ModelConfig, prompt_logprobs: bool, attention: str, cpu_kernels: bool):
    with _trace_lock:
        COUNTER.traces += 1  # runs at trace time only
    hidden, kv = forward_hidden(params, kv, _fed(inputs, feed), cfg, lora, attention=attention, cpu_kernels=cpu_kernels)
    with jax.named_scope("lm_head"):
        row_logits = logits(params, hidden[last_index], cfg, cpu_kernels=cpu_kernels)
    prompt = None
    if prompt_logprobs:
        T, K = hidden.shape[0], min(MAX_TOP_LOGPROBS, cfg.vocab_size)
        none = lambda h: PromptLogprobs(jnp.zeros(T, jnp.float32), jnp.zeros((T, K), jnp.int32),  # noqa: E731
                                        jnp.zeros((T, K), jnp.float32))
        prompt = jax.lax.cond(jnp.any(prompt_targets >= 0), lambda h: _prompt_logprobs(params, h, prompt_targets, cfg),
                              none, hidden)
    return row_logits, prompt, kv


FORWARD_STATIC = ("cfg", "prompt_logprobs", "attention", "cpu_kernels")


@functools.partial(jax.jit, static_argnames=FORWARD_STATIC, donate_argnames=("kv",))
def forward_step(params, kv: KVCache, inputs: StepInputs, last_index, prompt_targets, lora, feed: TokenFeed | None,
                 *, cfg: ModelConfig, prompt_logprobs: bool, attention: str = "xla", cpu_kernels: bool = False):
    """Row logits [R, V] of the tokens at `last_index`, prompt logprobs (prefill steps, computed
    only when some target is set) and the new KV state. `feed`: tokens taken from the previous
    step's sampler (None: the inputs hold every token). `attention`: "xla" or "pallas" (see
    kiln.models.paged_attention); `cpu_kernels`: quantized products in Kiln's CPU kernels."""
    return _forward(params, kv, inputs, last_index, prompt_targets, lora, feed, cfg, prompt_logprobs, attention,
                    cpu_kernels)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def forward_sample_step(params, kv: KVCache, inputs: StepInputs, last_index, lora, rs: RowSampling, *,
                        cfg: ModelConfig):
    """Both halves in one program, for IREE routes: their modules cannot hand a fresh result to
    another module. IREE 3.13 also runs some control flow wrongly ("transient buffer has not been
    committed"): conditional regions holding sorts or scatters, and a data-dependent loop after
    LoRA's per-token weights. So the sampler is the basic one (see `sample`), prompt
    logprobs are left to `prompt_logprobs_step` on the host, and with LoRA attention reads every
    chunk of the block table. Returns the row logits (sampled elsewhere when the basic sampler
    cannot serve the batch), the sampled rows, the hidden states and the new KV state."""
    with _trace_lock:
        COUNTER.traces += 1
    hidden, kv = forward_hidden(params, kv, inputs, cfg, lora, dynamic_context=lora is None)
    row_logits = logits(params, hidden[last_index], cfg)
    return row_logits, sample(row_logits, rs, basic=True), hidden, kv


prompt_logprobs_step = jax.jit(_prompt_logprobs, static_argnames=("cfg",))


def on_mesh(kv: NamedSharding, replicated: NamedSharding) -> tuple:
    """`forward_step` and `sample_step` for a tensor-parallel mesh: the KV state keeps its sharding,
    every other output is replicated, so that one executable's logits and token feed are placed as
    the next one takes them (the inputs' placements come from the compiles' abstract arguments)."""
    forward = jax.jit(forward_step, static_argnames=FORWARD_STATIC, donate_argnames=("kv",),
                      out_shardings=(replicated, replicated, kv))
    sampler = jax.jit(sample_step, static_argnames=("feed_rows",), out_shardings=replicated)
    return forward, sampler


@functools.partial(jax.jit, static_argnames=("feed_rows",))
def sample_step(row_logits: jax.Array, rs: RowSampling, *, feed_rows: int) -> tuple[Sampled, jax.Array]:
    """The rows' samples, and their tokens as the next step's feed ([feed_rows], zero-padded)."""
    with jax.named_scope("sampling"):
        sampled = sample(row_logits, rs)
    return sampled, jnp.zeros(feed_rows, jnp.int32).at[: sampled.tokens.shape[0]].set(sampled.tokens)
