"""A request's state inside the engine: tokens, KV blocks, adapter slot, progress, timing."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from kiln.engine.params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from kiln.engine.lora_slots import AdapterWeights
    from kiln.engine.output import OutputState, TokenLogprob


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
