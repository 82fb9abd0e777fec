"""The router's latency predictor (kiln/router/predictor.py) and picker (kiln/router/picker.py): each
coefficient's term, monotonicity, the candidate set, ties, seeded draws and hot-prefix replication."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.router.config import Picker, Predictor
from kiln.router.picker import PrefixFootprint, PrefixHeat, pick, prefix_key, top_k
from kiln.router.predictor import WorkerLoad, predict, predict_all, running_penalty

ROOT = Path(__file__).resolve().parents[2]

ZERO = {name: 0 for name in Predictor.model_fields}  # every term off


def only(**coefficients) -> Predictor:
    """A predictor whose coefficients are all 0 but those given."""
    return Predictor.model_validate({**ZERO, **coefficients})


def ms(p: Predictor, prompt_blocks: int = 10, tracking: bool = True, **load) -> float:
    return predict(p, WorkerLoad(worker_id=0, **load), prompt_blocks, tracking).total_ms


# ---- each term on its own --------------------------------------------------------------------------


def test_all_coefficients_zero_predicts_zero():
    assert ms(only(), running=3, waiting=4, kv_usage=0.95, inflight=7, inflight_blocks=2) == 0


def test_base_ms_is_added_to_every_prediction():
    assert ms(only(base_ms=400)) == 400
    assert ms(only(base_ms=400), prompt_blocks=0, running=9, waiting=9) == 400


def test_forward_pass_ms_is_charged_for_the_batch_the_request_joins():
    p = only(forward_pass_ms=10, inflight_concurrent_capacity=5)
    assert ms(p) == 10  # an idle worker: a batch of one
    assert ms(p, running=3) == 40
    assert ms(p, running=3, inflight=1) == 50  # an admitted in-flight request joins the batch
    assert ms(p, running=3, inflight=4) == 60  # only 2 slots were free; the other 2 wait
    assert ms(p, waiting=8) == 10  # waiting requests are not in the batch


def test_queue_ms_per_entry_is_charged_per_request_ahead():
    p = only(queue_ms_per_entry=1000, inflight_concurrent_capacity=5)
    assert ms(p, waiting=3) == 3000
    assert ms(p, running=4, inflight=3) == 2000  # one in-flight request fits, two queue
    # of 4 free slots the 2 waiting requests take 2 first; 2 of 3 in-flight ones fit: 2 + 1 ahead
    assert ms(p, running=1, waiting=2, inflight=3) == 3000
    assert ms(p, running=9) == 0


def test_attention_uncached_block_ms_is_charged_per_uncached_block():
    p = only(attention_uncached_block_ms=2.0)
    assert ms(p, prompt_blocks=10) == 20
    assert ms(p, prompt_blocks=10, cached_blocks=4) == 12
    assert ms(p, prompt_blocks=10, cached_blocks=40) == 0  # a longer cached prefix is capped at the prompt


def test_attention_uncached_per_every_block_ms_grows_with_the_whole_prompt():
    p = only(attention_uncached_per_every_block_ms=0.5)
    assert ms(p, prompt_blocks=10, cached_blocks=4) == pytest.approx(6 * 10 * 0.5)
    assert ms(p, prompt_blocks=20, cached_blocks=14) == pytest.approx(6 * 20 * 0.5)  # same new blocks, longer prompt
    assert ms(p, prompt_blocks=10, cached_blocks=10) == 0


def test_cache_pressure_penalty_ms_scales_with_kv_usage():
    p = only(cache_pressure_penalty_ms=100, cache_pressure_saturated_threshold=2)
    assert ms(p, kv_usage=0.0) == 0
    assert ms(p, kv_usage=0.25) == 25
    assert ms(p, kv_usage=1.0) == 100
    assert ms(p, kv_usage=1.5) == 100  # usage is clamped to 0..1


def test_saturated_cold_ms_is_charged_from_the_threshold_per_entry_for_the_cold_share():
    p = only(saturated_cold_ms_per_entry=1000, cache_pressure_saturated_threshold=0.9)
    assert ms(p, kv_usage=0.89) == 0  # below the threshold
    assert ms(p, kv_usage=0.9) == 1000  # at it: this request, all cold
    assert ms(p, kv_usage=0.95, waiting=2) == 3000  # and each one queued ahead
    assert ms(p, kv_usage=0.95, waiting=2, cached_blocks=5) == 1500  # half the prompt is cold
    assert ms(p, kv_usage=1.0, waiting=2, cached_blocks=10) == 0  # a fully cached prompt evicts nothing
    assert ms(p, kv_usage=1.0, prompt_blocks=0) == 0
    prediction = predict(p, WorkerLoad(0, kv_usage=0.95), 10, True)
    assert prediction.saturated and prediction.saturated_ms == 1000


def test_saturated_threshold_moves_where_saturation_starts():
    assert ms(only(saturated_cold_ms_per_entry=1000, cache_pressure_saturated_threshold=0.5), kv_usage=0.6) == 1000
    assert ms(only(saturated_cold_ms_per_entry=1000, cache_pressure_saturated_threshold=0.7), kv_usage=0.6) == 0


def test_running_penalty_rises_to_its_peak_and_falls_off():
    p = only(q_running_penalty_peak_ms=700, q_running_penalty_peak_qr=2, q_running_penalty_falloff_qr=5)
    shape = [running_penalty(p, qr) for qr in range(8)]
    assert shape == pytest.approx([0, 350, 700, 700 * 2 / 3, 700 / 3, 0, 0, 0])
    # the worker's running requests and the admitted in-flight ones both count
    q = p.model_copy(update={"inflight_concurrent_capacity": 5})
    assert ms(q, running=2) == 700
    assert ms(q, running=1, inflight=1) == 700
    assert ms(q, running=3, waiting=2, inflight=1) == pytest.approx(700 * 2 / 3)  # the in-flight one waits


@pytest.mark.parametrize(
    ("peak_qr", "falloff_qr", "expected"),
    [
        (0, 4, [700, 525, 350, 175, 0]),  # no rising side: the peak is at 0
        (3, 3, [0, 700 / 3, 1400 / 3, 0, 0]),  # no falling side
        (4, 2, [0, 175, 0, 0, 0]),  # falloff before the peak: cut off there
    ],
)
def test_running_penalty_degenerate_shapes_are_defined(peak_qr, falloff_qr, expected):
    p = only(q_running_penalty_peak_ms=700, q_running_penalty_peak_qr=peak_qr, q_running_penalty_falloff_qr=falloff_qr)
    assert [running_penalty(p, qr) for qr in range(5)] == pytest.approx(expected)


def test_inflight_concurrent_capacity_decides_which_inflight_requests_queue():
    def queued(capacity, **load):
        return predict(only(inflight_concurrent_capacity=capacity), WorkerLoad(0, **load), 10, True).queue_entries

    assert queued(5, running=2, inflight=2) == 0
    assert queued(5, running=2, inflight=4) == 1
    assert queued(2, running=2, inflight=4) == 4
    assert queued(0, inflight=3) == 3
    assert queued(5, running=7, inflight=1) == 1  # a worker past the capacity admits none


def test_expected_overlap_alpha_weights_the_prefix_still_being_prefilled():
    p = only(attention_uncached_block_ms=1.0, expected_overlap_alpha=1.0)
    assert ms(p, cached_blocks=2, inflight_blocks=4) == 4  # 2 held + 4 on their way: 4 of 10 uncached
    assert ms(p.model_copy(update={"expected_overlap_alpha": 0.5}), cached_blocks=2, inflight_blocks=4) == 6
    assert ms(p.model_copy(update={"expected_overlap_alpha": 0.0}), cached_blocks=2, inflight_blocks=4) == 8
    assert ms(p, cached_blocks=6, inflight_blocks=9) == 0  # capped at the prompt


def test_inflight_tracking_off_ignores_the_prefix_in_flight():
    p = only(attention_uncached_block_ms=1.0)
    assert ms(p, tracking=False, cached_blocks=2, inflight_blocks=4) == 8
    # the router's in-flight requests still count as load
    q = only(queue_ms_per_entry=100, inflight_concurrent_capacity=0)
    assert ms(q, tracking=False, inflight=3) == 300


def test_every_coefficient_changes_some_prediction():
    """No coefficient is dead: moving each one off its default moves the prediction of a busy, saturated,
    partly cached worker (kv_usage 0.95, 3 running, 1 waiting, 2 in flight, 3 of 10 blocks held, 2 in flight)
    that has the request's adapter still to load."""
    load = WorkerLoad(0, running=3, waiting=1, kv_usage=0.95, cached_blocks=3, inflight_blocks=2, inflight=2,
                      adapter_load=True)
    default = Predictor()
    base = predict(default, load, 10, True).total_ms
    changed = {
        "base_ms": 500.0,
        "forward_pass_ms": 10.0,
        "queue_ms_per_entry": 900.0,
        "attention_uncached_block_ms": 3.0,
        "attention_uncached_per_every_block_ms": 0.5,
        "cache_pressure_penalty_ms": 100.0,
        "cache_pressure_saturated_threshold": 0.99,
        "saturated_cold_ms_per_entry": 5000.0,
        "q_running_penalty_peak_ms": 100.0,
        "q_running_penalty_peak_qr": 3,
        "q_running_penalty_falloff_qr": 8,
        "inflight_concurrent_capacity": 9,
        "expected_overlap_alpha": 0.5,
        "adapter_load_ms": 200.0,
    }
    assert set(changed) == set(Predictor.model_fields)
    for name, value in changed.items():
        p = default.model_copy(update={name: value})
        assert predict(p, load, 10, True).total_ms != base, name


def test_defaults_on_an_idle_cold_worker():
    prediction = predict(Predictor(), WorkerLoad(7), 100, True)
    assert prediction.worker_id == 7
    assert prediction.total_ms == pytest.approx(400 + 100 * (2.3 + 0.009 * 100))
    assert prediction.terms()["prefill_ms"] == pytest.approx(320)


# ---- properties ----------------------------------------------------------------------------------------

loads = st.builds(
    WorkerLoad,
    worker_id=st.integers(0, 63),
    running=st.integers(0, 40),
    waiting=st.integers(0, 40),
    kv_usage=st.floats(0, 1),
    cached_blocks=st.integers(0, 300),
    inflight_blocks=st.integers(0, 300),
    inflight=st.integers(0, 20),
)
ms_coefficient = st.floats(0, 5000, allow_nan=False)
predictors = st.builds(
    Predictor,
    base_ms=ms_coefficient,
    forward_pass_ms=ms_coefficient,
    queue_ms_per_entry=ms_coefficient,
    attention_uncached_block_ms=st.floats(0, 50),
    attention_uncached_per_every_block_ms=st.floats(0, 1),
    cache_pressure_penalty_ms=ms_coefficient,
    cache_pressure_saturated_threshold=st.floats(0, 1.2),
    saturated_cold_ms_per_entry=ms_coefficient,
    q_running_penalty_peak_ms=ms_coefficient,
    q_running_penalty_peak_qr=st.integers(0, 8),
    q_running_penalty_falloff_qr=st.integers(0, 12),
    inflight_concurrent_capacity=st.integers(0, 16),
    expected_overlap_alpha=st.floats(0, 2),
)
prompts = st.integers(0, 300)


@settings(max_examples=300, deadline=None)
@given(predictors, loads, prompts, st.booleans())
def test_the_terms_add_up_to_the_total(p, load, prompt_blocks, tracking):
    r = predict(p, load, prompt_blocks, tracking)
    terms = r.base_ms + r.forward_ms + r.prefill_ms + r.queue_ms + r.running_penalty_ms
    assert r.total_ms == pytest.approx(terms + r.cache_pressure_ms + r.saturated_ms)
    assert 0 <= r.cached_blocks <= prompt_blocks
    assert r.total_ms >= p.base_ms


@settings(max_examples=300, deadline=None)
@given(predictors, loads, prompts, st.booleans(), st.integers(1, 50))
def test_more_cached_blocks_never_raise_the_prediction(p, load, prompt_blocks, tracking, more):
    before = predict(p, load, prompt_blocks, tracking).total_ms
    held = predict(p, replace(load, cached_blocks=load.cached_blocks + more), prompt_blocks, tracking).total_ms
    prefilling = predict(p, replace(load, inflight_blocks=load.inflight_blocks + more), prompt_blocks, tracking)
    assert held <= before + 1e-6
    assert prefilling.total_ms <= before + 1e-6


@settings(max_examples=300, deadline=None)
@given(predictors, loads, prompts, st.booleans(), st.integers(1, 20))
def test_more_waiting_never_lowers_the_prediction(p, load, prompt_blocks, tracking, more):
    # Waiting requests can push in-flight ones out of the batch, lowering the batch's terms; the documented
    # condition keeps the queue's growth ahead of that: 2 * queue_ms_per_entry >= forward_pass_ms + peak / peak_qr.
    slope = p.q_running_penalty_peak_ms / max(1, p.q_running_penalty_peak_qr)
    p = p.model_copy(update={"queue_ms_per_entry": max(p.queue_ms_per_entry, (p.forward_pass_ms + slope) / 2)})
    before = predict(p, load, prompt_blocks, tracking).total_ms
    after = predict(p, replace(load, waiting=load.waiting + more), prompt_blocks, tracking).total_ms
    assert after >= before - 1e-6


@settings(max_examples=200, deadline=None)
@given(loads, prompts, st.booleans(), st.integers(1, 20))
def test_more_waiting_never_lowers_the_default_prediction(load, prompt_blocks, tracking, more):
    p = Predictor()
    before = predict(p, load, prompt_blocks, tracking).total_ms
    assert predict(p, replace(load, waiting=load.waiting + more), prompt_blocks, tracking).total_ms >= before


@settings(max_examples=300, deadline=None)
@given(predictors, loads, prompts, st.booleans(), st.integers(1, 20))
def test_more_running_never_lowers_the_prediction_with_enough_forward_pass_ms(p, load, prompt_blocks, tracking, more):
    # the running penalty alone falls between its peak and its falloff; the forward term offsets that
    peak_qr = p.q_running_penalty_peak_qr
    falloff_qr = max(p.q_running_penalty_falloff_qr, peak_qr + 1)
    slope = p.q_running_penalty_peak_ms / (falloff_qr - peak_qr)
    p = p.model_copy(
        update={"q_running_penalty_falloff_qr": falloff_qr, "forward_pass_ms": max(p.forward_pass_ms, slope)}
    )
    before = predict(p, load, prompt_blocks, tracking).total_ms
    after = predict(p, replace(load, running=load.running + more), prompt_blocks, tracking).total_ms
    assert after >= before - 1e-6


# ---- the picker --------------------------------------------------------------------------------------------

ONLY_BASE = only(base_ms=100)


def preds(*totals, prompt_blocks=10, **load):
    """Predictions with the given totals (base_ms alone), workers numbered from 0."""
    return [
        predict(only(base_ms=t), WorkerLoad(worker_id=i, **load), prompt_blocks, True) for i, t in enumerate(totals)
    ]


def picker(**values) -> Picker:
    return Picker.model_validate({"tie_tolerance_ms": 0, **values})


@pytest.mark.parametrize(
    ("eligible", "top_k_min", "fraction", "expected"),
    [(1, 2, 0.2, 1), (2, 2, 0.2, 2), (10, 2, 0.2, 2), (11, 2, 0.2, 3), (15, 2, 0.2, 3), (64, 2, 0.2, 13)]
    + [(64, 20, 0.2, 20), (8, 0, 0.0, 1), (8, 2, 1.0, 8), (3, 10, 0.2, 3)],
)
def test_top_k_size(eligible, top_k_min, fraction, expected):
    assert top_k(eligible, picker(top_k_min=top_k_min, top_k_fraction=fraction)) == expected


def test_candidates_are_the_k_best_best_first():
    choice = pick(preds(500, 100, 300, 200, 400), picker(top_k_min=3), random.Random(0))
    assert [c.worker_id for c in choice.candidates] == [1, 3, 2]
    assert (choice.worker_id, choice.reason, choice.tied) == (1, "best", ())
    assert choice.prediction.total_ms == 100


def test_a_single_worker_is_picked_alone():
    choice = pick(preds(900), picker(), random.Random(0))
    assert (choice.worker_id, choice.reason) == (0, "only")


def test_no_workers_is_an_error():
    with pytest.raises(ValueError):
        pick([], picker(), random.Random(0))


def test_tie_tolerance_makes_close_predictions_a_tie_settled_by_load():
    busy = predict(ONLY_BASE, WorkerLoad(0, running=5), 10, True)
    idle = predict(only(base_ms=140), WorkerLoad(1), 10, True)
    choice = pick([busy, idle], picker(tie_tolerance_ms=50), random.Random(0))
    assert (choice.worker_id, choice.reason, choice.tied) == (1, "load", (0, 1))
    choice = pick([busy, idle], picker(tie_tolerance_ms=30), random.Random(0))
    assert (choice.worker_id, choice.reason) == (0, "best")


def test_load_tie_break_counts_running_waiting_inflight_then_kv_usage():
    def worker(i, **load):
        return predict(ONLY_BASE, WorkerLoad(i, **load), 10, True)

    workers = [worker(0, running=1, waiting=1, inflight=1), worker(1, running=2), worker(2, waiting=1, inflight=1)]
    assert pick(workers, picker(top_k_min=3, tie_tolerance_ms=1), random.Random(0)).worker_id in (1, 2)
    workers = [worker(0, running=2, kv_usage=0.5), worker(1, waiting=2, kv_usage=0.2), worker(2, inflight=3)]
    choice = pick(workers, picker(top_k_min=3, tie_tolerance_ms=1), random.Random(0))
    assert (choice.worker_id, choice.reason) == (1, "load")


def test_workers_within_the_tolerance_of_the_best_are_candidates_beyond_k():
    def worker(i, total, running):
        return predict(only(base_ms=total), WorkerLoad(i, running=running), 10, True)

    # k is 2, but worker 2 is within the tolerance of the best: a candidate, tied, and the least loaded
    workers = [worker(0, 100, 5), worker(1, 110, 4), worker(2, 120, 0), worker(3, 151, 0)]
    choice = pick(workers, picker(top_k_min=2, tie_tolerance_ms=50), random.Random(0))
    assert [c.worker_id for c in choice.candidates] == [0, 1, 2]
    assert (choice.worker_id, choice.reason, choice.tied) == (2, "load", (0, 1, 2))


def test_equal_predictions_do_not_favour_low_worker_ids():
    # eight idle workers predicting alike for a cold prompt; k is 2: every one of them gets picks
    workers = preds(100, 100, 100, 100, 100, 100, 100, 100)
    rng = random.Random(0)
    picked = {pick(workers, picker(top_k_min=2), rng).worker_id for _ in range(200)}
    assert picked == set(range(8))


def test_ties_prefer_the_worker_whose_cache_recent_prefixes_use_least():
    def worker(i, recent, **load):
        return predict(ONLY_BASE, WorkerLoad(i, recent_blocks=recent, **load), 10, True)

    workers = [worker(0, 90), worker(1, 30), worker(2, 60)]
    assert pick(workers, picker(top_k_min=3, tie_tolerance_ms=1), random.Random(0)).worker_id == 1
    # load comes first: a busier worker with room loses to an idle one without
    workers = [worker(0, 90), worker(1, 30, running=1)]
    assert pick(workers, picker(tie_tolerance_ms=1), random.Random(0)).worker_id == 0


def test_prefix_footprint_counts_distinct_prefixes_per_worker_over_a_window():
    footprint = PrefixFootprint(window=4)
    footprint.observe(0, "a", 28)
    footprint.observe(0, "a", 29)  # the same prefix, a longer prompt: its largest size counts once
    footprint.observe(1, "b", 10)
    footprint.observe(0, None, 50)  # no full block: not counted
    assert (footprint.blocks(0), footprint.blocks(1), footprint.blocks(2)) == (29, 10, 0)
    footprint.observe(0, "c", 5)
    footprint.observe(2, "a", 28)
    assert footprint.blocks(0) == 34  # one of a's two prompts slid out; a is still recent on worker 0
    footprint.observe(1, "b", 10)
    footprint.observe(1, "b", 10)
    assert (footprint.blocks(0), footprint.blocks(1), footprint.blocks(2)) == (5, 10, 28)
    footprint.forget(1)
    footprint.observe(3, "d", 1)
    footprint.observe(3, "d", 1)
    assert (footprint.blocks(1), footprint.blocks(3)) == (0, 1)
    with pytest.raises(ValueError):
        PrefixFootprint(window=0)


def test_seeded_draws_are_deterministic_and_vary_with_the_seed():
    workers = preds(100, 100, 100, 100, 100, 100, 100, 100)
    cfg = picker(top_k_min=8, tie_tolerance_ms=50)

    def draws(seed):
        rng = random.Random(seed)
        return [pick(workers, cfg, rng).worker_id for _ in range(20)]

    assert draws(1) == draws(1)
    assert len({tuple(draws(seed)) for seed in range(10)}) > 1
    assert len(set(draws(1))) > 1  # one rng, many picks: not always the same worker
    first = pick(workers, cfg, random.Random(3))
    assert first.reason == "random" and first.tied == tuple(range(8))
    assert pick(list(reversed(workers)), cfg, random.Random(3)).worker_id == first.worker_id


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2000), st.integers(0, 10), st.floats(0, 1)), min_size=1, max_size=64))
def test_the_pick_is_a_candidate_within_the_tolerance_of_the_best(workers):
    predictions = [
        predict(only(base_ms=t), WorkerLoad(i, running=r, kv_usage=kv), 10, True)
        for i, (t, r, kv) in enumerate(workers)
    ]
    cfg = picker(tie_tolerance_ms=50)
    choice = pick(predictions, cfg, random.Random(0))
    assert choice.prediction in choice.candidates
    best = min(t for t, _, _ in workers)
    within = sum(1 for t, _, _ in workers if t <= best + 50)
    assert len(choice.candidates) == max(top_k(len(predictions), cfg), within)
    assert choice.prediction.total_ms <= best + 50
    assert all(c.total_ms >= best for c in choice.candidates)
    assert pick(predictions, cfg, random.Random(0)) == choice


# ---- hot-prefix replication ----------------------------------------------------------------------------------

REPLICATE = {"top_k_min": 4, "replication_threshold_pct": 10.0, "replication_warm_target": 2}


def cluster(cached, prompt_blocks=10, **extra):
    """Workers 0.. with the given cached blocks of a 10-block prompt, predicted with the defaults."""
    loads = [WorkerLoad(i, cached_blocks=c, **extra) for i, c in enumerate(cached)]
    return predict_all(Predictor(), loads, prompt_blocks, True)


def test_a_hot_prefix_goes_to_the_best_cold_candidate_until_the_warm_target_is_met():
    rng = random.Random(0)
    cached = [10, 0, 0, 0, 0]
    cfg = picker(**REPLICATE)
    choice = pick(cluster(cached), cfg, rng, prefix_share_pct=50)
    assert (choice.reason, choice.hot, choice.warm_workers) == ("replicate", True, 1)
    assert choice.worker_id in (1, 2, 3)  # a cold candidate (the best four); they predict alike: a draw
    cached[choice.worker_id] = 10  # the prefix is now warm there
    choice = pick(cluster(cached), cfg, rng, prefix_share_pct=50)
    assert choice.reason != "replicate" and choice.warm_workers == 2
    assert cached[choice.worker_id] == 10  # a warm worker, as a normal pick would


def test_replication_follows_the_predictions_among_cold_candidates():
    loads = [WorkerLoad(0, cached_blocks=10), WorkerLoad(1, waiting=1), WorkerLoad(2), WorkerLoad(3, running=2)]
    predictions = predict_all(Predictor(), loads, 10, True)
    choice = pick(predictions, picker(**REPLICATE), random.Random(0), prefix_share_pct=50)
    assert (choice.worker_id, choice.reason) == (2, "replicate")


def test_no_replication_below_the_threshold_or_when_it_is_zero():
    predictions = cluster([10, 0, 0, 0])
    for cfg, share in [
        (picker(**REPLICATE), 10.0),
        (picker(**{**REPLICATE, "replication_threshold_pct": 0}), 100),
    ]:
        choice = pick(predictions, cfg, random.Random(0), prefix_share_pct=share)
        assert (choice.worker_id, choice.reason, choice.hot) == (0, "best", False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10), min_size=1, max_size=16), st.floats(0, 100), st.integers(0, 2**32))
def test_threshold_zero_never_replicates(cached, share, seed):
    predictions = cluster(cached)
    cfg = picker(top_k_min=4, tie_tolerance_ms=50)
    choice = pick(predictions, cfg, random.Random(seed), prefix_share_pct=share)
    assert choice.reason != "replicate" and not choice.hot
    assert choice == pick(predictions, cfg, random.Random(seed))


def test_no_replication_once_warm_enough_or_without_a_cold_candidate():
    cfg = picker(**REPLICATE)
    # warm on two already (the fraction is 0.5: 5 of 10 blocks is warm)
    choice = pick(cluster([10, 5, 0, 0]), cfg, random.Random(0), prefix_share_pct=50)
    assert (choice.worker_id, choice.reason, choice.warm_workers) == (0, "best", 2)
    # warm on one, but every candidate is warm: the cold worker is not among the best two
    narrow = picker(**{**REPLICATE, "top_k_min": 1, "top_k_fraction": 0.0})
    choice = pick(cluster([10, 0]), narrow, random.Random(0), prefix_share_pct=50)
    assert (choice.worker_id, choice.reason, choice.hot) == (0, "best", True)


def test_a_prefix_being_prefilled_counts_as_warm():
    predictions = cluster([10, 0, 0, 0])
    predictions[1] = predict(Predictor(), WorkerLoad(1, inflight_blocks=10, inflight=1), 10, True)
    choice = pick(predictions, picker(**REPLICATE), random.Random(0), prefix_share_pct=50)
    assert choice.reason != "replicate" and choice.warm_workers == 2


def test_the_warm_fraction_decides_what_counts_as_warm():
    predictions = cluster([10, 3, 0, 0])
    loose = picker(**{**REPLICATE, "replication_warm_threshold_fraction": 0.3})
    strict = picker(**{**REPLICATE, "replication_warm_threshold_fraction": 0.4})
    assert pick(predictions, loose, random.Random(0), prefix_share_pct=50).warm_workers == 2
    assert pick(predictions, strict, random.Random(0), prefix_share_pct=50).reason == "replicate"


def test_replication_reaches_the_warm_target_over_a_stream_of_hot_prompts():
    heat = PrefixHeat(window=100, min_samples=10)
    cfg = picker(**{**REPLICATE, "replication_warm_target": 3, "top_k_min": 8})
    cached = [0] * 8
    rng = random.Random(7)
    replicated = []
    for _ in range(40):
        share = heat.observe(prefix_key([11, 22, 33, 44, 55]))
        choice = pick(cluster(cached), cfg, rng, prefix_share_pct=share)
        if choice.reason == "replicate":
            replicated.append(choice.worker_id)
        cached[choice.worker_id] = 10
    assert sum(c == 10 for c in cached) == 3  # warm on exactly the target
    assert len(replicated) == 2 and len(set(replicated)) == 2


# ---- heat ------------------------------------------------------------------------------------------------


def test_prefix_key_names_the_first_blocks():
    assert prefix_key([1, 2, 3, 4, 5, 6]) == 4
    assert prefix_key([1, 2]) == 2
    assert prefix_key([1, 2, 3], depth=1) == 1
    assert prefix_key([]) is None


def test_prefix_heat_is_a_share_of_a_sliding_window():
    heat = PrefixHeat(window=4, min_samples=2)
    assert heat.observe("a") == 0  # below min_samples
    assert heat.observe("a") == 100
    assert heat.observe("b") == pytest.approx(100 / 3)
    assert heat.observe(None) == 0
    assert heat.share_pct("a") == 50
    assert heat.observe("b") == 50  # the first "a" has left the window
    assert heat.share_pct("a") == 25
    heat.observe("b")
    assert (len(heat), heat.share_pct("a"), heat.share_pct("b")) == (4, 0, 75)


def test_prefix_heat_rejects_an_empty_window():
    with pytest.raises(ValueError):
        PrefixHeat(window=0)


def test_describe_is_one_line():
    choice = pick(preds(100, 100, 300), picker(tie_tolerance_ms=50), random.Random(0))
    line = choice.describe()
    assert "\n" not in line and f"worker {choice.worker_id}" in line and "random" in line


# ---- imports ------------------------------------------------------------------------------------------------


def test_the_predictor_and_picker_import_no_model_code():
    code = (
        "import sys\n"
        "import kiln.router.picker, kiln.router.predictor\n"
        "heavy = ('jax', 'kiln.engine', 'kiln.models', 'kiln.server', 'kiln.train', 'kiln.eval')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'jax' or m.startswith(heavy))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
