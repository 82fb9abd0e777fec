"""Calibrating a worker set's predictor to its hardware, from the TTFT that Feedback reports.

The `[profile.predictor]` coefficients are guesses; on slower hardware a queued request costs more
than `queue_ms_per_entry`, and a router trusting the default piles requests onto the worker holding
a prefix. `Calibration` fits, per worker set, the observed time to first token of each pick against
the terms its prediction was made of:

    observed_ttft ~ other + offset + queue_scale * queue_ms + prefill_scale * prefill_ms + batch_ms * batch

where queue_ms and prefill_ms are the uncalibrated queue and prefill terms of the prediction, `batch`
the requests in the batch the request joins (B + 1, itself included) and `other` the sum of the rest
(base, forward pass, running penalty, cache pressure, saturation). `batch_ms` is what each request
running beside it costs a new request's first token: the coefficients price running requests only
through the running penalty, which falls back to 0 once a batch is "full", while on hardware that
steps a big batch slower (a CPU, or prefill chunks sharing a token budget) every one of them counts. The
fit is an exponentially weighted least squares (each observation's weight decays by DECAY per newer
one) with a ridge prior of PRIOR_WEIGHT observations pulling it toward the identity (offset 0,
scales 1, batch_ms 0); it is applied only once MIN_OBSERVATIONS observations came, and its scales are
clamped to SCALE_MIN .. SCALE_MAX, its offset to OFFSET_MIN_MS .. OFFSET_MAX_MS and batch_ms to
0 .. BATCH_MS_MAX. Before that, and for a
worker set with no Feedback, predictions are exactly the uncalibrated ones, except for the prefill
scale that the workers' own prefill times imply (`scraped_prefill_scale`, from their /metrics), which
applies from the first pick and is the prior the fit is pulled toward in its place of 1: a router
started in front of a fleet that has served knows how fast its hardware prefills before any Feedback.

The spec's configuration has no key for it: these are module constants (docs/router.md, "Calibration").
An update (on Feedback) is a 4x4 solve; a pick only multiplies three terms by the current factors.
Not thread-safe: the router's event loop owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kiln.router.config import Predictor
    from kiln.router.scrape import PrefillCounters

MIN_OBSERVATIONS = 20  # fitted factors apply from this many TTFT observations on
DECAY = 0.995  # weight kept by each observation per newer one: an effective window of ~200 picks
PRIOR_WEIGHT = 0.1  # the identity counts as this many observations (in each fitted coordinate)
SCALE_MIN, SCALE_MAX = 0.25, 64.0
OFFSET_MIN_MS, OFFSET_MAX_MS = -2000.0, 5000.0
BATCH_MS_MAX = 5000.0
OUTLIER_MS = 600_000.0  # a TTFT above this (10 minutes) is a stuck request, not a latency: ignored
MIN_SCRAPED_PREFILLS = 8  # prefills the workers must have reported before their speed is trusted


@dataclass(frozen=True, slots=True)
class Factors:
    """What a prediction's terms are multiplied by (and shifted by); the identity by default."""

    queue_scale: float = 1.0
    prefill_scale: float = 1.0
    offset_ms: float = 0.0
    batch_ms: float = 0.0  # per request in the batch the new one joins

    @property
    def identity(self) -> bool:
        return self == IDENTITY


IDENTITY = Factors()


def scraped_prefill_scale(p: Predictor, block_size: int, c: PrefillCounters) -> float | None:
    """The prefill scale the workers' summed counters imply: their mean prefill time per request
    against what the coefficients predict for their mean request (its uncached blocks, its prompt's
    blocks). None until they report MIN_SCRAPED_PREFILLS prefills of at least one uncached token."""
    computed = c.prompt_tokens - c.cached_tokens
    if c.prefills < MIN_SCRAPED_PREFILLS or computed <= 0 or c.seconds <= 0 or block_size <= 0:
        return None
    uncached, blocks = computed / c.prefills / block_size, c.prompt_tokens / c.prefills / block_size
    predicted_ms = uncached * (p.attention_uncached_block_ms + p.attention_uncached_per_every_block_ms * blocks)
    if predicted_ms <= 0:
        return None
    return min(SCALE_MAX, max(SCALE_MIN, 1000.0 * c.seconds / c.prefills / predicted_ms))


class Calibration:
    """One worker set's online fit; `factors` is what picks use now (IDENTITY until fitted)."""

    def __init__(self) -> None:
        self.observations = 0  # TTFT observations taken (not decayed)
        self.factors = IDENTITY
        self.prior_prefill_scale = 1.0  # the workers' scraped prefill speed, once known
        self.fitted = IDENTITY  # the last solve, before the MIN_OBSERVATIONS gate
        # Decayed sums over observations of x = (1, queue_ms, prefill_ms, batch) and y = ttft - other:
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4

    def observe(self, ttft_ms: float, queue_ms: float, prefill_ms: float, other_ms: float, batch: float = 0.0) -> None:
        """One pick's observed TTFT and its prediction's uncalibrated terms (`Prediction.features()`)."""
        if not 0.0 < ttft_ms <= OUTLIER_MS or queue_ms < 0 or prefill_ms < 0 or batch < 0:
            return
        x = (1.0, queue_ms, prefill_ms, batch)
        y = ttft_ms - other_ms
        for i in range(4):
            self._xy[i] = DECAY * self._xy[i] + x[i] * y
            row = self._xx[i]
            for j in range(4):
                row[j] = DECAY * row[j] + x[i] * x[j]
        self.observations += 1
        self.fitted = self._solve()
        if self.observations >= MIN_OBSERVATIONS:
            self.factors = self.fitted

    def scraped(self, prefill_scale: float | None) -> None:
        """The prefill scale the workers' /metrics imply now (`scraped_prefill_scale`; None: not known)."""
        if prefill_scale is None or prefill_scale == self.prior_prefill_scale:
            return
        self.prior_prefill_scale = prefill_scale
        if self.observations < MIN_OBSERVATIONS:
            self.factors = Factors(prefill_scale=prefill_scale)

    def _solve(self) -> Factors:
        """The ridge solution toward the identity, clamped."""
        n = self._xx[0][0]  # the decayed count
        prior = (0.0, 1.0, self.prior_prefill_scale, 0.0)
        # The prior's strength in each coordinate: PRIOR_WEIGHT observations of that regressor's mean square.
        ridge = [PRIOR_WEIGHT * max(self._xx[i][i] / n, 1.0) if n > 0 else PRIOR_WEIGHT for i in range(4)]
        a = [[self._xx[i][j] + (ridge[i] if i == j else 0.0) for j in range(4)] for i in range(4)]
        b = [self._xy[i] + ridge[i] * prior[i] for i in range(4)]
        try:
            offset, queue, prefill, batch = np.linalg.solve(a, b).tolist()
        except np.linalg.LinAlgError:  # singular: keep the last fit
            return self.fitted
        return Factors(
            queue_scale=min(SCALE_MAX, max(SCALE_MIN, queue)),
            prefill_scale=min(SCALE_MAX, max(SCALE_MIN, prefill)),
            offset_ms=min(OFFSET_MAX_MS, max(OFFSET_MIN_MS, offset)),
            batch_ms=min(BATCH_MS_MAX, max(0.0, batch)),
        )

    def view(self) -> dict[str, Any]:
        """For /api/state and /metrics."""
        f = self.factors
        return {
            "active": self.observations >= MIN_OBSERVATIONS,
            "observations": self.observations,
            "min_observations": MIN_OBSERVATIONS,
            "scraped_prefill_scale": self.prior_prefill_scale,
            "queue_scale": f.queue_scale,
            "prefill_scale": f.prefill_scale,
            "offset_ms": f.offset_ms,
            "batch_ms": f.batch_ms,
        }

