"""What one item of a run comes to (its outcome), and a run's running totals (its tally).

An outcome is stored, and served, as OpenAI's output item (`eval.run.output_item`) without its
eval and run ids: the item, the sample (input messages, output, usage, the sampling
parameters), one result per testing criterion, and the item's status:

- `pass`: every criterion passed;
- `fail`: no error, and some criterion did not pass;
- `errored`: the sample could not be made (its `sample.error` says why) or a grader raised an
  error flag (the result's `errors` name it). The run goes on.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kiln import graders

PASS, FAIL, ERRORED = "pass", "fail", "errored"
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "cached_tokens": cached_tokens}


def sample_object(*, messages: list[dict], text: str | None, finish_reason: str | None, model: str | None,
                  usage_: dict | None, error: dict | None, sampling: dict | None) -> dict[str, Any]:
    """OpenAI's `sample` of an output item."""
    sampling = sampling or {}
    return {"input": messages, "output": [] if text is None else [{"role": "assistant", "content": text}],
            "finish_reason": finish_reason, "model": model, "usage": usage_ or usage(), "error": error,
            "temperature": sampling.get("temperature"), "top_p": sampling.get("top_p"),
            "max_completion_tokens": sampling.get("max_completion_tokens"), "seed": sampling.get("seed")}


def criterion_result(grader: graders.Grader, result: graders.GradeResult) -> dict[str, Any]:
    """One testing criterion's result: score, pass/fail, and the error flags it raised."""
    out: dict[str, Any] = {"name": grader.name, "type": grader.type, "score": result.reward,
                           "passed": grader.passed(result), "sample": None, "errors": result.errors.raised()}
    details = {k: v for k, v in result.errors.to_json().items() if k.endswith(("_details", "_type")) and v}
    if details:
        out["error_details"] = details
    if result.sub_rewards:
        out["sub_rewards"] = dict(result.sub_rewards)
    if result.token_usage_per_model:
        out["model_grader_token_usage_per_model"] = dict(result.token_usage_per_model)
    return out


def make_outcome(index: int, item: Any, sample: dict, results: list[dict]) -> dict[str, Any]:
    """An output item (without eval_id and run_id) for item `index`."""
    if sample.get("error") is not None or any(r["errors"] for r in results):
        status = ERRORED
    else:
        status = PASS if all(r["passed"] for r in results) else FAIL
    return {"object": "eval.run.output_item", "id": new_id("outputitem"), "created_at": now(), "status": status,
            "datasource_item_id": index, "datasource_item": item, "results": results, "sample": sample}


class Tally:
    """A run's totals, updated as each outcome arrives: OpenAI's `result_counts`,
    `per_testing_criteria_results` (a criterion whose grader errored counts as failed) and
    `per_model_usage` (the sampled model and every judge)."""

    def __init__(self, criteria: list[str], data: dict | None = None):
        data = data or {}
        self.counts = dict(data.get("result_counts") or {"total": 0, "passed": 0, "failed": 0, "errored": 0})
        per = {c["testing_criteria"]: c for c in data.get("per_testing_criteria_results") or []}
        self.criteria = {name: {"passed": per.get(name, {}).get("passed", 0), "failed": per.get(name, {}).get(
            "failed", 0)} for name in criteria}
        self.models = {u["model_name"]: {k: v for k, v in u.items() if k != "model_name"}
                       for u in data.get("per_model_usage") or []}

    def add(self, outcome: dict) -> None:
        self.counts["total"] += 1
        self.counts[{PASS: "passed", FAIL: "failed", ERRORED: "errored"}[outcome["status"]]] += 1
        for r in outcome["results"]:
            counts = self.criteria.setdefault(r["name"], {"passed": 0, "failed": 0})
            counts["passed" if r["passed"] else "failed"] += 1
        sample = outcome["sample"]
        if sample.get("model") and sample["usage"]["prompt_tokens"]:  # a sample this run generated
            self._use(sample["model"], sample["usage"])
        for r in outcome["results"]:
            for model, used in (r.get("model_grader_token_usage_per_model") or {}).items():
                self._use(model, used)

    def _use(self, model: str, used: dict) -> None:
        entry = self.models.setdefault(model, {"invocation_count": 0, **dict.fromkeys(USAGE_KEYS, 0)})
        entry["invocation_count"] += 1
        for key in USAGE_KEYS:
            entry[key] += int(used.get(key) or 0)

    def to_json(self) -> dict[str, Any]:
        return {"result_counts": dict(self.counts),
                "per_testing_criteria_results": [{"testing_criteria": name, **counts}
                                                 for name, counts in self.criteria.items()],
                "per_model_usage": [{"model_name": model, **used} for model, used in self.models.items()]}
