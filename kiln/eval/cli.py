"""`kiln eval run SUITE.jsonl --model NAME` and `kiln eval compare A B`.

A suite file is JSONL. Its first line is the suite: `testing_criteria` (OpenAI grader JSON),
and optionally `name`, `input_messages` (a message list templated over `{{ item.* }}`, or
`"item.messages"`), `sampling_params` and `item_schema`. Every further line is an item: a bare
object, or `{"item": ..., "sample": ...}`. Without `input_messages` the given samples are graded.

Runs go to the evals database of the data directory (`[train] data_dir`), the one a server on
that directory serves at /v1/evals: the CLI's runs are listed there, with their reports, and
`kiln eval compare` compares any two stored runs by id, whichever process made them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kiln.config import Settings

POLL_S = 0.2


def add_parser(sub, add_settings_arguments) -> None:
    p = sub.add_parser("eval", help="run an eval suite on the configured model or an adapter; compare two runs")
    commands = p.add_subparsers(dest="eval_command", required=True, metavar="COMMAND")
    q = commands.add_parser("run", help="sample and grade a suite (JSONL: the suite's line, then its items)")
    add_settings_arguments(q, exclude=("--model",))  # --model names what to evaluate; [model] path the base
    q.add_argument("suite", metavar="SUITE.jsonl")
    q.add_argument("--model", dest="eval_model", metavar="NAME",
                   help="the base model's served name (default) or an adapter in the store")
    q.add_argument("--name", help="the run's name (default: the model's)")
    q.add_argument("--report", metavar="FILE.html", help="also write the run's HTML report here")
    q.add_argument("--json", action="store_true", help="print the run object as JSON")
    q = commands.add_parser("compare", help="compare two stored runs on the same items")
    add_settings_arguments(q)
    q.add_argument("run_a", metavar="A", help="run id (the baseline)")
    q.add_argument("run_b", metavar="B", help="run id (compared with A: differences are B minus A)")
    q.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    q.add_argument("--json", action="store_true", help="print the comparison as JSON")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from kiln.errors import KilnError

    try:
        if args.eval_command == "run":
            return _run_suite(args, settings)
        return _compare(args, settings)
    except (KilnError, OSError) as exc:
        print(f"kiln: error: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
        return 1


# ---- run -----------------------------------------------------------------------------------


def read_suite(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The suite's line and its rows (`{"item", "sample"?}`), checked like an eval's data."""
    from kiln.errors import InvalidRequest
    from kiln.eval import suite as suites

    text = path.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError as exc:
        raise InvalidRequest(f"line 1 of {path} is not JSON: {exc}") from None
    if not isinstance(header, dict) or "testing_criteria" not in header:
        raise InvalidRequest(f"line 1 of {path} must be the suite: an object with testing_criteria (then one item "
                             "per line)")
    unknown = set(header) - {"name", "testing_criteria", "input_messages", "sampling_params", "item_schema"}
    if unknown:
        raise InvalidRequest(f"line 1 of {path} has unknown keys {sorted(unknown)}")
    rows = suites.rows_from_jsonl("\n".join(lines[1:]), str(path), "items")
    return header, [{"item": r.item, **({"sample": r.sample} if r.sample is not None else {})} for r in rows]


def _suite_eval(evals, header: dict, path: Path) -> str:
    """The eval this suite is stored under: one per distinct criteria and item schema."""
    definition = json.dumps([header["testing_criteria"], header.get("item_schema")], sort_keys=True)
    digest = hashlib.sha256(definition.encode()).hexdigest()[:32]
    found, more, after = None, True, None
    while found is None and more:
        page, more = evals.store.list_evals(after, 100)
        found = next((e for e in page if (e.get("metadata") or {}).get("kiln_suite") == digest), None)
        after = page[-1]["id"] if page else None
    if found is not None:
        return found["id"]
    return evals.create_eval({
        "name": header.get("name") or path.stem, "metadata": {"kiln_suite": digest},
        "testing_criteria": header["testing_criteria"],
        "data_source_config": {"type": "custom", "item_schema": header.get("item_schema") or {"type": "object"},
                               "include_sample_schema": "input_messages" not in header}})["id"]


def _store_models(engine, settings: Settings):
    """Model names as this process serves them: the base model, or an adapter from the store."""
    from kiln.adapters.registry import artifact_weights, check_fits
    from kiln.adapters.store import AdapterStore
    from kiln.engine.lora_slots import slot_modules
    from kiln.errors import NotFound

    store, loaded = AdapterStore(settings.adapter_store()), {}

    def select(name: str | None):
        if name in (None, "", engine.model.model_id):
            return None
        if name not in loaded:
            artifact = store.latest(name)
            if artifact is None:
                raise NotFound(f"The model `{name}` does not exist: it is neither the base model "
                               f"({engine.model.model_id}) nor an adapter in {store.root}", code="model_not_found",
                               param="model")
            check_fits(artifact.manifest, engine.model, engine.config.max_lora_rank,
                       slot_modules(engine.config.lora_experts))
            loaded[name] = SimpleNamespace(weights=artifact_weights(artifact, name))
        return loaded[name]

    return select


def _run_suite(args: argparse.Namespace, settings: Settings) -> int:
    from tqdm.auto import tqdm

    from kiln.engine.setup import build_engine
    from kiln.eval.report import render_report
    from kiln.eval.service import ACTIVE, EvalService
    from kiln.eval.store import EvalStore
    from kiln.eval.suite import sampling_api
    from kiln.graders.engine_judge import engine_judge

    path = Path(args.suite)
    header, rows = read_suite(path)
    engine = build_engine(settings)
    try:
        select = _store_models(engine, settings)
        judge = engine_judge(engine, lambda name: getattr(select(name), "weights", None))
        evals = EvalService(EvalStore(settings.training_dir()), engine, select_model=select, judge=judge)
        eval_id = _suite_eval(evals, header, path)
        source: dict[str, Any] = {"source": {"type": "file_content", "content": rows}}
        if "input_messages" in header:
            sampling = header.get("sampling_params")
            source.update(type=sampling_api(sampling), model=args.eval_model or engine.model.model_id,
                          input_messages=header["input_messages"], sampling_params=sampling)
        else:
            source["type"] = "jsonl"
        body = {"data_source": source, "metadata": {"kiln_suite_file": str(path.resolve())[-512:]}}
        if args.name:
            body["name"] = args.name
        run = evals.create_run(eval_id, body)
        bar = tqdm(total=len(rows), desc=f"eval {run['name']}", unit="item", file=sys.stderr)
        try:
            while run["status"] in ACTIVE:
                time.sleep(POLL_S)
                run = evals.store.get_run(run["id"])
                bar.update(run["result_counts"]["total"] - bar.n)
        except KeyboardInterrupt:
            run = evals.cancel_run(eval_id, run["id"])
            print(f"\ncanceled; the {run['result_counts']['total']} outcomes so far are kept", file=sys.stderr)
        finally:
            bar.close()
            evals.shutdown()
        if args.report:
            outcomes = evals.store.outcomes(run["id"])[0]
            Path(args.report).write_text(render_report(evals.get_eval(eval_id), run, outcomes), encoding="utf-8")
    finally:
        engine.shutdown()
    run = {**run, "report_url": f"/v1/evals/{eval_id}/runs/{run['id']}/report"}
    print(json.dumps(run, indent=2) if args.json else _run_summary(run))
    return 0 if run["status"] == "completed" else 1


def _run_summary(run: dict) -> str:
    counts = run["result_counts"]
    lines = [f"run {run['id']} of eval {run['eval_id']} ({run['model'] or 'given samples'}): {run['status']}",
             f"items {counts['total']}: {counts['passed']} passed, {counts['failed']} failed, "
             f"{counts['errored']} errored"]
    for c in run["per_testing_criteria_results"]:
        graded = c["passed"] + c["failed"]
        rate = f"{c['passed'] / graded:.1%}" if graded else "-"
        lines.append(f"  {c['testing_criteria']}: pass rate {rate} ({c['passed']}/{graded})")
    if run.get("error"):
        lines.append(f"error: {run['error']['message']}")
    lines.append(f"report: {run['report_url']} on a server with this data directory")
    return "\n".join(lines)


# ---- compare -------------------------------------------------------------------------------


def _compare(args: argparse.Namespace, settings: Settings) -> int:
    from tqdm.auto import tqdm

    from kiln.errors import NotFound
    from kiln.eval.comparison import compare
    from kiln.eval.store import EvalStore

    store = EvalStore(settings.training_dir())
    runs = []
    for run_id in (args.run_a, args.run_b):
        run = store.get_run(run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r} in {store.root}")
        runs.append(run)
    criteria = [c["testing_criteria"] for c in runs[0]["per_testing_criteria_results"]]
    outcomes = [store.outcomes(r["id"])[0] for r in runs]
    per_criterion = [compare(*outcomes, [name], seed=args.seed)
                     for name in tqdm(criteria, desc="bootstrap", unit="criterion", file=sys.stderr)]
    result = {**per_criterion[0], "per_testing_criteria": [c["per_testing_criteria"][0] for c in per_criterion],
              "runs": [{"id": r["id"], "eval_id": r["eval_id"], "name": r["name"], "model": r["model"],
                        "status": r["status"]} for r in runs]}
    print(json.dumps(result, indent=2) if args.json else _comparison_table(result))
    return 0


def _comparison_table(result: dict) -> str:
    a, b = result["runs"]
    lines = [f"A: {a['id']} ({a['model'] or a['name']}, {a['status']})",
             f"B: {b['id']} ({b['model'] or b['name']}, {b['status']})",
             f"{result['items_compared']} items compared; B minus A with {result['confidence']:.0%} paired-bootstrap "
             f"intervals (seed {result['seed']})", ""]
    header = f"{'criterion':<24} {'pass A':>7} {'pass B':>7} {'difference [interval]':>26} {'improved':>9} " \
             f"{'regressed':>9}"
    lines += [header, "-" * len(header)]
    for c in result["per_testing_criteria"]:
        d = c["pass_rate_difference"]
        interval = "-" if d["estimate"] is None else f"{d['estimate']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
        rate = lambda s: "-" if s["pass_rate"] is None else f"{s['pass_rate']:.3f}"  # noqa: E731
        lines.append(f"{c['testing_criteria'][:24]:<24} {rate(c['a']):>7} {rate(c['b']):>7} {interval:>26} "
                     f"{len(c['flipped']['improved']):>9} {len(c['flipped']['regressed']):>9}")
    return "\n".join(lines)
