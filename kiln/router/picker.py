"""Choosing a worker from the predictions, by a profile's `[profile.picker]` settings.

`pick` takes the eligible workers' predictions (the caller has left out evicted and dead ones) and
returns a `Choice`: the worker, its prediction, the candidates and why. It is pure and
deterministic given the `random.Random` it is handed. `PrefixHeat` measures how common a prompt's
prefix is lately, which decides whether `pick` replicates it to more workers. docs/router.md
("Predicting latency and picking a worker") states the rules.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kiln.router.predictor import Prediction

if TYPE_CHECKING:
    from kiln.router.config import Picker

# Blocks a prompt's heat key covers. Block keys are chained (each names its whole prefix), so the key
# of block PREFIX_KEY_BLOCKS - 1 names the first PREFIX_KEY_BLOCKS blocks: deep enough to get past a
# chat template's shared preamble, shallow enough that prompts sharing a system prompt share it.
PREFIX_KEY_BLOCKS = 4

Reason = Literal["only", "best", "load", "random", "replicate"]


@dataclass(frozen=True, slots=True)
class Choice:
    """The worker picked for one request, and why.

    reason: `only` (a single eligible worker), `best` (no other candidate within the tie tolerance),
    `load` (tied, and the least loaded), `random` (tied on load too: a seeded draw) or `replicate`
    (a hot prefix warm on too few workers: the best cold candidate).
    """

    worker_id: int
    prediction: Prediction
    candidates: tuple[Prediction, ...]  # best first
    tied: tuple[int, ...]  # worker ids the choice was made among, when more than one
    reason: Reason
    hot: bool = False  # the prompt's prefix is hot
    warm_workers: int | None = None  # eligible workers warm for the prompt; counted only when hot

    def describe(self) -> str:
        """One line for the log."""
        line = f"worker {self.worker_id} ({self.reason}, {self.prediction.total_ms:.0f} ms"
        line += f" of {len(self.candidates)} candidates"
        if self.tied:
            line += f", tied with {', '.join(str(w) for w in self.tied if w != self.worker_id)}"
        if self.hot:
            line += f", hot prefix warm on {self.warm_workers}"
        return line + ")"


def top_k(eligible: int, picker: Picker) -> int:
    """Size of the candidate set: max(top_k_min, ceil(top_k_fraction * eligible)), at least 1, at most eligible."""
    by_fraction = math.ceil(picker.top_k_fraction * eligible - 1e-9)  # 0.2 * 15 is 3.0000000000000004
    return max(1, min(eligible, max(picker.top_k_min, by_fraction)))


def is_warm(prediction: Prediction, picker: Picker) -> bool:
    """The worker holds (or is prefilling) at least replication_warm_threshold_fraction of the prompt."""
    return prediction.cached_blocks >= picker.replication_warm_threshold_fraction * prediction.prompt_blocks


def pick(
    predictions: Sequence[Prediction], picker: Picker, rng: random.Random, *, prefix_share_pct: float = 0.0
) -> Choice:
    """Picks among eligible workers' predictions for one prompt.

    prefix_share_pct: the prompt's prefix's share of recent prompts, in percent (`PrefixHeat.observe`).
    """
    if not predictions:
        raise ValueError("no eligible worker to pick from")
    ranked = sorted(predictions, key=_rank)
    # the best k, and every worker tied with the best: among equal predictions the id order must not
    # decide which workers may be picked (cold prompts on an idle fleet would all go to the lowest ids)
    limit = ranked[0].total_ms + picker.tie_tolerance_ms
    within = sum(1 for p in ranked if p.total_ms <= limit)
    candidates = tuple(ranked[: max(top_k(len(ranked), picker), within)])
    if len(ranked) == 1:
        return Choice(ranked[0].worker_id, ranked[0], candidates, (), "only")

    threshold = picker.replication_threshold_pct
    prompt_blocks = ranked[0].prompt_blocks
    if threshold > 0 and prefix_share_pct > threshold and prompt_blocks > 0:
        warm = sum(1 for p in predictions if is_warm(p, picker))
        cold = [c for c in candidates if not is_warm(c, picker)]
        if warm < picker.replication_warm_target and cold:
            chosen, tied, _ = _break_tie(cold, picker.tie_tolerance_ms, rng)
            return Choice(chosen.worker_id, chosen, candidates, tied, "replicate", True, warm)
        chosen, tied, reason = _break_tie(candidates, picker.tie_tolerance_ms, rng)
        return Choice(chosen.worker_id, chosen, candidates, tied, reason, True, warm)

    chosen, tied, reason = _break_tie(candidates, picker.tie_tolerance_ms, rng)
    return Choice(chosen.worker_id, chosen, candidates, tied, reason)


def _rank(p: Prediction) -> tuple[float, int]:
    return p.total_ms, p.worker_id


def _break_tie(
    ranked: Sequence[Prediction], tolerance_ms: float, rng: random.Random
) -> tuple[Prediction, tuple[int, ...], Reason]:
    """The best of `ranked` (best first); those within tolerance_ms of it are tied and settled by load
    (fewest running + waiting + in flight, then fewest recent prefix blocks, then lowest kv_usage),
    then by a draw from rng."""
    limit = ranked[0].total_ms + tolerance_ms
    tied = [p for p in ranked if p.total_ms <= limit]
    if len(tied) == 1:
        return tied[0], (), "best"
    ids = tuple(p.worker_id for p in tied)
    least = min(_load(p) for p in tied)
    lightest = [p for p in tied if _load(p) == least]
    if len(lightest) == 1:
        return lightest[0], ids, "load"
    lightest.sort(key=lambda p: p.worker_id)  # the draw depends on the seed alone, not on input order
    return rng.choice(lightest), ids, "random"


def _load(p: Prediction) -> tuple[int, int, float]:
    return p.load.pending, p.load.recent_blocks, p.load.kv_usage


def prefix_key(block_keys: Sequence[Hashable], depth: int = PREFIX_KEY_BLOCKS) -> Hashable | None:
    """The key heat is counted under: the key of the prompt's block min(len, depth) - 1; None without blocks."""
    return block_keys[min(len(block_keys), depth) - 1] if block_keys and depth > 0 else None


class PrefixHeat:
    """How common each prefix key is among the last `window` prompts (a sliding window, by count).

    A key's share is 0 until the window has seen `min_samples` prompts, so that the first few prompts
    after a start do not all look hot. Not thread-safe: one owner observes and reads.
    """

    def __init__(self, window: int = 1024, min_samples: int = 32) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.min_samples = min(min_samples, window)
        self._recent: deque[Hashable | None] = deque()
        self._counts: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self._recent)

    def observe(self, key: Hashable | None) -> float:
        """Counts one prompt under `key` (None: a prompt without one, which counts toward the window
        and is never hot) and returns the key's share, in percent, of the window including this prompt."""
        self._recent.append(key)
        if key is not None:
            self._counts[key] += 1
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            if old is not None:
                if self._counts[old] == 1:
                    del self._counts[old]
                else:
                    self._counts[old] -= 1
        return self.share_pct(key)

    def share_pct(self, key: Hashable | None) -> float:
        """The key's share of the window, in percent; 0 below min_samples prompts."""
        n = len(self._recent)
        if key is None or n < self.min_samples or n == 0:
            return 0.0
        return 100.0 * self._counts.get(key, 0) / n


class PrefixFootprint:
    """Per worker, the blocks of the distinct prefixes among the last `window` prompts the router sent
    it: the part of each worker's KV cache that recent traffic keeps in use.

    A prefix is counted under its heat key (`prefix_key`) with the most blocks a prompt under that key
    had. A worker's pool evicts its least recently used blocks first, so a new prefix sent to the worker
    with the smallest footprint displaces blocks nobody asked for lately rather than another tenant's
    prefix. Not thread-safe: one owner observes and reads.
    """

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._recent: deque[tuple[int, Hashable]] = deque()
        self._prefixes: dict[tuple[int, Hashable], list[int]] = {}  # (worker, key) -> [prompts, blocks]
        self._blocks: Counter[int] = Counter()

    def observe(self, worker: int, key: Hashable | None, blocks: int) -> None:
        """One prompt of `blocks` blocks under `key` sent to `worker` (None: no full block; not counted)."""
        if key is None:
            return
        entry = self._prefixes.setdefault((worker, key), [0, 0])
        entry[0] += 1
        if blocks > entry[1]:
            self._blocks[worker] += blocks - entry[1]
            entry[1] = blocks
        self._recent.append((worker, key))
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            entry = self._prefixes[old]
            entry[0] -= 1
            if not entry[0]:
                del self._prefixes[old]
                self._blocks[old[0]] -= entry[1]
                if not self._blocks[old[0]]:
                    del self._blocks[old[0]]

    def blocks(self, worker: int) -> int:
        return self._blocks.get(worker, 0)

    def forget(self, worker: int) -> None:
        """`worker` left: its prefixes no longer count."""
        self._recent = deque(item for item in self._recent if item[0] != worker)
        for pair in [pair for pair in self._prefixes if pair[0] == worker]:
            del self._prefixes[pair]
        self._blocks.pop(worker, None)
