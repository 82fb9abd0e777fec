"""A worker's expected latency for one request, from its scraped load and its cached prefix.

`predict` is pure arithmetic over a profile's `[profile.predictor]` coefficients; docs/router.md
("Predicting latency and picking a worker") writes the formula out term by term. A `Prediction`
keeps every term, for the dashboard and the debug log, and the load it came from, for the picker.
A worker set's `calibration.Factors` (fitted from Feedback) scale the queue and prefill terms, add an
offset and charge each request of the batch the request joins; the identity leaves the prediction as
the coefficients alone make it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.router.calibration import IDENTITY, Factors

if TYPE_CHECKING:
    from kiln.router.config import Predictor


# WorkerLoad and Prediction are not frozen: a pick makes one of each per eligible worker, and a frozen
# dataclass's __init__ (object.__setattr__ per field) took 2.7x as long, a third of a 64-worker pick
@dataclass(slots=True)
class WorkerLoad:
    """What the router knows about one eligible worker when a request arrives.

    running, waiting: the worker's last scraped `vllm:num_requests_running` and `vllm:num_requests_waiting`,
        less the requests that scrape counted whose Feedback has come since (running ones first).
    kv_usage: its last scraped `vllm:kv_cache_usage_perc`, a fraction in 0..1.
    cached_blocks: leading blocks of this prompt the worker holds, from the prefix index.
    inflight_blocks: further leading blocks (after cached_blocks) that requests the router sent to this
        worker are still prefilling; credited only with `inflight_tracking`.
    inflight: requests the router sent to this worker after the scrape that `running` and `waiting` come
        from began, and has not yet seen finish. The scrape cannot count them, so adding them never counts
        a request twice; the next scrape takes them over and they leave this count.
    adapter_load: the request names an adapter the worker lists but has not loaded (its /v1/models).
    recent_blocks: the blocks of the distinct prefixes the router sent this worker lately (`PrefixFootprint`):
        how much of its cache recent traffic keeps in use. Not a term of the prediction; ties prefer the
        worker with the least, so that new prefixes spread over the caches instead of evicting each other.
    """

    worker_id: int
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    cached_blocks: int = 0
    inflight_blocks: int = 0
    inflight: int = 0
    adapter_load: bool = False  # the request's adapter is not loaded on the worker: it loads it first
    recent_blocks: int = 0

    @property
    def pending(self) -> int:
        """Requests on the worker as far as the router knows: running, waiting and in flight."""
        return self.running + self.waiting + self.inflight


@dataclass(slots=True)
class Prediction:
    """One worker's predicted latency for one request: `total_ms` and the terms it sums."""

    worker_id: int
    total_ms: float
    # the terms; total_ms is their sum
    base_ms: float
    forward_ms: float
    prefill_ms: float
    queue_ms: float
    running_penalty_ms: float
    cache_pressure_ms: float
    saturated_ms: float
    adapter_load_ms: float
    # what the terms were computed from
    load: WorkerLoad
    prompt_blocks: int
    cached_blocks: float  # blocks counted as cached: held, plus in-flight ones weighted by expected_overlap_alpha
    batch: int  # requests running once the router's in-flight ones are admitted (not counting this one)
    queue_entries: int  # requests ahead of this one in the worker's queue
    saturated: bool  # kv_usage reached cache_pressure_saturated_threshold
    offset_ms: float = 0.0  # the calibration's offset, a term of its own
    batch_ms: float = 0.0  # the calibration's charge for the batch: factors.batch_ms x (batch + 1)
    factors: Factors = IDENTITY  # the calibration queue_ms and prefill_ms were scaled by

    def features(self) -> tuple[float, float, float, float]:
        """For calibration: the uncalibrated queue and prefill terms, the sum of the other (unscaled)
        terms (what the total would have been uncalibrated is these three's sum) and the requests
        in the batch the request joins, itself included."""
        f = self.factors
        other = self.total_ms - self.queue_ms - self.prefill_ms - self.offset_ms - self.batch_ms
        return self.queue_ms / f.queue_scale, self.prefill_ms / f.prefill_scale, other, float(self.batch + 1)

    @property
    def uncached_blocks(self) -> float:
        return self.prompt_blocks - self.cached_blocks

    def terms(self) -> dict[str, Any]:
        """The breakdown as plain values, for the dashboard and logs."""
        return {
            "worker_id": self.worker_id,
            "total_ms": self.total_ms,
            "base_ms": self.base_ms,
            "forward_ms": self.forward_ms,
            "prefill_ms": self.prefill_ms,
            "queue_ms": self.queue_ms,
            "running_penalty_ms": self.running_penalty_ms,
            "cache_pressure_ms": self.cache_pressure_ms,
            "saturated_ms": self.saturated_ms,
            "adapter_load_ms": self.adapter_load_ms,
            "prompt_blocks": self.prompt_blocks,
            "cached_blocks": self.cached_blocks,
            "batch": self.batch,
            "queue_entries": self.queue_entries,
            "saturated": self.saturated,
            "offset_ms": self.offset_ms,
            "batch_ms": self.batch_ms,
            "queue_scale": self.factors.queue_scale,
            "prefill_scale": self.factors.prefill_scale,
        }


def running_penalty(p: Predictor, qr: int) -> float:
    """The penalty for `qr` requests running: 0 when idle, rising linearly to `q_running_penalty_peak_ms`
    at `q_running_penalty_peak_qr`, falling linearly back to 0 at `q_running_penalty_falloff_qr`, and 0 from
    there on, where the worker's batch is full and its queue (counted on its own) measures its load."""
    peak, peak_qr, falloff_qr = p.q_running_penalty_peak_ms, p.q_running_penalty_peak_qr, p.q_running_penalty_falloff_qr
    if qr >= falloff_qr:
        return 0.0
    if qr <= peak_qr:
        return peak * qr / peak_qr if peak_qr > 0 else peak
    return peak * (falloff_qr - qr) / (falloff_qr - peak_qr)


def predict(
    p: Predictor, load: WorkerLoad, prompt_blocks: int, inflight_tracking: bool, factors: Factors = IDENTITY
) -> Prediction:
    """The latency, in ms, that `load`'s worker is expected to take over a prompt of `prompt_blocks` blocks,
    with the queue and prefill terms scaled (and the offset added) by `factors`."""
    prompt_blocks = max(0, prompt_blocks)
    # The prefix: what the worker holds, plus what the router's in-flight requests are still prefilling
    # there, weighted by how much of that overlap the router trusts to materialise.
    expected = p.expected_overlap_alpha * load.inflight_blocks if inflight_tracking else 0.0
    cached = min(float(prompt_blocks), max(0.0, load.cached_blocks + expected))
    uncached = prompt_blocks - cached

    # In-flight requests take the concurrent slots that running and (ahead of them) waiting requests
    # leave free; the rest wait in the queue.
    running, waiting, inflight = max(0, load.running), max(0, load.waiting), max(0, load.inflight)
    admitted = min(inflight, max(0, p.inflight_concurrent_capacity - running - waiting))
    batch = running + admitted
    queue_entries = waiting + inflight - admitted

    # Each uncached block costs a fixed amount, plus attention over every block of the prompt.
    prefill = uncached * (p.attention_uncached_block_ms + p.attention_uncached_per_every_block_ms * prompt_blocks)
    prefill *= factors.prefill_scale
    forward = p.forward_pass_ms * (batch + 1)  # one step of the batch this request joins
    queue = p.queue_ms_per_entry * queue_entries * factors.queue_scale
    penalty = running_penalty(p, batch)
    kv_usage = min(1.0, max(0.0, load.kv_usage))
    pressure = p.cache_pressure_penalty_ms * kv_usage
    # A saturated cache admits cold blocks only by evicting or waiting for blocks to free, for this
    # request and for each one queued ahead of it; only the cold share of the prompt pays for it.
    saturated = kv_usage >= p.cache_pressure_saturated_threshold
    cold_share = uncached / prompt_blocks if prompt_blocks else 0.0
    cold = p.saturated_cold_ms_per_entry * (queue_entries + 1) * cold_share if saturated else 0.0
    adapter = p.adapter_load_ms if load.adapter_load else 0.0
    crowd = factors.batch_ms * (batch + 1)  # (0 until calibrated)

    terms = (p.base_ms, forward, prefill, queue, penalty, pressure, cold, adapter, crowd, factors.offset_ms)
    return Prediction(
        worker_id=load.worker_id,
        total_ms=sum(terms),
        base_ms=p.base_ms,
        forward_ms=forward,
        prefill_ms=prefill,
        queue_ms=queue,
        running_penalty_ms=penalty,
        cache_pressure_ms=pressure,
        saturated_ms=cold,
        adapter_load_ms=adapter,
        load=load,
        prompt_blocks=prompt_blocks,
        cached_blocks=cached,
        batch=batch,
        queue_entries=queue_entries,
        saturated=saturated,
        offset_ms=factors.offset_ms,
        batch_ms=crowd,
        factors=factors,
    )


def predict_all(
    p: Predictor,
    loads: Iterable[WorkerLoad],
    prompt_blocks: int,
    inflight_tracking: bool,
    factors: Factors = IDENTITY,
) -> list[Prediction]:
    """`predict` for each worker, in the order given."""
    return [predict(p, load, prompt_blocks, inflight_tracking, factors) for load in loads]
