"""Evals in the serving process, in the shapes of OpenAI's evals API (`eval`, `eval.run`,
`eval.run.output_item`), durable across restarts.

Creating a run validates everything up front (400 naming the field or the item at fault, 404
for an unknown model) and stores the run with its spec; a thread of its own then runs it (see
executor.py) and commits each item's outcome as it finishes. Cancel stops the thread and keeps
the outcomes committed so far. After a restart, `resume()` restarts every run that was queued
or in progress, skipping the items whose outcomes are stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kiln.engine.lora_slots import AdapterWeights
from kiln.errors import InvalidRequest, KilnError, NotFound, RequestFailed
from kiln.eval import suite as suites
from kiln.eval.comparison import compare as compare_outcomes
from kiln.eval.executor import Executor
from kiln.eval.outcome import Tally, new_id, now
from kiln.eval.report import render_report
from kiln.eval.store import EvalStore

log = logging.getLogger("kiln.eval")

ACTIVE = ("queued", "in_progress")
RUN_STATUSES = ("queued", "in_progress", "completed", "canceled", "failed")
ITEM_STATUSES = {"pass": "pass", "fail": "fail", "errored": "errored", "error": "errored"}
SHUTDOWN_JOIN_S = 30.0
SAMPLING_SOURCES = ("completions", "responses")  # data sources whose runs sample (the rest grade given samples)


def check_metadata(metadata: Any, param: str = "metadata") -> dict[str, str] | None:
    """At most 16 string pairs; keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()):
        raise InvalidRequest(f"{param} must map at most 16 keys (up to 64 characters) to strings (up to 512)",
                             param=param)
    return dict(metadata)


def _name(value: Any, default: str, param: str = "name") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidRequest(f"{param} must be a string", param=param)
    return value


def sample_schema() -> dict[str, Any]:
    """The `sample` namespace a sampling run gives the graders."""
    return {"type": "object", "properties": {
        "model": {"type": "string"}, "output_text": {"type": "string"}, "output_json": {"type": "object"},
        "output_tools": {"type": "array"}, "choices": {"type": "array"}},
        "required": ["model", "output_text", "choices"]}


class EvalService:
    def __init__(self, store: EvalStore, engine, *, select_model: Callable[[str | None], Any],
                 judge=None, files=None, mcp_commands: list[str] | None = None):
        """select_model(name) -> the LoadedAdapter a model name selects (None: the base model), or
        NotFound; judge: model graders' judge; files: the uploaded files (file_id sources);
        mcp_commands: the stdio MCP commands a responses run's tools may start (None: any)."""
        self.store, self.engine, self.select_model, self.judge, self.files = store, engine, select_model, judge, files
        self.mcp_commands = mcp_commands
        self._lock = threading.Lock()
        self._threads: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._adapters: dict[str, AdapterWeights] = {}  # run id -> weights it samples with, not served
        self._stopping = False

    # ---- evals -----------------------------------------------------------------------------

    def create_eval(self, body: dict) -> dict:
        config = body.get("data_source_config")
        if not isinstance(config, dict):
            raise InvalidRequest("data_source_config is required", param="data_source_config")
        if config.get("type") != "custom":
            raise InvalidRequest(f"data_source_config.type {config.get('type')!r} is not supported; use custom",
                                 param="data_source_config.type")
        item_schema = config.get("item_schema")
        suites.schema_validator(item_schema)
        with_sample = config.get("include_sample_schema", False)
        if not isinstance(with_sample, bool):
            raise InvalidRequest("data_source_config.include_sample_schema must be a boolean",
                                 param="data_source_config.include_sample_schema")
        criteria = suites.criteria(body.get("testing_criteria"))
        schema = {"type": "object", "properties": {"item": item_schema}, "required": ["item"]}
        if with_sample:
            schema["properties"]["sample"] = sample_schema()
            schema["required"].append("sample")
        evaluation = {"object": "eval", "id": new_id("eval"), "name": _name(body.get("name"), ""),
                      "created_at": now(), "metadata": check_metadata(body.get("metadata")),
                      "data_source_config": {"type": "custom", "schema": schema},
                      "testing_criteria": [g.to_json() for g in criteria]}
        self.store.put_eval(evaluation)
        return evaluation

    def get_eval(self, eval_id: str) -> dict:
        evaluation = self.store.get_eval(eval_id)
        if evaluation is None:
            raise NotFound(f"No eval found with id '{eval_id}'", code="eval_not_found", param="eval_id")
        return evaluation

    def list_evals(self, after: str | None, limit: int, order: str, order_by: str) -> tuple[list[dict], bool]:
        return self.store.list_evals(after, limit, order, order_by)

    def update_eval(self, eval_id: str, body: dict) -> dict:
        evaluation = self.get_eval(eval_id)
        if "name" in body:
            evaluation["name"] = _name(body["name"], evaluation["name"])
        if "metadata" in body:
            evaluation["metadata"] = check_metadata(body["metadata"])
        self.store.put_eval(evaluation)
        return evaluation

    def delete_eval(self, eval_id: str) -> dict:
        self.get_eval(eval_id)
        for run in self.store.runs_with_status(ACTIVE):
            if run["eval_id"] == eval_id:
                self._stop(run["id"])
        self.store.delete_eval(eval_id)
        return {"object": "eval.deleted", "deleted": True, "eval_id": eval_id}

    # ---- runs ------------------------------------------------------------------------------

    def create_run(self, eval_id: str, body: dict, admit: Callable[[], None] = lambda: None,
                   base_url: str = "", adapter: AdapterWeights | None = None) -> dict:
        """Validates the run (nothing is stored on any error), then queues and starts it.
        admit() is called when the run needs inference (it samples, or a criterion has a judge).
        adapter: weights to sample with in place of the served model `model` names (the
        promotion gate's candidate, not served yet); such a run cannot resume after a restart."""
        run, spec = self.prepare_run(eval_id, body, admit, check_model=adapter is None)
        if adapter is not None:
            spec["in_memory_adapter"] = True
            with self._lock:
                self._adapters[run["id"]] = adapter
        self.store.add_run(run, spec)
        self._start(run["id"])
        return self._present(self.store.get_run(run["id"]) or run, base_url)

    def prepare_run(self, eval_id: str, body: dict, admit: Callable[[], None] = lambda: None,
                    check_model: bool = True) -> tuple[dict, dict]:
        """A run's object and its spec, validated but not stored: InvalidRequest (400) naming the
        field or item at fault, NotFound (404) for an unknown model."""
        evaluation = self.get_eval(eval_id)
        source = body.get("data_source")
        if not isinstance(source, dict):
            raise InvalidRequest("data_source is required", param="data_source")
        kind = source.get("type")
        if kind not in (*SAMPLING_SOURCES, "jsonl"):
            raise InvalidRequest(f"data_source.type {kind!r} is not supported; use completions, responses or jsonl",
                                 param="data_source.type")
        samples_run = kind in SAMPLING_SOURCES
        criteria = suites.criteria(evaluation["testing_criteria"])
        rows = self._rows(source.get("source"))
        schema = evaluation["data_source_config"]["schema"]
        suites.check_items(rows, schema["properties"]["item"])
        if samples_run:
            model, inputs, sampling, samples = self._sampling_source(source, rows, kind)
        else:
            model, inputs, sampling, samples = None, None, suites.Sampling(), self._given_samples(rows, schema)
        judges = [(f"testing_criteria[{i}].model", m) for i, g in enumerate(criteria) for m in g.judge_models()]
        if samples_run or judges:
            admit()
        for param, name in [("data_source.model", model)] * (samples_run and check_model) + judges:
            try:
                self.select_model(name)
            except NotFound as exc:
                raise exc.with_param(param) from None
        spec = {"items": [r.item for r in rows], "samples": samples, "input": inputs and inputs.to_json(),
                "sampling": sampling.to_json(), "model": model, "criteria": evaluation["testing_criteria"]}
        data_source = {**source, "model": model} if samples_run else dict(source)
        run = {"object": "eval.run", "id": new_id("evalrun"), "eval_id": eval_id,
               "name": _name(body.get("name"), model or "jsonl"), "model": model, "status": "queued",
               "created_at": now(), "data_source": data_source, "error": None,
               "metadata": check_metadata(body.get("metadata")),
               **Tally([g.name for g in criteria]).to_json()}
        return run, spec

    def get_run(self, eval_id: str, run_id: str, base_url: str = "") -> dict:
        return self._present(self._run(eval_id, run_id), base_url)

    def list_runs(self, eval_id: str, after: str | None, limit: int, order: str, status: str | None,
                  base_url: str = "") -> tuple[list[dict], bool]:
        self.get_eval(eval_id)
        if status is not None and status not in RUN_STATUSES:
            raise InvalidRequest(f"status must be one of {', '.join(RUN_STATUSES)}", param="status")
        runs, more = self.store.list_runs(eval_id, after, limit, order, status)
        return [self._present(r, base_url) for r in runs], more

    def cancel_run(self, eval_id: str, run_id: str, base_url: str = "") -> dict:
        self._run(eval_id, run_id)
        canceled = self.store.set_status(run_id, "canceled", ACTIVE)
        if canceled is None:
            raise InvalidRequest(f"run {run_id} is {self.store.get_run(run_id)['status']}; only a queued or "
                                 "running run can be canceled", code="invalid_run_state", param="run_id")
        self._stop(run_id)
        return self._present(canceled, base_url)

    def delete_run(self, eval_id: str, run_id: str) -> dict:
        self._run(eval_id, run_id)
        self._stop(run_id)
        self.store.delete_run(run_id)
        return {"object": "eval.run.deleted", "deleted": True, "run_id": run_id}

    def output_items(self, eval_id: str, run_id: str, after: str | None, limit: int, order: str,
                     status: str | None) -> tuple[list[dict], bool]:
        self._run(eval_id, run_id)
        if status is not None and status not in ITEM_STATUSES:
            raise InvalidRequest("status must be pass, fail or errored", param="status")
        items, more = self.store.outcomes(run_id, after, limit, order, status and ITEM_STATUSES[status])
        return [{**o, "eval_id": eval_id, "run_id": run_id} for o in items], more

    def output_item(self, eval_id: str, run_id: str, item_id: str) -> dict:
        self._run(eval_id, run_id)
        outcome = self.store.get_outcome(run_id, item_id)
        if outcome is None:
            raise NotFound(f"No output item found with id '{item_id}'", code="output_item_not_found",
                           param="output_item_id")
        return {**outcome, "eval_id": eval_id, "run_id": run_id}

    def report(self, eval_id: str, run_id: str) -> str:
        """The run's HTML report page."""
        run = self._run(eval_id, run_id)
        return render_report(self.get_eval(eval_id), run, self.store.outcomes(run_id)[0])

    def compare(self, eval_id: str, run_ids: list[str], seed: int = 0) -> dict:
        """Kiln's comparison of two runs of one eval (see comparison.py)."""
        if len(run_ids) != 2:
            raise InvalidRequest("runs must name two runs of this eval, separated by a comma", param="runs")
        a, b = (self._run(eval_id, r, param="runs") for r in run_ids)
        criteria = [c["name"] for c in self.get_eval(eval_id)["testing_criteria"]]
        result = compare_outcomes(self.store.outcomes(a["id"])[0], self.store.outcomes(b["id"])[0], criteria,
                                  seed=seed)
        return {**result, "eval_id": eval_id, "runs": [
            {"id": r["id"], "name": r["name"], "model": r["model"], "status": r["status"]} for r in (a, b)]}

    # ---- lifecycle -------------------------------------------------------------------------

    def resume(self) -> int:
        """Restarts the runs a previous process left queued or in progress; returns how many."""
        runs = self.store.runs_with_status(ACTIVE)
        for run in runs:
            log.info("eval run %s resumes (%d items done)", run["id"], run["result_counts"]["total"])
            self._start(run["id"])
        return len(runs)

    def shutdown(self) -> None:
        """Stops every run; those in progress stay so, and resume at the next start."""
        with self._lock:
            self._stopping = True
            threads = list(self._threads.values())
        for _, stop in threads:
            stop.set()
        for thread, _ in threads:
            thread.join(SHUTDOWN_JOIN_S)

    # ---- internals -------------------------------------------------------------------------

    def _run(self, eval_id: str, run_id: str, param: str = "run_id") -> dict:
        run = self.store.get_run(run_id)
        if run is None or run["eval_id"] != eval_id:
            raise NotFound(f"No run found with id '{run_id}' in eval '{eval_id}'", code="run_not_found", param=param)
        return run

    def _rows(self, source: Any) -> list[suites.Row]:
        param = "data_source.source"
        if not isinstance(source, dict):
            raise InvalidRequest(f"{param} is required", param=param)
        kind = source.get("type")
        if kind == "file_content":
            return suites.rows_from_content(source.get("content"), f"{param}.content")
        if kind == "file_id":
            file_id = source.get("id")
            file = self.files.get_file(file_id) if self.files is not None and isinstance(file_id, str) else None
            if file is None:
                raise InvalidRequest(f"no file {file_id!r}", code="file_not_found", param=f"{param}.id")
            return suites.rows_from_jsonl(self.files.file_content(file_id), f"file {file_id}", f"{param}.id")
        raise InvalidRequest(f"{param}.type {kind!r} is not supported; use file_content or file_id",
                             param=f"{param}.type")

    def _sampling_source(self, source: dict, rows: list[suites.Row], kind: str):
        """A completions or responses source: (model, input messages, sampling, the rows' samples if any)."""
        if source.get("input_messages") is None:
            raise InvalidRequest(f"data_source.input_messages is required to sample {kind}",
                                 param="data_source.input_messages")
        inputs = suites.input_messages(source["input_messages"])
        sampling = suites.Sampling.from_json(source.get("sampling_params"), api=kind, mcp_commands=self.mcp_commands)
        model = _name(source.get("model"), self.engine.model.model_id, "data_source.model")
        samples = [r.sample for r in rows] if any(r.sample is not None for r in rows) else None
        return model, inputs, sampling, samples

    @staticmethod
    def _given_samples(rows: list[suites.Row], schema: dict) -> list:
        """A jsonl source's samples; every row needs one when the eval includes the sample schema."""
        for r in rows:
            if r.sample is None and "sample" in schema["required"]:
                raise InvalidRequest(f"{r.where} has no sample, and this eval grades given samples", param=r.param)
            if r.sample is not None:
                suites.as_sample(r.sample, r.where, r.param)
        return [r.sample for r in rows]

    @staticmethod
    def _present(run: dict, base_url: str) -> dict:
        return {**run, "report_url": f"{base_url}/v1/evals/{run['eval_id']}/runs/{run['id']}/report"}

    def _stop(self, run_id: str) -> None:
        with self._lock:
            entry = self._threads.get(run_id)
        if entry is not None:
            entry[1].set()

    def _start(self, run_id: str) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._execute, args=(run_id, stop), name=f"kiln-eval-{run_id[-8:]}",
                                  daemon=True)
        with self._lock:
            if self._stopping:
                return
            self._threads[run_id] = (thread, stop)
        thread.start()

    def _execute(self, run_id: str, stop: threading.Event) -> None:
        try:
            spec = self.store.run_spec(run_id)
            suite = suites.Suite(
                items=spec["items"], criteria=suites.criteria(spec["criteria"]),
                input=suites.input_messages(spec["input"]) if spec["input"] else None,
                sampling=suites.Sampling(**spec["sampling"]), samples=spec["samples"])
            weights = self._weights(run_id, spec, suite)
            run = self.store.set_status(run_id, "in_progress", ACTIVE)
            if run is None:  # canceled or deleted before it started
                return
            tally = Tally([g.name for g in suite.criteria], run)

            def commit(outcome: dict) -> None:
                tally.add(outcome)
                run.update(tally.to_json())
                if not self.store.add_outcome(run, outcome):  # canceled or deleted meanwhile
                    stop.set()

            executor = Executor(suite, engine=self.engine, adapter=weights, model=spec["model"], judge=self.judge,
                                mcp_commands=self.mcp_commands)
            if executor.run(commit, self.store.done_indices(run_id), stop):
                self.store.set_status(run_id, "completed", ("in_progress",))
        except KilnError as exc:
            self._fail(run_id, exc.code or "run_failed", exc.message)
        except Exception as exc:  # a bug or a dead engine: the run fails, the server lives
            log.exception("eval run %s failed", run_id)
            self._fail(run_id, "internal_error", f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._threads.pop(run_id, None)
                self._adapters.pop(run_id, None)

    def _weights(self, run_id: str, spec: dict, suite: suites.Suite) -> AdapterWeights | None:
        """The adapter weights a run samples with (None: the base model, or no sampling)."""
        if spec.get("in_memory_adapter"):
            with self._lock:
                weights = self._adapters.get(run_id)
            if weights is None:
                raise RequestFailed("the adapter this run evaluates was held in memory by a Kiln that stopped",
                                    code="adapter_not_available")
            return weights
        if suite.samples_given:
            return None
        adapter = self.select_model(spec["model"])
        return adapter.weights if adapter else None

    def _fail(self, run_id: str, code: str, message: str) -> None:
        self.store.set_status(run_id, "failed", ACTIVE, error={"code": code, "message": message})
