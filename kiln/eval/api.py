"""Evals from Python (a notebook, a script): `run` samples and grades a suite on an engine in
this process and returns its outcomes; `compare` compares two such runs. Nothing is stored."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kiln.engine.lora_slots import AdapterWeights
from kiln.eval import suite as suites
from kiln.eval.comparison import BOOTSTRAP_SAMPLES, CONFIDENCE
from kiln.eval.comparison import compare as compare_outcomes
from kiln.eval.executor import Executor
from kiln.eval.outcome import Tally
from kiln.graders.engine_judge import base_model_judge


@dataclasses.dataclass
class RunResult:
    """A finished run: one output item per item (in item order) and the run's totals, in the
    shapes of the HTTP API (`outcomes[i]["results"]`, `result_counts`, ...)."""

    model: str | None
    outcomes: list[dict]
    result_counts: dict[str, int]
    per_testing_criteria_results: list[dict]
    per_model_usage: list[dict]

    def pass_rate(self, criterion: str | None = None) -> float:
        """The share of items that passed every criterion, or this one criterion."""
        if criterion is None:
            return self.result_counts["passed"] / max(1, self.result_counts["total"])
        counts = next(c for c in self.per_testing_criteria_results if c["testing_criteria"] == criterion)
        return counts["passed"] / max(1, counts["passed"] + counts["failed"])

    def scores(self, criterion: str) -> list[float | None]:
        """Each item's score on a criterion (None where the item has no result)."""
        return [next((r["score"] for r in o["results"] if r["name"] == criterion), None) for o in self.outcomes]


def _rows(items: Any) -> list[suites.Row]:
    """A list of item dicts, or JSONL (a path, or its text or bytes) of items or {"item", "sample"} rows."""
    if isinstance(items, str | bytes | Path):
        is_path = isinstance(items, Path) or (isinstance(items, str) and "\n" not in items.strip()
                                              and not items.lstrip().startswith("{"))
        what = str(items) if is_path else "the items"
        return suites.rows_from_jsonl(Path(items).read_bytes() if is_path else items, what, "items")
    return [suites.Row(item, None, f"items[{i}]", f"items[{i}]") for i, item in enumerate(items)]


def run(items, criteria, input_messages=None, *, samples=None, engine=None, model=None, adapter=None, judge=None,
        item_schema: dict | None = None, temperature: float = 1.0, top_p: float = 1.0,
        max_completion_tokens: int | None = None, seed: int | None = suites.DEFAULT_SEED, progress: bool = True,
        settings=None, tools: list[dict] | None = None, text: dict | None = None, tool_choice=None,
        parallel_tool_calls: bool | None = None, max_tool_calls: int | None = None, max_turns: int | None = None,
        api: str | None = None) -> RunResult:
    """Runs an eval in this process and returns its outcomes.

    items: a list of item dicts, or JSONL (a path, or its text or bytes) whose lines are items or
    `{"item": ..., "sample": ...}`. criteria: grader JSON, graders, or `(sample, item) -> float`
    functions (a grader's `pass_threshold` decides pass; full marks when it has none).
    input_messages: a list of chat messages templated over `{{ item.* }}`, or `"item.messages"`
    naming messages inside each item; None grades the given samples (`samples=`, or the
    JSONL's) without sampling. engine: the AsyncEngine that samples (default: one started here
    on `model`, a LoadedModel, a path or None for the configured model, and stopped at the end);
    adapter: the adapter to sample with (its AdapterWeights or a loaded adapter; None: the base
    model). judge: model graders' judge (default: the engine's base model). tools, text,
    tool_choice, parallel_tool_calls, max_tool_calls, max_turns: the Responses API's; with any
    of them (or api="responses") each item is an agent run, Kiln running its MCP and
    kiln_python tools, and graders see the transcript in `sample.output_items`."""
    rows = _rows(items)
    given = samples if samples is not None else ([r.sample for r in rows] if input_messages is None else None)
    if given is not None and len(given) != len(rows):
        raise ValueError(f"{len(rows)} items but {len(given)} samples")
    if input_messages is None and all(s is None for s in given):
        raise ValueError("pass input_messages to sample each item, or samples (or JSONL rows with a sample) to grade")
    suites.check_items(rows, item_schema)
    responses = {"tools": tools, "text": text, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls,
                 "max_tool_calls": max_tool_calls, "max_turns": max_turns}
    sampling = {"temperature": temperature, "top_p": top_p, "max_completion_tokens": max_completion_tokens,
                "seed": seed, **responses}
    api = api or suites.sampling_api(responses)
    suite = suites.Suite(items=[r.item for r in rows], criteria=suites.criteria(list(criteria)),
                         input=suites.input_messages(input_messages) if input_messages is not None else None,
                         sampling=suites.Sampling.from_json(sampling, "sampling", api),
                         samples=given)
    own_engine = engine is None and not suite.samples_given
    if own_engine:
        from kiln.config import resolve_settings
        from kiln.engine.client import AsyncEngine
        from kiln.engine.config import EngineConfig
        from kiln.engine.setup import resolve_model

        settings = settings or resolve_settings(None)
        engine = AsyncEngine(resolve_model(model, settings, progress), EngineConfig.from_settings(settings))
    try:
        weights = adapter if adapter is None or isinstance(adapter, AdapterWeights) else adapter.weights
        name = weights.name if weights is not None else engine.model.model_id if engine is not None else None
        if judge is None and engine is not None:
            judge = base_model_judge(engine)
        outcomes: list[dict] = []
        tally = Tally([g.name for g in suite.criteria])
        bar = tqdm(total=len(suite.items), desc=f"eval {name or ''}".strip(), unit="item", disable=not progress)

        def collect(outcome: dict) -> None:
            outcomes.append(outcome)
            tally.add(outcome)
            bar.update(1)

        Executor(suite, engine=engine, adapter=weights, model=name, judge=judge).run(collect)
        bar.close()
        outcomes.sort(key=lambda o: o["datasource_item_id"])
        return RunResult(name, outcomes, **tally.to_json())
    finally:
        if own_engine:
            engine.shutdown()


def compare(a: RunResult | list[dict], b: RunResult | list[dict], *, seed: int = 0,
            samples: int = BOOTSTRAP_SAMPLES, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Compares two runs on the same items (RunResults, or lists of output items): per criterion,
    each run's pass rate and mean score, the paired differences (b minus a) with a seeded
    bootstrap confidence interval, and the items that flipped."""
    outcomes_a = a.outcomes if isinstance(a, RunResult) else list(a)
    outcomes_b = b.outcomes if isinstance(b, RunResult) else list(b)
    return compare_outcomes(outcomes_a, outcomes_b, seed=seed, samples=samples, confidence=confidence)
