"""Two runs on the same items, compared criterion by criterion.

For each testing criterion: each run's pass rate and mean score, the paired difference
(B minus A) of both with a percentile bootstrap confidence interval that resamples items
(pairs stay together, so the interval reflects how the two runs differ on the same items, not
how hard the items are), and the items that flipped: passed in A and not in B (`regressed`),
or the reverse (`improved`). Pairs where either side's grader errored are left out of the
statistics and counted. The bootstrap is seeded, so the same runs give the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.errors import InvalidRequest

BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95


def paired_bootstrap(differences: np.ndarray, seed: int, samples: int = BOOTSTRAP_SAMPLES,
                     confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of the mean of `differences`, resampled with replacement."""
    rng = np.random.default_rng(seed)
    n = len(differences)
    means = differences[rng.integers(0, n, size=(samples, n))].mean(axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def _by_index(outcomes: Sequence[dict]) -> dict[int, dict]:
    return {o["datasource_item_id"]: o for o in outcomes}


def _result(outcome: dict, name: str) -> dict | None:
    return next((r for r in outcome["results"] if r["name"] == name), None)


def _difference(a: np.ndarray, b: np.ndarray, seed: int, samples: int, confidence: float) -> dict[str, Any]:
    if not len(a):
        return {"estimate": None, "ci_low": None, "ci_high": None}
    low, high = paired_bootstrap(b - a, seed, samples, confidence)
    return {"estimate": float((b - a).mean()), "ci_low": low, "ci_high": high}


def compare(a: Sequence[dict], b: Sequence[dict], criteria: Sequence[str] | None = None, *, seed: int = 0,
            samples: int = BOOTSTRAP_SAMPLES, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Compares two runs' outcomes (output items). Items are paired by their index; both runs
    must have been given the same item at every index they share. `criteria`: the names to
    compare (default: every criterion either run reports, in order of appearance)."""
    left, right = _by_index(a), _by_index(b)
    shared = sorted(set(left) & set(right))
    for i in shared:
        if left[i]["datasource_item"] != right[i]["datasource_item"]:
            raise InvalidRequest(f"the runs are not on the same items: item {i} differs", param="runs")
    if criteria is None:
        names = [r["name"] for o in (*a, *b) for r in o["results"]]
        criteria = list(dict.fromkeys(names))
    out = []
    for name in criteria:
        pairs, errored, flips = [], 0, {"regressed": [], "improved": []}
        for i in shared:
            ra, rb = _result(left[i], name), _result(right[i], name)
            if ra is None or rb is None or ra["errors"] or rb["errors"]:  # no sample, or the grader errored
                errored += 1
                continue
            pairs.append((float(ra["passed"]), float(rb["passed"]), ra["score"], rb["score"]))
            if ra["passed"] != rb["passed"]:
                flips["regressed" if ra["passed"] else "improved"].append(i)
        values = np.array(pairs, dtype=np.float64).reshape(-1, 4)
        pass_a, pass_b, score_a, score_b = values.T
        out.append({
            "testing_criteria": name, "paired_items": len(pairs), "errored_items": errored,
            "a": _stats(pass_a, score_a), "b": _stats(pass_b, score_b),
            "pass_rate_difference": _difference(pass_a, pass_b, seed, samples, confidence),
            "mean_score_difference": _difference(score_a, score_b, seed + 1, samples, confidence),
            "flipped": flips,
        })
    return {"object": "eval.comparison", "items_compared": len(shared), "confidence": confidence,
            "bootstrap_samples": samples, "seed": seed, "per_testing_criteria": out}


def threshold(value: Any, lo: float, hi: float) -> float | None:
    """A judging threshold (`min_delta`, `min_pass_rate`, ...) as a float: a number, not a bool, from
    lo to hi; None otherwise (the caller names the key in its own error)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        return None
    return float(value)


def judge(comparison: dict[str, Any], criteria: Sequence[str], min_pass_rate: float,
          min_delta: float) -> tuple[list[str], list[dict[str, Any]]]:
    """The promotion gate's rules on a baseline (a) to candidate (b) comparison: each criterion's
    candidate pass rate at least `min_pass_rate`, its paired difference at least `min_delta`.
    Returns why it fails (empty: it passes) and each judged criterion's rates."""
    reasons, rows = [], []
    for entry in comparison["per_testing_criteria"]:
        label = entry["testing_criteria"]
        if label not in criteria:
            continue
        rate, delta = entry["b"]["pass_rate"], entry["pass_rate_difference"]
        rows.append({"testing_criteria": label, "baseline_pass_rate": entry["a"]["pass_rate"],
                     "candidate_pass_rate": rate, "pass_rate_difference": delta,
                     "mean_score_difference": entry["mean_score_difference"], "paired_items": entry["paired_items"],
                     "flipped": entry["flipped"]})
        if rate is None:
            reasons.append(f"{label}: no item could be compared")
            continue
        if rate < min_pass_rate:
            reasons.append(f"{label}: pass rate {rate:.3f} is below min_pass_rate {min_pass_rate:g}")
        if delta["estimate"] < min_delta:
            reasons.append(f"{label}: pass rate changed by {delta['estimate']:+.3f} against the baseline "
                           f"(95% interval {delta['ci_low']:+.3f} to {delta['ci_high']:+.3f}), below min_delta "
                           f"{min_delta:g}")
    return reasons, rows


def _stats(passed: np.ndarray, scores: np.ndarray) -> dict[str, float | None]:
    if not len(passed):
        return {"pass_rate": None, "mean_score": None}
    return {"pass_rate": float(passed.mean()), "mean_score": float(scores.mean())}
