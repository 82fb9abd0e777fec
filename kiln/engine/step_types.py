"""The types a step passes between the scheduler, the runner and the engine core: the rows a step
runs (`Batch`), a step's plan, a dispatched step (`PendingStep`), its results on the host
(`StepResult`) or its failure (`StepFailure`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import jax
import numpy as np

from kiln.engine.buckets import StepBucket
from kiln.engine.request import Delta, Request, Status, TokenLogprob
from kiln.engine.sampling import Sampled
from kiln.engine.steps import PromptLogprobs
from kiln.errors import KilnError

Rows = list[tuple[Request, int]]  # (request, number of new tokens this step)


@dataclasses.dataclass
class Batch:
    """Rows that run as one jitted step. `samples[i]`: the step samples row i's next token (its new
    tokens reach the end of what the request knows or has pending), taken when the batch is planned."""

    rows: Rows
    samples: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.samples:
            self.samples = [r.num_scheduled + n == r.num_tokens_ahead for r, n in self.rows]

    def live(self) -> Batch | None:
        """The batch without rows whose request stopped running since it was planned: it ended (an
        earlier step's results finished it) or recomputes (an earlier step lost the KV state). None
        if no row is left."""
        keep = [i for i, (r, _) in enumerate(self.rows) if r.status is Status.RUNNING]
        if len(keep) == len(self.rows):
            return self
        return Batch([self.rows[i] for i in keep], [self.samples[i] for i in keep]) if keep else None

    @property
    def kind(self) -> str:
        decode = sum(n == 1 for _, n in self.rows)
        return "decode" if decode == len(self.rows) else "prefill" if decode == 0 else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


@dataclasses.dataclass
class StepPlan:
    batches: list[Batch]  # executed in order
    finished: list[Delta]  # requests that ended while scheduling (e.g. their adapter failed to load)
    preempted: list[Request]


class RowOutput(Protocol):
    """What the runner returns for one executed batch (see runner.StepResult)."""

    def token(self, i: int) -> tuple[int, float, list[tuple[int, float]]]: ...

    def prompt_logprobs(self, i: int) -> list[tuple[int, TokenLogprob]]: ...


@dataclasses.dataclass
class StepFailure:
    """A batch that failed; `kv_lost` when the KV state went with it (every running request recomputes);
    `retry` when it did not run and its rows should be planned again (they keep their state)."""

    error: KilnError
    kv_lost: bool = False
    retry: bool = False



class StepResult:
    """One executed batch, on the host: each row's sampled token and, for rows that asked,
    the logprobs of their prompt tokens. `starts`: each row's first position in the step."""

    def __init__(self, rows: Rows, sampled: Sampled, prompt: PromptLogprobs | None, targets: np.ndarray,
                 starts: list[int]):
        self.tokens, self.logprobs = np.asarray(sampled.tokens), np.asarray(sampled.logprobs)
        want_top = any(r.params.logprobs for r, _ in rows)
        self.top_ids = np.asarray(sampled.top_ids) if want_top else None
        self.top_lps = np.asarray(sampled.top_logprobs) if want_top else None
        self.rows = rows
        want_prompt = prompt is not None and any(r.params.prompt_logprobs is not None for r, _ in rows)
        self.prompt = tuple(np.asarray(x) for x in prompt) if want_prompt else None
        self.targets = targets
        self.offsets = np.cumsum([0] + [n for _, n in rows])
        self.starts = starts

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


class PendingStep:
    """A dispatched step: its sampled rows (and prompt logprobs) may still be computing on the device.
    `feed`: its sampled tokens as the next step's feed (None where a route samples on the host)."""

    def __init__(self, bucket: StepBucket, rows: Rows, sampled: Sampled, prompt: PromptLogprobs | None,
                 targets: np.ndarray, feed: jax.Array | None):
        self.bucket, self.rows, self.sampled, self.prompt, self.targets = bucket, rows, sampled, prompt, targets
        self.feed = feed
        self.starts = [r.num_scheduled for r, _ in rows]  # read now: the engine commits the rows after dispatch
        self.dispatched_at = time.monotonic()

    def ready(self) -> bool:
        """Whether the results are already computed (fetching them would not wait)."""
        tokens = self.sampled.tokens
        return not isinstance(tokens, jax.Array) or tokens.is_ready()

    def result(self) -> StepResult:
        """The results on the host (waits for the device)."""
        return StepResult(self.rows, self.sampled, self.prompt, self.targets, self.starts)
