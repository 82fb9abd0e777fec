"""Sampling parameters and the on-device sampler.

Every row carries its own parameters as arrays, so one compiled sampler serves a batch of
mixed requests. Randomness comes from a per-request key folded with the row's output
index, so a seeded request draws the same tokens whatever else shares its batch.
Costly features (penalties, top-k/top-p/min-p sorting, top logprobs) are compiled in only
when some row of the batch asks for them (static flags).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from kiln.errors import InvalidRequest

if TYPE_CHECKING:
    from kiln.engine.grammar import Grammar

MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class ThinkingBudget:
    """At most `budget` output tokens of thinking: then `end_ids` (the template's `</think>`) are
    forced. `opened`: the prompt already opened the thinking block; otherwise it opens when the
    output starts with `<think>`."""

    budget: int
    end_ids: tuple[int, ...]
    opened: bool = False


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; 0: sampled token only; k: plus top-k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    grammar: Grammar | None = None  # constrained decoding: every choice follows this grammar
    thinking: ThinkingBudget | None = None

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequest naming the first parameter out of range."""

        def bad(msg, param):
            raise InvalidRequest(msg, param=param)

        if self.n < 1 or self.n > 128:
            bad("n must be between 1 and 128", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens must be at least 1", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature must be between 0 and 100", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1:
            bad("top_k must be -1 (off) or at least 0", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p must be in [0, 1]", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be between -2 and 2", name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty must be in (0, 10]", "repetition_penalty")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens must be between 0 and max_tokens", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
                bad(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}", name)
        for tok, bias in (self.logit_bias or {}).items():
            if not 0 <= int(tok) < vocab_size:
                bad(f"logit_bias token id {tok} is outside the vocabulary", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                bad("logit_bias values must be between -100 and 100", "logit_bias")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                bad(f"stop_token_ids entry {tok} is outside the vocabulary", "stop_token_ids")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty", "stop")
        if self.thinking is not None and self.thinking.budget < 0:
            bad("thinking_token_budget must be at least 0", "thinking_token_budget")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_filtering(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


class SamplingFlags(NamedTuple):
    """Static (compile-time) switches; one executable per combination in use."""

    penalties: bool = False
    filtering: bool = False
    top_logprobs: bool = False
    mask: bool = False  # some row is constrained by a grammar


class RowSampling(NamedTuple):
    """Per-row sampling arrays [S] / [S, K]; padding rows are greedy with no extras."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    seed: jax.Array  # uint32 [S, 2]: (seed low, seed high)
    step: jax.Array  # int32 [S]: index of the token being sampled in the request's output
    bias_ids: jax.Array  # [S, Kb] (vocab = padding)
    bias_values: jax.Array  # [S, Kb]
    banned_ids: jax.Array  # [S, Kn] ids masked this step (min_tokens), vocab = padding
    output_ids: jax.Array  # [S, P] generated so far (penalties), vocab = padding
    prompt_ids: jax.Array  # [S, P2] prompt (repetition penalty), vocab = padding
    allowed: jax.Array  # int32 [S, ceil(V / 32)] bitmask of the tokens a grammar allows ([S, 0] without flags.mask)


class Sampled(NamedTuple):
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32: the sampled token's logprob (raw model distribution)
    top_ids: jax.Array  # [S, K] (K = 0 unless flags.top_logprobs)
    top_logprobs: jax.Array  # [S, K]


def _row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    def one(s, t):
        key = jax.random.fold_in(jax.random.PRNGKey(s[0]), s[1])
        return jax.random.fold_in(key, t)

    return jax.vmap(one)(seed, step)


def _presence(ids: jax.Array, vocab: int) -> jax.Array:
    """Counts of each vocab id in padded id lists [S, P] -> [S, vocab]."""
    S = ids.shape[0]
    counts = jnp.zeros((S, vocab + 1), jnp.float32)
    counts = counts.at[jnp.arange(S)[:, None], ids].add(1.0)
    return counts[:, :vocab]


def _argmax(x: jax.Array) -> jax.Array:
    """First index of each row's maximum. XLA:CPU runs argmax as a (value, index) reduction about
    four times slower than this max and min."""
    V = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(x == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1), V - 1)


def sample(logits: jax.Array, rs: RowSampling, flags: SamplingFlags) -> Sampled:
    """logits: [S, V] float32 raw model output."""
    S, V = logits.shape
    log_norm = jax.nn.logsumexp(logits, axis=-1)  # logprobs are logits - log_norm (raw distribution)
    rows = jnp.arange(S)[:, None]
    x = logits
    if flags.mask:  # grammars first: no sampling parameter may bring back a token they rule out
        ids = jnp.arange(V, dtype=jnp.int32)
        bits = jnp.right_shift(rs.allowed[:, ids // 32], ids % 32) & 1
        x = jnp.where(bits == 1, x, -jnp.inf)
    # padded id lists use id V: they write an extra column, cut off after (indices stay in bounds)
    x = jnp.pad(x, ((0, 0), (0, 1))).at[rows, rs.bias_ids].add(rs.bias_values)[:, :V]
    if flags.penalties:
        out_counts = _presence(rs.output_ids, V)
        seen = (out_counts + _presence(rs.prompt_ids, V)) > 0
        rep = rs.repetition[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - rs.frequency[:, None] * out_counts - rs.presence[:, None] * (out_counts > 0)
    x = jnp.pad(x, ((0, 0), (0, 1))).at[rows, rs.banned_ids].set(-jnp.inf)[:, :V]
    greedy = _argmax(x)

    def draw():
        scaled = x / jnp.maximum(rs.temperature, 1e-5)[:, None]
        if flags.filtering:
            sorted_desc = -jnp.sort(-scaled, axis=-1)
            k = jnp.where(rs.top_k > 0, jnp.minimum(rs.top_k, V), V)
            kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
            probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
            cum = jnp.cumsum(probs_sorted, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            cutoff_idx = jnp.sum(cum - probs_sorted < rs.top_p[:, None], axis=-1) - 1
            top_p_min = jnp.take_along_axis(sorted_desc, jnp.maximum(cutoff_idx, 0)[:, None], axis=-1)
            min_p_min = sorted_desc[:, :1] + jnp.log(jnp.maximum(rs.min_p, 1e-30))[:, None]
            threshold = jnp.maximum(jnp.maximum(kth, top_p_min), jnp.where(rs.min_p[:, None] > 0, min_p_min, -jnp.inf))
            scaled = jnp.where(scaled >= threshold, scaled, -jnp.inf)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(_row_keys(rs.seed, rs.step))
        return _argmax(scaled + gumbel)

    # an all-greedy batch skips the noise and filtering at run time (same executable)
    sampled = jax.lax.cond(jnp.any(rs.temperature > 0.0), draw, lambda: greedy)
    tokens = jnp.where(rs.temperature == 0.0, greedy, sampled).astype(jnp.int32)
    token_logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_norm
    if flags.top_logprobs:
        top_logits, top_ids = jax.lax.top_k(logits, min(MAX_TOP_LOGPROBS, V))
        top_lp = top_logits - log_norm[:, None]
    else:
        top_lp, top_ids = jnp.zeros((S, 0), jnp.float32), jnp.zeros((S, 0), jnp.int32)
    return Sampled(tokens, token_logprobs, top_ids.astype(jnp.int32), top_lp)
