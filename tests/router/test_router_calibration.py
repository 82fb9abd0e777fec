"""The predictor's calibration from Feedback (kiln/router/calibration.py): identity until enough
observations, the fit recovering a queue cost the coefficients underestimate, its bounds, and what
it does to a pick."""

from __future__ import annotations

import random

import pytest

from kiln.router import calibration
from kiln.router.calibration import IDENTITY, Calibration, Factors, scraped_prefill_scale
from kiln.router.config import Picker, Predictor
from kiln.router.picker import pick
from kiln.router.predictor import WorkerLoad, predict, predict_all
from kiln.router.scrape import PrefillCounters

PROMPT = 400  # blocks: a long shared prefix
DEFAULT = Predictor()
# The worker holding the whole prefix, with a full batch (no running penalty) and one request queued...
LOADED = WorkerLoad(0, running=5, waiting=1, cached_blocks=PROMPT)
# ...and an idle worker without it.
IDLE = WorkerLoad(1)


def observe_hardware(cal: Calibration, n: int, queue_cost: float = 3.0, prefill_cost: float = 1.0, seed: int = 0,
                     batch_cost: float = 0.0):
    """n picks on hardware where a queued request costs `queue_cost` times queue_ms_per_entry, prefill
    `prefill_cost` times the coefficients' prefill and each request of the batch joined `batch_cost` ms,
    with the predictions made as the router makes them (with the calibration of the moment), and their
    TTFTs fed back."""
    rng = random.Random(seed)
    for _ in range(n):
        load = WorkerLoad(
            rng.randrange(4), running=rng.randrange(8), waiting=rng.randrange(5), cached_blocks=rng.randrange(PROMPT)
        )
        prediction = predict(DEFAULT, load, PROMPT, True, cal.factors)
        queue_ms, prefill_ms, other_ms, batch = prediction.features()
        ttft = other_ms + queue_cost * queue_ms + prefill_cost * prefill_ms + batch_cost * batch + rng.gauss(0, 50)
        cal.observe(ttft, queue_ms, prefill_ms, other_ms, batch)


def test_queueing_at_three_times_the_coefficient_turns_the_pick_to_the_idle_worker():
    uncalibrated = predict_all(DEFAULT, [LOADED, IDLE], PROMPT, True)
    assert uncalibrated[0].total_ms < uncalibrated[1].total_ms  # the defaults pile onto the prefix
    assert pick(uncalibrated, Picker(), random.Random(0)).worker_id == 0

    cal = Calibration()
    observe_hardware(cal, 300)
    f = cal.factors
    assert f.queue_scale == pytest.approx(3.0, abs=0.1)
    assert f.prefill_scale == pytest.approx(1.0, abs=0.1)
    assert abs(f.offset_ms) < 150  # (the offset takes a little of the queue cost early on)
    calibrated = predict_all(DEFAULT, [LOADED, IDLE], PROMPT, True, f)
    assert calibrated[0].total_ms > calibrated[1].total_ms
    assert pick(calibrated, Picker(), random.Random(0)).worker_id == 1
    # what the calibrated predictor says is what the hardware does
    loaded = calibrated[0]
    assert loaded.queue_ms == pytest.approx(3 * DEFAULT.queue_ms_per_entry, rel=0.05)


def test_no_observations_change_nothing():
    cal = Calibration()
    assert cal.factors is IDENTITY and cal.factors.identity
    for load in (LOADED, IDLE, WorkerLoad(2, running=2, waiting=3, kv_usage=0.95, cached_blocks=7)):
        assert predict(DEFAULT, load, PROMPT, True, cal.factors) == predict(DEFAULT, load, PROMPT, True)
    assert cal.view() == {
        "active": False,
        "observations": 0,
        "min_observations": calibration.MIN_OBSERVATIONS,
        "scraped_prefill_scale": 1.0,
        "queue_scale": 1.0,
        "prefill_scale": 1.0,
        "offset_ms": 0.0,
        "batch_ms": 0.0,
    }


def test_the_fit_applies_only_from_min_observations_on():
    cal = Calibration()
    observe_hardware(cal, calibration.MIN_OBSERVATIONS - 1)
    assert cal.factors is IDENTITY and not cal.view()["active"]
    assert cal.fitted.queue_scale > 1.5  # fitted already, not applied
    observe_hardware(cal, 1, seed=1)
    assert cal.factors == cal.fitted and cal.view()["active"]


def test_observations_the_predictor_already_matches_keep_the_identity():
    cal = Calibration()
    observe_hardware(cal, 200, queue_cost=1.0, prefill_cost=1.0)
    f = cal.factors
    assert f.queue_scale == pytest.approx(1.0, abs=0.05) and f.prefill_scale == pytest.approx(1.0, abs=0.05)


def test_the_factors_are_clamped():
    cal = Calibration()
    observe_hardware(cal, 200, queue_cost=100.0, prefill_cost=0.0)
    f = cal.factors
    assert f.queue_scale == calibration.SCALE_MAX and f.prefill_scale == calibration.SCALE_MIN
    assert calibration.OFFSET_MIN_MS <= f.offset_ms <= calibration.OFFSET_MAX_MS
    cal = Calibration()
    for _ in range(100):
        cal.observe(50_000.0, 0.0, 0.0, 400.0)  # a constant way above any prediction: all offset
    assert cal.factors.offset_ms == calibration.OFFSET_MAX_MS


def test_unusable_observations_are_ignored():
    cal = Calibration()
    for ttft in (0.0, -5.0, calibration.OUTLIER_MS + 1, float("nan")):
        cal.observe(ttft, 1000.0, 100.0, 400.0)
    cal.observe(500.0, -1.0, 100.0, 400.0)
    assert cal.observations == 0 and cal.factors is IDENTITY


def test_the_fit_follows_a_change_of_hardware():
    cal = Calibration()
    observe_hardware(cal, 300, queue_cost=3.0)
    observe_hardware(cal, 1500, queue_cost=1.5, seed=1)  # older observations decay away
    assert cal.factors.queue_scale == pytest.approx(1.5, abs=0.1)


def test_features_are_the_uncalibrated_terms():
    f = Factors(queue_scale=2.5, prefill_scale=0.5, offset_ms=120.0, batch_ms=30.0)
    load = WorkerLoad(3, running=3, waiting=2, kv_usage=0.4, cached_blocks=100, inflight=1)
    plain, scaled = predict(DEFAULT, load, PROMPT, True), predict(DEFAULT, load, PROMPT, True, f)
    assert scaled.features() == pytest.approx(
        (plain.queue_ms, plain.prefill_ms, plain.total_ms - plain.queue_ms - plain.prefill_ms, plain.batch + 1)
    )
    assert scaled.batch_ms == 30.0 * (plain.batch + 1)
    assert scaled.total_ms == pytest.approx(
        plain.total_ms + 1.5 * plain.queue_ms - 0.5 * plain.prefill_ms + 120.0 + scaled.batch_ms
    )
    assert scaled.terms()["queue_scale"] == 2.5 and scaled.terms()["offset_ms"] == 120.0


def test_a_crowded_batch_the_coefficients_do_not_price_turns_the_pick_to_the_idle_worker():
    """Past q_running_penalty_falloff_qr the running penalty is 0: a worker running 7 requests with the
    prefix looks cheaper than an idle one without it. Where each running request delays a new one's first
    token (here 400 ms), the fitted batch_ms prices that in."""
    busy, idle = WorkerLoad(0, running=7, cached_blocks=PROMPT), WorkerLoad(1)
    uncalibrated = predict_all(DEFAULT, [busy, idle], PROMPT, True)
    assert pick(uncalibrated, Picker(), random.Random(0)).worker_id == 0

    cal = Calibration()
    observe_hardware(cal, 300, queue_cost=1.0, batch_cost=400.0)
    assert cal.factors.batch_ms == pytest.approx(400.0, rel=0.1)
    assert cal.factors.queue_scale == pytest.approx(1.0, abs=0.1)
    calibrated = predict_all(DEFAULT, [busy, idle], PROMPT, True, cal.factors)
    assert pick(calibrated, Picker(), random.Random(0)).worker_id == 1
    cal = Calibration()
    observe_hardware(cal, 300, batch_cost=-300.0)  # never below 0: more running requests never help
    assert cal.factors.batch_ms == 0.0


def test_the_workers_scraped_prefill_speed_sets_the_prefill_scale_before_any_feedback():
    # 10 requests of 10 blocks (16 tokens each), 2 of them cached: 8 uncached blocks each, which the
    # coefficients price at 8 x (2.3 + 0.009 x 10) = 19.12 ms; the workers took 478 ms each
    measured = PrefillCounters(seconds=4.78, prefills=10, prompt_tokens=1600, cached_tokens=320)
    scale = scraped_prefill_scale(DEFAULT, 16, measured)
    assert scale == pytest.approx(25.0)
    # too few prefills, nothing prefilled, no time: not known
    few = PrefillCounters(4.78, calibration.MIN_SCRAPED_PREFILLS - 1, 1600, 320)
    assert scraped_prefill_scale(DEFAULT, 16, few) is None
    assert scraped_prefill_scale(DEFAULT, 16, PrefillCounters(4.78, 10, 1600, 1600)) is None
    assert scraped_prefill_scale(DEFAULT, 16, PrefillCounters(0.0, 10, 1600, 320)) is None
    assert scraped_prefill_scale(DEFAULT, 16, PrefillCounters(1e6, 10, 1600, 320)) == calibration.SCALE_MAX  # clamped
    cal = Calibration()
    cal.scraped(None)
    assert cal.factors is IDENTITY
    cal.scraped(scale)
    assert cal.factors == Factors(prefill_scale=scale) and cal.view()["scraped_prefill_scale"] == scale
    assert not cal.view()["active"]
    # a 28-block prompt, held by a worker running one request: the coefficients send it to an idle worker
    # to prefill cold; priced at the measured speed, the cold prefill loses to the worker holding it
    cold, warm = WorkerLoad(0), WorkerLoad(1, running=1, cached_blocks=28)
    assert pick(predict_all(DEFAULT, [cold, warm], 28, True), Picker(), random.Random(0)).worker_id == 0
    assert pick(predict_all(DEFAULT, [cold, warm], 28, True, cal.factors), Picker(), random.Random(0)).worker_id == 1
    assert predict(DEFAULT, cold, 28, True, cal.factors).prefill_ms == pytest.approx(
        25 * predict(DEFAULT, cold, 28, True).prefill_ms
    )
    # the fit takes over from MIN_OBSERVATIONS on, pulled toward the scraped scale rather than 1
    observe_hardware(cal, calibration.MIN_OBSERVATIONS, prefill_cost=25.0)
    assert cal.view()["active"] and cal.factors.prefill_scale == pytest.approx(25.0, rel=0.1)
