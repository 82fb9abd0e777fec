"""The promotion gate: an adapter a training job made serves only after it proves itself on an eval.

A job's `kiln.gate` is `{eval_id, criteria, baseline, min_delta, min_pass_rate, data_source}`:

- `baseline`: `"base"` (the base model), the name of a served adapter, or the id of a run of the
  eval whose outcomes stand for the baseline.
- `data_source`: the items, input messages and sampling of the runs, as an eval run's
  `completions` or `responses` data source (agent runs, tools included) without its `model`.
  Optional: by default the baseline run's, or the eval's latest completed run that sampled.
- For each criterion in `criteria` (default: all of the eval's), the candidate's pass rate must
  be at least `min_pass_rate` (default 0), and its paired pass-rate difference to the baseline,
  on the same items, at least `min_delta` (default 0: no regression).

After training, the candidate is evaluated from its in-memory weights (it is not served yet);
the baseline is evaluated only when no completed run of it on the same data source exists.
The result, with the comparison, goes into the adapter's manifest (`eval_results.gate`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kiln.engine.lora_slots import AdapterWeights
from kiln.errors import InvalidRequest, KilnError, NotFound
from kiln.eval.comparison import judge, threshold
from kiln.eval.service import ACTIVE, SAMPLING_SOURCES, EvalService

GATE_KEYS = ("eval_id", "criteria", "baseline", "min_delta", "min_pass_rate", "data_source")
SAME_DATA = ("type", "source", "input_messages", "sampling_params")  # what makes two runs comparable
POLL_S = 0.5


class GateStopped(Exception):
    """The job was cancelled or Kiln is stopping while the gate ran (its runs are canceled)."""


@dataclasses.dataclass(frozen=True)
class GateSpec:
    eval_id: str
    criteria: tuple[str, ...]
    baseline: str
    min_delta: float
    min_pass_rate: float
    data_source: dict[str, Any]  # a completions or responses data source without its model

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "criteria": list(self.criteria)}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> GateSpec:
        return GateSpec(**{**doc, "criteria": tuple(doc["criteria"])})

    def baseline_is_run(self) -> bool:
        return self.baseline.startswith("evalrun_")


def _number(gate: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = gate.get(key, default)
    if (number := threshold(value, lo, hi)) is None:
        raise InvalidRequest(f"kiln.gate.{key} must be a number from {lo:g} to {hi:g}, got {value!r}",
                             param=f"kiln.gate.{key}")
    return number


def parse_gate(gate: Any, evals: EvalService, base_model: str, is_served: Callable[[str], bool]) -> GateSpec:
    """A job's `kiln.gate`, checked when the job is created (400 naming the key at fault)."""
    if not isinstance(gate, dict):
        raise InvalidRequest("kiln.gate must be an object", param="kiln.gate")
    unknown = sorted(set(gate) - set(GATE_KEYS))
    if unknown:
        raise InvalidRequest(f"kiln.gate has unknown keys {unknown}; use {', '.join(GATE_KEYS)}", param="kiln.gate")
    eval_id = gate.get("eval_id")
    evaluation = evals.store.get_eval(eval_id) if isinstance(eval_id, str) else None
    if evaluation is None:
        raise InvalidRequest(f"no eval {eval_id!r}", code="eval_not_found", param="kiln.gate.eval_id")
    names = [c["name"] for c in evaluation["testing_criteria"]]
    criteria = gate.get("criteria", names)
    if not isinstance(criteria, list) or not criteria or any(c not in names for c in criteria):
        raise InvalidRequest(f"kiln.gate.criteria must list some of the eval's criteria: {names}",
                             param="kiln.gate.criteria")
    baseline = gate.get("baseline", "base")
    if not isinstance(baseline, str) or not baseline:
        raise InvalidRequest("kiln.gate.baseline must be \"base\", a served adapter's name or a run id",
                             param="kiln.gate.baseline")
    baseline_run = None
    if baseline.startswith("evalrun_"):
        baseline_run = evals.store.get_run(baseline)
        if baseline_run is None or baseline_run["eval_id"] != eval_id:
            raise InvalidRequest(f"no run {baseline!r} of eval {eval_id}", code="run_not_found",
                                 param="kiln.gate.baseline")
    elif baseline not in ("base", base_model) and not is_served(baseline):
        raise InvalidRequest(f"the gate's baseline {baseline!r} is not a served adapter", code="model_not_found",
                             param="kiln.gate.baseline")
    source = gate.get("data_source") or _default_source(evals, eval_id, baseline_run)
    if not isinstance(source, dict) or source.get("type", "completions") not in SAMPLING_SOURCES:
        raise InvalidRequest("kiln.gate.data_source must be a completions or responses data source",
                             param="kiln.gate.data_source")
    source = {"type": "completions"} | {k: v for k, v in source.items() if k != "model"}
    try:  # the same checks a run of it gets: items against the schema, templates, sampling
        evals.prepare_run(eval_id, {"data_source": {**source, "model": base_model}})
    except KilnError as exc:
        raise InvalidRequest(f"kiln.gate.data_source: {exc.message}", param="kiln.gate.data_source") from None
    return GateSpec(eval_id, tuple(criteria), "base" if baseline == base_model else baseline,
                    _number(gate, "min_delta", 0.0, -1.0, 1.0), _number(gate, "min_pass_rate", 0.0, 0.0, 1.0),
                    source)


def _default_source(evals: EvalService, eval_id: str, baseline_run: dict | None) -> dict:
    if baseline_run is not None:
        if baseline_run["data_source"].get("type") not in SAMPLING_SOURCES:
            raise InvalidRequest(f"the baseline run {baseline_run['id']} grades given samples; the gate needs a "
                                 "run that samples (completions or responses)", param="kiln.gate.baseline")
        return baseline_run["data_source"]
    runs, _ = evals.store.list_runs(eval_id, None, 1 << 20, "desc", "completed")
    sampled = [r for r in runs if r["data_source"].get("type") in SAMPLING_SOURCES]
    if not sampled:
        raise InvalidRequest(f"eval {eval_id} has no completed run that sampled to take the gate's items from; give "
                             "kiln.gate.data_source", param="kiln.gate.data_source")
    return sampled[0]["data_source"]


def _same_data(run: dict, source: dict) -> bool:
    return all(run["data_source"].get(k) == source.get(k) for k in SAME_DATA)


@dataclasses.dataclass
class GateResult:
    passed: bool
    reasons: list[str]  # why it failed (empty when it passed)
    baseline_run: str | None
    candidate_run: str | None  # None when the gate could not evaluate
    criteria: list[dict[str, Any]]  # per criterion: pass rates, the difference and its interval

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Gate:
    def __init__(self, spec: GateSpec, evals: EvalService, base_model: str, label: str):
        """label: what the gate's runs are named after (the job id)."""
        self.spec, self.evals, self.base_model, self.label = spec, evals, base_model, label

    def evaluate(self, name: str, candidate: AdapterWeights, stopped: Callable[[], bool],
                 note: Callable[[str], None]) -> GateResult:
        """Evaluates the candidate (adapter `name`, from its weights) against the baseline and
        decides. Raises GateStopped when stopped() turns true (the gate's runs are canceled)."""
        spec = self.spec
        baseline = self._baseline_run(note)
        note(f"Gate: evaluating {name} on eval {spec.eval_id}")
        candidate_run = self.evals.create_run(spec.eval_id, self._body(name, "candidate"), adapter=candidate)["id"]
        runs = {"baseline": baseline, "candidate": candidate_run}
        finished = {role: self._wait(run_id, stopped) for role, run_id in runs.items()}
        broken = [f"the {role} run {run['id']} {run['status']}" + (f": {run['error']['message']}" if run.get(
            "error") else "") for role, run in finished.items() if run["status"] != "completed"]
        if broken:
            return GateResult(False, broken, baseline, candidate_run, [])
        comparison = self.evals.compare(spec.eval_id, [baseline, candidate_run])
        reasons, criteria = judge(comparison, spec.criteria, spec.min_pass_rate, spec.min_delta)
        return GateResult(not reasons, reasons, baseline, candidate_run, criteria)

    def _body(self, model: str, role: str) -> dict:
        return {"name": f"gate {self.label} {role}", "metadata": {"kiln_job": self.label, "kiln_gate": role},
                "data_source": {**self.spec.data_source, "model": model}}

    def _baseline_run(self, note: Callable[[str], None]) -> str:
        """The baseline's run: the one named, a completed run of the baseline on the same data,
        or a new one."""
        spec = self.spec
        if spec.baseline_is_run():
            return spec.baseline
        model = self.base_model if spec.baseline == "base" else spec.baseline
        runs, _ = self.evals.store.list_runs(spec.eval_id, None, 1 << 20, "desc", "completed")
        for run in runs:
            if run["model"] == model and _same_data(run, spec.data_source):
                note(f"Gate: the baseline {model} has run {run['id']} on these items; it is reused")
                return run["id"]
        note(f"Gate: evaluating the baseline {model} on eval {spec.eval_id}")
        try:
            return self.evals.create_run(spec.eval_id, self._body(model, "baseline"))["id"]
        except NotFound as exc:  # a baseline adapter unloaded since the job was created
            raise InvalidRequest(f"the gate's baseline cannot run: {exc.message}", code="model_not_found",
                                 param="kiln.gate.baseline") from None

    def _wait(self, run_id: str, stopped: Callable[[], bool]) -> dict:
        while True:
            run = self.evals.store.get_run(run_id)
            if run is None:
                return {"id": run_id, "status": "deleted", "error": None}
            if run["status"] not in ACTIVE:
                return run
            if stopped():
                for active in self.evals.store.runs_with_status(ACTIVE):
                    if (active.get("metadata") or {}).get("kiln_job") == self.label:
                        try:
                            self.evals.cancel_run(active["eval_id"], active["id"])
                        except InvalidRequest:  # it ended meanwhile
                            pass
                raise GateStopped(run_id)
            time.sleep(POLL_S)
