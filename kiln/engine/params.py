"""A request's sampling parameters, as the API takes them (with vLLM's extensions), and their ranges.

They are host-side, request-level data: the engine turns a batch's rows of them into the device
sampler's arrays (see sampling.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kiln.errors import InvalidRequest

if TYPE_CHECKING:
    from kiln.engine.grammar import Grammar

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 100.0  # beyond OpenAI's 2 (vLLM has no upper bound); near 100 every token is about as likely
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 128  # entries of stop_token_ids; each is banned until min_tokens


@dataclasses.dataclass(frozen=True)
class ThinkingBudget:
    """At most `budget` output tokens of thinking: then `end_ids` (the ids of the template's `end`
    marker) are forced. `opened`: the prompt already opened the thinking block; otherwise it opens
    when the output starts with the `start` marker. The markers are the chat template's (the
    server reads them from it): the engine knows no reasoning syntax of its own."""

    budget: int
    end_ids: tuple[int, ...]
    start: str
    end: str
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
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            bad(f"temperature must be from 0 (greedy) to {MAX_TEMPERATURE:g}: OpenAI's clients send 0 to 2, and Kiln "
                "also takes higher values, as vLLM does", "temperature")
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
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS:
            bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} entries", "stop_token_ids")
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
