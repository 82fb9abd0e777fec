"""A request inside the engine: its state (tokens, KV blocks, adapter slot, progress, timing) and its
output processing (incremental text, stop conditions, the deltas streamed to its caller)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from kiln.engine.grammar import advance
from kiln.engine.params import SamplingParams
from kiln.errors import KilnError
from kiln.models.tokenizer import IncrementalDetokenizer, KilnTokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from kiln.engine.lora_slots import AdapterWeights


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Timing:
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def phases(self) -> dict[str, float | None]:
        """Latency phases in seconds: queued, prefill, time to first token, decode, end to end."""

        def span(a, b):
            return None if a is None or b is None else round(b - a, 6)

        return {
            "queued_s": span(self.arrival, self.first_scheduled),
            "prefill_s": span(self.first_scheduled, self.prefill_done),
            "ttft_s": span(self.arrival, self.first_token),
            "decode_s": span(self.first_token, self.finished),
            "e2e_s": span(self.arrival, self.finished),
        }


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # always set: the user's seed or one drawn at submit time
    adapter: AdapterWeights | None = None
    cache_salt: str | None = None
    group_id: str | None = None  # siblings of an n > 1 request share their prompt's blocks
    index: int = 0  # choice index among siblings
    adapter_slot: int = 0  # the LoRA slot the scheduler gave the request (0: none yet / no adapter)
    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    # dispatched steps whose results are not applied yet (async scheduling, see EngineCore.step):
    num_inflight: int = 0  # tokens they compute
    num_pending: int = 0  # tokens they sample (appended when their results are applied)
    feed_row: int = 0  # the sampler row of the latest dispatched step that samples this request's next token
    block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # of full, cached blocks
    num_cached_prompt_tokens: int = 0
    lookup_hashes: tuple[int, list[int]] | None = None  # (tokens hashed, hashes) for prefix lookups
    num_preemptions: int = 0
    finish_reason: str | None = None
    timing: Timing = dataclasses.field(default_factory=Timing)
    # aligned with prompt positions; position 0 has no logprob (None), as the API reports it
    prompt_logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=lambda: [None])
    output: OutputState | None = None  # detokenizer and stop checks, set when the scheduler takes the request
    matcher: LLMatcher | None = None  # the grammar's state after the output so far (constrained requests)
    forced: list[int] = dataclasses.field(default_factory=list)  # tokens the next steps must sample, in order

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_scheduled(self) -> int:
        """Tokens computed or being computed: where the next step's tokens start."""
        return self.num_computed + self.num_inflight

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens known or being sampled by a dispatched step."""
        return self.num_tokens + self.num_pending

    @property
    def num_output_ahead(self) -> int:
        """Output tokens known or being sampled: the index of the next token a step samples."""
        return len(self.output_ids) + self.num_pending

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.name if self.adapter is not None else None

    @property
    def hash_extra(self) -> tuple:
        """Keys the prefix cache: adapters (each version) and cache salts never share KV."""
        key = self.adapter.key if self.adapter is not None else None
        return (key, self.cache_salt) if (key or self.cache_salt) else ()

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


# ---- output processing ------------------------------------------------------------------------


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Delta:
    """What one request produced in one step (streamed to its caller)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first delta only; [0] is None
    usage: dict | None = None  # last delta only: prompt_tokens, completion_tokens, cached_tokens
    metrics: dict | None = None  # last delta only: latency phases, preemptions
    error: KilnError | None = None  # set when the request failed inside the engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputState:
    """Per-request detokenizer, stop conditions and stop-string holdback."""

    def __init__(self, req: Request, tokenizer: KilnTokenizer, eos_ids: tuple[int, ...], max_model_len: int):
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids,
                                            skip_special_tokens=req.params.skip_special_tokens)
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of text already streamed
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1
        self.thinking = "closed" if req.params.thinking is None else "open" if req.params.thinking.opened else "unknown"
        self.thought = 0  # output tokens spent thinking

    def add_token(self, token: int) -> tuple[str, str | None, str | int | None]:
        """Processes a sampled token already appended to the request's output ids.

        Returns (new text to stream, finish reason, stop reason)."""
        p = self.req.params
        n_out = len(self.req.output_ids)  # including this token
        finish, stop_reason, grammar_done = None, None, False
        if token in p.stop_token_ids and n_out > p.min_tokens:
            finish, stop_reason = "stop", token
        elif token in self.eos_ids and not p.ignore_eos and n_out > p.min_tokens:
            finish = "stop"
        if finish is None:
            grammar_done = self.req.matcher is not None and advance(self.req.matcher, token)
            if not (grammar_done and token in self.eos_ids):
                self.text += self.detok.add(token)
            if p.stop and n_out >= p.min_tokens:
                hit = self._find_stop()
                if hit is not None:
                    idx, stop = hit
                    self.text = self.text[: idx + (len(stop) if p.include_stop_str_in_output else 0)]
                    finish, stop_reason = "stop", stop
            if finish is None and grammar_done:
                finish = "stop"  # the grammar is complete: nothing may follow
        if self.thinking != "closed" and finish is None:
            self._track_thinking(token)
        at_limit = (p.max_tokens is not None and n_out >= p.max_tokens) or self.req.num_tokens >= self.max_model_len
        if finish is None and at_limit:
            finish = "length"
        if finish is not None:
            if finish == "length" or (grammar_done and stop_reason is None):
                self.text += self.detok.flush()
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return out, finish, stop_reason
        end = len(self.text) - (self.holdback if p.stop else 0)
        if end <= self.sent:
            return "", None, None
        out = self.text[self.sent : end]
        self.sent = end
        return out, None, None

    def _track_thinking(self, token: int) -> None:
        """Counts thinking tokens; at the budget, forces the end of the thinking block."""
        req, budget = self.req, self.req.params.thinking
        if req.forced:
            req.forced.pop(0)  # the forced token was sampled
            self.thinking = "closed" if not req.forced else self.thinking
            return
        if self.thinking == "unknown":
            head = self.text.lstrip()
            if head.startswith(budget.start):
                self.thinking = "open"
            elif not budget.start.startswith(head):
                self.thinking = "closed"  # this answer does not think
                return
        self.thought += 1
        if budget.end in self.text:
            self.thinking = "closed"
        elif self.thinking == "open" and self.thought >= budget.budget:
            req.forced = list(budget.end_ids)

    def _find_stop(self) -> tuple[int, str] | None:
        start = max(0, self.sent - self.holdback)
        best = None
        for s in self.req.params.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        return best
