"""Evals: kiln.eval in-process on the tiny model (batching, grading, comparison), and OpenAI's
evals API on a real server through the official `openai` client: evals, runs of both data
source types, output items, cancel, compare, bad input, a grader that raises, the maintenance
profile, and a server killed with SIGKILL mid-run that resumes without redoing finished items."""

import html
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from server_process import ServerProcess, suite_env

import kiln.eval
from kiln.errors import InvalidRequest
from kiln.eval.comparison import paired_bootstrap

MODEL = "tiny-llama"
SCHEMA = {"type": "object", "properties": {"question": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["question", "n"]}
ITEMS = [{"question": f"what is {n} plus {n}?", "n": n} for n in range(6)]
TEMPLATE = [{"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "{{ item.question }}"}]
SAMPLING = {"temperature": 0, "max_completion_tokens": 6, "seed": 7}
EVEN = {"type": "python", "name": "even", "source": "def grade(sample, item):\n    return float(item['n'] % 2 == 0)\n"}
ANSWERED = {"type": "python", "name": "answered",
            "source": "def grade(sample, item):\n    return float(isinstance(sample['output_text'], str))\n"}
EXACT = {"type": "string_check", "name": "exact", "operation": "eq", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}"}


def jsonl(records) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


# ---- in-process ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model):
    from kiln.engine.client import AsyncEngine
    from kiln.engine.config import EngineConfig

    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=8,
                                               max_num_batched_tokens=128, decode_row_buckets=(1, 2, 4, 8),
                                               prefill_token_buckets=(32, 64, 128)))
    yield eng
    eng.shutdown()


def test_run_in_process_batches_the_items_and_grades_each(engine):
    steps = engine._core.steps
    result = kiln.eval.run(ITEMS, [EVEN, lambda sample, item: float(len(sample["output_text"]) >= 0)], TEMPLATE,
                           engine=engine, temperature=0, max_completion_tokens=6, progress=False)
    generated = sum(o["sample"]["usage"]["completion_tokens"] for o in result.outcomes)
    assert engine._core.steps - steps < generated  # the items shared steps: they ran as one batch
    assert [o["datasource_item_id"] for o in result.outcomes] == list(range(6))
    assert result.result_counts == {"total": 6, "passed": 3, "failed": 3, "errored": 0}
    assert result.per_testing_criteria_results == [{"testing_criteria": "even", "passed": 3, "failed": 3},
                                                   {"testing_criteria": "<lambda>", "passed": 6, "failed": 0}]
    first = result.outcomes[0]
    assert first["status"] == "pass" and first["datasource_item"] == ITEMS[0]
    assert first["sample"]["input"][1] == {"role": "user", "content": ITEMS[0]["question"]}
    assert first["sample"]["model"] == MODEL and first["sample"]["temperature"] == 0
    assert [u["model_name"] for u in result.per_model_usage] == [MODEL]
    assert result.per_model_usage[0]["invocation_count"] == 6
    assert result.pass_rate() == 0.5 and result.pass_rate("even") == 0.5

    again = kiln.eval.run(ITEMS, [EVEN], TEMPLATE, engine=engine, temperature=0, max_completion_tokens=6,
                          progress=False)  # temperature 0: the same samples
    assert [o["sample"]["output"] for o in again.outcomes] == [o["sample"]["output"] for o in result.outcomes]


def test_in_process_item_reference_schema_and_errors(engine):
    items = [{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}, {"messages": "not messages"},
             {"answer": "no messages at all"}]
    result = kiln.eval.run(items, [EXACT], "item.messages", engine=engine, max_completion_tokens=4, progress=False)
    assert result.outcomes[1]["sample"]["input"] == [{"role": "user", "content": "not messages"}]
    assert [o["status"] != "errored" for o in result.outcomes] == [True, True, False]
    assert "item.messages" in result.outcomes[2]["sample"]["error"]["message"] and result.outcomes[2]["results"] == []
    assert result.result_counts["errored"] == 1
    with pytest.raises(InvalidRequest) as err:
        kiln.eval.run([{"question": "q", "n": 1}, {"question": 3, "n": 2}], [EVEN], TEMPLATE, engine=engine,
                      item_schema=SCHEMA, progress=False)
    assert err.value.param == "items[1]" and "item 1" in err.value.message


MULTIPLY = {"type": "kiln_python", "name": "multiply", "description": "Multiplies two numbers",
            "parameters": {"type": "object", "properties": {"a": {"enum": [12, 34]}, "b": {"enum": [56, 78]}},
                           "required": ["a", "b"]},
            "source": "def multiply(a, b):\n    return a * b\n"}
# passes when the tool ran on the arguments the model gave it: graded on the transcript
TOOL_RAN = {"type": "python", "name": "tool_ran", "source": (
    "import json\n"
    "def grade(sample, item):\n"
    "    items = sample['output_items']\n"
    "    call, output = items[0], items[1]\n"
    "    args = json.loads(call['arguments'])\n"
    "    return float(output['type'] == 'function_call_output' and output['output'] == str(args['a'] * args['b']))\n")}
CALLED = {"type": "string_check", "name": "called", "operation": "eq",
          "input": "{{ sample.output_tools[0].function.name }}", "reference": "multiply"}
AGENT_TEMPLATE = [{"role": "user", "content": "Multiply {{ item.n }} by {{ item.n }} with the tool."}]


def test_an_agent_eval_runs_the_tools_and_grades_the_transcript(engine):
    items = [{"question": "q", "n": n} for n in range(3)]
    result = kiln.eval.run(items, [TOOL_RAN, CALLED], AGENT_TEMPLATE, engine=engine, temperature=0,
                           tools=[MULTIPLY], tool_choice={"type": "function", "name": "multiply"}, max_tool_calls=1,
                           progress=False)
    assert result.result_counts == {"total": 3, "passed": 3, "failed": 0, "errored": 0}
    sample = result.outcomes[0]["sample"]
    # the transcript as chat messages: the call, the tool's output, and the next turn's call, never run
    assert [m["role"] for m in sample["output"]] == ["assistant", "tool", "assistant"]
    assert sample["output"][0]["tool_calls"][0]["function"]["name"] == "multiply"
    assert sample["finish_reason"] == "length"  # the limit ended the run: incomplete
    assert sample["usage"]["prompt_tokens"] > 0 and sample["usage"]["cached_tokens"] > 0  # turn 2 reused turn 1
    with pytest.raises(InvalidRequest) as err:
        kiln.eval.run(items, [CALLED], AGENT_TEMPLATE, engine=engine, progress=False,
                      tools=[{"type": "kiln_python", "name": "f", "source": "def f(:\n"}])
    assert err.value.param == "sampling.tools[0].source"


def mcp_servers_running() -> int:
    """This process's children that are the test MCP server on stdio."""
    count = 0
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        count += ppid == os.getpid() and any(a.endswith(b"mcp_server.py") for a in cmdline) and b"stdio" in cmdline
    return count


def test_a_stopped_agent_eval_closes_its_runs_tools(engine):
    """Stopped while its agent run waits on an MCP tool (it sleeps 20 s), the run aborts: the
    MCP server it started on stdio is closed, not left running."""
    from kiln.eval.executor import Executor
    from kiln.eval.suite import Sampling, Suite, criteria, input_messages

    command = [sys.executable, str(Path(__file__).parents[1] / "mcp_server.py"), "stdio"]
    tool = {"type": "mcp", "server_label": "calc", "require_approval": "never", "command": command}
    sampling = Sampling.from_json({"temperature": 0, "tools": [tool], "tool_choice": {"type": "function",
                                                                                     "name": "slow"}},
                                  api="responses")
    suite = Suite(items=[{"question": "q", "n": 1}], criteria=criteria([CALLED]),
                  input=input_messages(AGENT_TEMPLATE), sampling=sampling)
    stop = threading.Event()

    def stop_during_the_call():
        deadline = time.monotonic() + 60
        while mcp_servers_running() == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # the run has listed the server's tools and called `slow`
        stop.set()

    threading.Thread(target=stop_during_the_call, daemon=True).start()
    assert Executor(suite, engine=engine).run(lambda outcome: None, stop=stop) is False
    assert stop.is_set()
    for _ in range(100):
        if mcp_servers_running() == 0:
            break
        time.sleep(0.1)
    assert mcp_servers_running() == 0


def test_compare_pairs_items_flips_and_seeded_bootstrap():
    a_pass = [True] * 10 + [False] * 10
    b_pass = [True] * 8 + [False] * 2 + [True] * 7 + [False] * 3
    a = kiln.eval.run([{"k": i} for i in range(20)], [lambda s, item: float(a_pass[item["k"]])], samples=["x"] * 20,
                      progress=False)
    b = kiln.eval.run([{"k": i} for i in range(20)], [lambda s, item: float(b_pass[item["k"]])], samples=["x"] * 20,
                      progress=False)
    result = kiln.eval.compare(a, b, seed=3)
    [c] = result["per_testing_criteria"]
    assert c["a"] == {"pass_rate": 0.5, "mean_score": 0.5} and c["b"] == {"pass_rate": 0.75, "mean_score": 0.75}
    assert c["flipped"] == {"regressed": [8, 9], "improved": list(range(10, 17))}
    diff = c["pass_rate_difference"]
    assert diff["estimate"] == pytest.approx(0.25)
    d = np.array(b_pass, float) - np.array(a_pass, float)
    assert (diff["ci_low"], diff["ci_high"]) == paired_bootstrap(d, 3)  # seeded: reproducible
    means = d[np.random.default_rng(3).integers(0, 20, size=(2000, 20))].mean(axis=1)
    assert diff["ci_low"] == pytest.approx(np.percentile(means, 2.5))
    assert diff["ci_low"] < 0.25 < diff["ci_high"] and -1 <= diff["ci_low"] and diff["ci_high"] <= 1
    assert kiln.eval.compare(a, b, seed=3) == result and c["paired_items"] == 20

    other = kiln.eval.run([{"k": i + 1} for i in range(20)], [lambda s, item: 1.0], samples=["x"] * 20,
                          progress=False)
    with pytest.raises(InvalidRequest, match="not on the same items"):
        kiln.eval.compare(a, other)


# ---- the HTTP API ------------------------------------------------------------------------------------


def start(tiny_model, kiln_cache, data_dir, **env):
    return ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                         KILN_TRAIN_DATA_DIR=str(data_dir), **env)


@pytest.fixture(scope="module")
def server(tiny_model, kiln_cache, tmp_path_factory):
    srv = start(tiny_model, kiln_cache, data_dir := tmp_path_factory.mktemp("eval-data"))
    srv.data_dir = data_dir
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def make_eval(client, criteria, include_sample_schema=False, name="arith"):
    return client.evals.create(name=name, metadata={"team": "kiln"}, testing_criteria=criteria,
                               data_source_config={"type": "custom", "item_schema": SCHEMA,
                                                   "include_sample_schema": include_sample_schema})


def completions(items, **extra):
    return {"type": "completions", "model": MODEL, "sampling_params": SAMPLING,
            "input_messages": {"type": "template", "template": TEMPLATE},
            "source": {"type": "file_content", "content": [{"item": i} for i in items]}, **extra}


def wait_for(client, eval_id, run_id, statuses=("completed",), timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.evals.runs.retrieve(run_id, eval_id=eval_id)
        if run.status in statuses:
            return run
        assert run.status in ("queued", "in_progress"), (run.status, run.error)
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} still {run.status}")


def test_evals_create_retrieve_list_update_delete(client):
    ev = make_eval(client, [EVEN, {**EXACT, "reference": "{{ item.question }}"}], include_sample_schema=True)
    assert ev.object == "eval" and ev.id.startswith("eval_") and ev.name == "arith"
    assert ev.metadata == {"team": "kiln"}
    assert ev.data_source_config.type == "custom"
    assert ev.data_source_config.schema_["properties"]["item"] == SCHEMA
    assert ev.data_source_config.schema_["required"] == ["item", "sample"]
    assert [c.name for c in ev.testing_criteria] == ["even", "exact"] and ev.testing_criteria[1].operation == "eq"
    assert client.evals.retrieve(ev.id).model_dump() == ev.model_dump()

    other = make_eval(client, [EVEN], name="second")
    listed = [e.id for e in client.evals.list(limit=100)]
    assert listed.index(ev.id) < listed.index(other.id)  # oldest first by default
    page = client.evals.list(limit=1, order="desc")
    assert [e.id for e in page.data] == [listed[-1]] and page.has_more
    assert [e.id for e in client.evals.list(limit=1, after=ev.id).data] == [other.id]

    updated = client.evals.update(ev.id, name="renamed", metadata={"v": "2"})
    assert (updated.name, updated.metadata) == ("renamed", {"v": "2"})
    assert client.evals.retrieve(ev.id).name == "renamed"
    assert client.evals.list(order_by="updated_at", order="desc", limit=1).data[0].id == ev.id

    deleted = client.evals.delete(other.id)
    assert (deleted.deleted, deleted.eval_id, deleted.object) == (True, other.id, "eval.deleted")
    with pytest.raises(openai.NotFoundError):
        client.evals.retrieve(other.id)

    for bad, param in [({"type": "logs"}, "data_source_config.type"),
                       ({"type": "custom", "item_schema": {"type": 3}}, "data_source_config.item_schema")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.evals.create(data_source_config=bad, testing_criteria=[EVEN])
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.evals.create(data_source_config={"type": "custom", "item_schema": SCHEMA},
                            testing_criteria=[EVEN, {**EXACT, "operation": "almost"}])
    assert err.value.body["param"] == "testing_criteria[1].operation"


def test_a_completions_run_samples_grades_and_lists_output_items(client, server):
    ev = make_eval(client, [EVEN, ANSWERED])
    run = client.evals.runs.create(ev.id, name="base", metadata={"k": "v"}, data_source=completions(ITEMS))
    assert run.object == "eval.run" and run.id.startswith("evalrun_") and run.status in ("queued", "in_progress")
    assert run.eval_id == ev.id and run.model == MODEL and run.name == "base" and run.metadata == {"k": "v"}
    assert run.report_url == f"{server.url}/v1/evals/{ev.id}/runs/{run.id}/report"
    assert run.data_source.type == "completions" and run.data_source.sampling_params.max_completion_tokens == 6
    done = wait_for(client, ev.id, run.id)
    assert done.result_counts.model_dump() == {"total": 6, "passed": 3, "failed": 3, "errored": 0}
    assert [(c.testing_criteria, c.passed, c.failed) for c in done.per_testing_criteria_results] == [
        ("even", 3, 3), ("answered", 6, 0)]
    [usage] = done.per_model_usage
    assert usage.run_model_name == MODEL and usage.invocation_count == 6 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    items = list(client.evals.runs.output_items.list(run.id, eval_id=ev.id))
    assert [i.datasource_item_id for i in items] == list(range(6))
    first = items[0]
    assert first.object == "eval.run.output_item" and first.eval_id == ev.id and first.run_id == run.id
    assert first.datasource_item == ITEMS[0] and first.status == "pass"
    assert [(r.name, r.score, r.passed) for r in first.results] == [("even", 1.0, True), ("answered", 1.0, True)]
    assert first.sample.model == MODEL and first.sample.output[0].role == "assistant"
    assert first.sample.input[1].content == ITEMS[0]["question"] and first.sample.max_completion_tokens == 6
    assert first.sample.usage.completion_tokens <= 6 and first.sample.finish_reason in ("stop", "length")
    assert first.sample.seed == 7 and first.sample.temperature == 0 and first.sample.error is None
    assert client.evals.runs.output_items.retrieve(first.id, eval_id=ev.id, run_id=run.id).model_dump() == (
        first.model_dump())
    failed = client.evals.runs.output_items.list(run.id, eval_id=ev.id, status="fail").data
    assert [i.datasource_item_id for i in failed] == [1, 3, 5]
    page = client.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=2, order="desc")
    assert [i.datasource_item_id for i in page.data] == [5, 4] and page.has_more
    assert [i.datasource_item_id for i in client.evals.runs.output_items.list(
        run.id, eval_id=ev.id, limit=2, order="desc", after=page.data[-1].id).data] == [3, 2]

    report = httpx.get(done.report_url, timeout=30)  # the run's HTML page
    assert report.status_code == 200 and report.headers["content-type"].startswith("text/html")
    page_text = report.text
    assert page_text.count('<tr class="item">') == 6 and "pass rate 50.0% (3 of 6)" in page_text
    assert 'data-criterion="even"' in page_text and 'data-criterion="answered"' in page_text
    assert html.escape(ITEMS[0]["question"]) in page_text and "<script" not in page_text
    check_report_in_a_browser(done.report_url)

    assert run.id in [r.id for r in client.evals.runs.list(ev.id)]
    assert [r.id for r in client.evals.runs.list(ev.id, status="completed")] == [run.id]
    with pytest.raises(openai.BadRequestError):  # a finished run cannot be canceled
        client.evals.runs.cancel(run.id, eval_id=ev.id)
    deleted = client.evals.runs.delete(run.id, eval_id=ev.id)
    assert (deleted.deleted, deleted.run_id) == (True, run.id)
    with pytest.raises(openai.NotFoundError):
        client.evals.runs.retrieve(run.id, eval_id=ev.id)


def test_a_file_id_source_with_an_item_reference_defaults_to_the_base_model(client):
    ev = make_eval(client, [EVEN])
    rows = [{"item": {**item, "messages": [{"role": "user", "content": item["question"]}]}} for item in ITEMS[:4]]
    file = client.files.create(file=("items.jsonl", jsonl(rows)), purpose="evals")
    run = client.evals.runs.create(ev.id, data_source={
        "type": "completions", "source": {"type": "file_id", "id": file.id}, "sampling_params": SAMPLING,
        "input_messages": {"type": "item_reference", "item_reference": "item.messages"}})
    done = wait_for(client, ev.id, run.id)
    assert done.model == MODEL and done.result_counts.total == 4 and done.result_counts.passed == 2
    items = client.evals.runs.output_items.list(run.id, eval_id=ev.id).data
    assert items[1].sample.input[0].content == ITEMS[1]["question"]


def responses_source(items, **sampling):
    return {"type": "responses", "model": MODEL, "input_messages": {"type": "template", "template": AGENT_TEMPLATE},
            "source": {"type": "file_content", "content": [{"item": i} for i in items]},
            "sampling_params": {"temperature": 0, "tools": [MULTIPLY], "max_tool_calls": 1,
                                "tool_choice": {"type": "function", "name": "multiply"}, **sampling}}


def test_a_responses_run_is_an_agent_run_per_item_graded_on_its_transcript(client, server):
    ev = make_eval(client, [TOOL_RAN, CALLED], name="agent")
    run = client.evals.runs.create(ev.id, data_source=responses_source(ITEMS[:4]))
    assert run.data_source.type == "responses" and run.model == MODEL
    done = wait_for(client, ev.id, run.id)
    assert done.result_counts.model_dump() == {"total": 4, "passed": 4, "failed": 0, "errored": 0}
    first = client.evals.runs.output_items.list(run.id, eval_id=ev.id).data[0]
    assert [m.role for m in first.sample.output] == ["assistant", "tool", "assistant"]
    args = json.loads(first.sample.output[0].tool_calls[0]["function"]["arguments"])
    assert first.sample.output[1].content == str(args["a"] * args["b"])
    # without the tool, the transcript has no call: the criteria fail (or error, the grader finding no items)
    bare = client.evals.runs.create(ev.id, data_source={**responses_source(ITEMS[:4]), "sampling_params": {
        "temperature": 0, "max_completion_tokens": 4}})
    done_bare = wait_for(client, ev.id, bare.id)
    assert done_bare.result_counts.passed == 0 and done_bare.result_counts.total == 4
    compared = httpx.get(f"{server.url}/v1/evals/{ev.id}/compare", params={"runs": f"{run.id},{bare.id}"},
                         timeout=30).json()
    called = next(c for c in compared["per_testing_criteria"] if c["testing_criteria"] == "called")
    assert called["a"]["pass_rate"] == 1.0 and called["b"]["pass_rate"] == 0.0
    assert called["flipped"]["regressed"] == [0, 1, 2, 3]


@pytest.mark.parametrize("sampling, param", [
    ({"tools": [{"type": "kiln_python", "name": "f", "source": "def f(:\n"}]}, "tools[0].source"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9/mcp",
                 "require_approval": "never"}]}, "tools[0].server_url"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"max_turns": 0}, "max_turns"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
])
def test_bad_responses_sampling_is_a_400_naming_the_field(client, sampling, param):
    ev = make_eval(client, [CALLED], name="agent-bad")
    with pytest.raises(openai.BadRequestError) as err:
        client.evals.runs.create(ev.id, data_source=responses_source(ITEMS[:1], **sampling))
    assert err.value.body["param"] == f"data_source.sampling_params.{param}", err.value.body


def test_runs_on_the_base_model_and_an_adapter_sample_from_each_and_compare(client, server, tmp_path):
    from peft_adapters import make_peft_adapter
    from tiny_models import make_hf_model

    make_peft_adapter(make_hf_model("llama", vocab_size=260, seed=3), tmp_path / "sql", rank=4, alpha=8.0, seed=11)
    r = httpx.post(server.url + "/v1/adapters", json={"name": "sql", "path": str(tmp_path / "sql")}, timeout=60)
    assert r.status_code == 200, r.text
    ev = make_eval(client, [EVEN, ANSWERED])
    base, tuned = (client.evals.runs.create(ev.id, data_source=completions(ITEMS, model=m)) for m in (MODEL, "sql"))
    base, tuned = wait_for(client, ev.id, base.id), wait_for(client, ev.id, tuned.id)
    assert (base.model, tuned.model) == (MODEL, "sql") and tuned.per_model_usage[0].run_model_name == "sql"
    outputs = {}
    for run in (base, tuned):
        items = client.evals.runs.output_items.list(run.id, eval_id=ev.id).data
        outputs[run.model] = [i.sample.output[0].content for i in items]
        assert {i.sample.model for i in items} == {run.model}
    for model in (MODEL, "sql"):  # each run sampled what a chat completion on that model gives
        reply = client.chat.completions.create(model=model, messages=[{**TEMPLATE[0]}, {
            "role": "user", "content": ITEMS[1]["question"]}], max_tokens=6, temperature=0, seed=7)
        assert reply.choices[0].message.content == outputs[model][1]
    assert outputs[MODEL] != outputs["sql"]

    body = httpx.get(f"{server.url}/v1/evals/{ev.id}/compare", params={"runs": f"{base.id},{tuned.id}"},
                     timeout=30).json()
    assert [c["testing_criteria"] for c in body["per_testing_criteria"]] == ["even", "answered"]
    even = body["per_testing_criteria"][0]  # graded on the item alone: no difference, and no flips
    assert even["pass_rate_difference"] == {"estimate": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    assert even["flipped"] == {"regressed": [], "improved": []} and even["paired_items"] == 6


def check_report_in_a_browser(url):
    """Headless Chromium draws the report: each criterion's pass-rate bar filled to its rate
    (even: 3 of 6, answered: 6 of 6), and score histograms with bars only in the bins used."""
    from browser import runs, screenshot

    image = screenshot(url)
    green = np.all(image == (0x2F, 0x7D, 0x4F), axis=-1).sum(axis=1)
    bars = runs(image[int(green.argmax())], {"fill": "#2f7d4f", "track": "#eef0f4"})
    assert len(bars) == 2, bars
    assert [round(b["fill"] / (b["end"] - b["start"]), 2) for b in bars] == [0.5, 1.0]
    blue = np.nonzero(np.all(image == (0x4A, 0x6F, 0xA5), axis=-1).any(axis=1))[0]
    columns = runs(image[blue.max() - 3], {"bin": "#4a6fa5"})  # above the 1-pixel floor of empty bins
    # even scores 0 and 1: the first and last bins; answered scores 1: its last bin
    assert [(c["start"] == b["start"], c["end"] == b["end"]) for c, b in zip(
        columns, [bars[0], bars[0], bars[1]], strict=True)] == [(True, False), (False, True), (False, True)]


def kiln_eval(tiny_model, kiln_cache, server, store, *args):
    import subprocess
    import sys

    env = suite_env(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                    KILN_TRAIN_DATA_DIR=str(server.data_dir), KILN_ADAPTERS_STORE=str(store))
    return subprocess.run([sys.executable, "-m", "kiln", "eval", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_kiln_eval_run_and_compare_from_the_shell(tiny_model, kiln_cache, server, client, tmp_path):
    """The CLI's runs land in the data directory's evals database: the server on that directory
    lists them and serves their reports, and `kiln eval compare` compares them."""
    from peft_adapters import make_peft_adapter
    from tiny_models import make_hf_model

    from kiln.adapters.registry import import_peft
    from kiln.adapters.store import AdapterStore

    make_peft_adapter(make_hf_model("llama", vocab_size=260, seed=3), tmp_path / "peft", rank=4, alpha=8.0, seed=11)
    import_peft(AdapterStore(tmp_path / "store"), "shell-sql", tmp_path / "peft", tiny_model, max_rank=16)
    suite = tmp_path / "arith.jsonl"
    suite.write_bytes(jsonl([{"name": "shell arith", "testing_criteria": [EVEN, ANSWERED], "input_messages": TEMPLATE,
                              "sampling_params": SAMPLING, "item_schema": SCHEMA}, *ITEMS]))
    runs = {}
    for model in (MODEL, "shell-sql"):
        proc = kiln_eval(tiny_model, kiln_cache, server, tmp_path / "store", "run", suite, "--model", model, "--json",
                         "--report", tmp_path / f"{model}.html")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[model] = json.loads(proc.stdout)
        assert runs[model]["status"] == "completed" and runs[model]["result_counts"]["total"] == len(ITEMS)
        assert "6/6" in proc.stderr  # the progress bar reached the end
        assert "shell arith" in (tmp_path / f"{model}.html").read_text()
    base, tuned = runs[MODEL], runs["shell-sql"]
    assert base["eval_id"] == tuned["eval_id"]  # one eval per suite
    listed = {r.id: r for r in client.evals.runs.list(base["eval_id"]).data}
    assert listed[tuned["id"]].model == "shell-sql" and listed[base["id"]].result_counts.passed == 3
    samples = {m: [o.sample.output[0].content for o in client.evals.runs.output_items.list(
        r["id"], eval_id=r["eval_id"], order="asc").data] for m, r in runs.items()}
    assert samples[MODEL] != samples["shell-sql"]
    assert httpx.get(server.url + base["report_url"], timeout=30).status_code == 200

    proc = kiln_eval(tiny_model, kiln_cache, server, tmp_path / "store", "compare", base["id"], tuned["id"], "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    compared = json.loads(proc.stdout)
    served = httpx.get(f"{server.url}/v1/evals/{base['eval_id']}/compare",
                       params={"runs": f"{base['id']},{tuned['id']}"}, timeout=30).json()
    assert compared["per_testing_criteria"] == served["per_testing_criteria"]
    table = kiln_eval(tiny_model, kiln_cache, server, tmp_path / "store", "compare", base["id"], tuned["id"]).stdout
    assert "even" in table and "+0.000 [+0.000, +0.000]" in table

    missing = kiln_eval(tiny_model, kiln_cache, server, tmp_path / "store", "run", suite, "--model", "no-such")
    assert missing.returncode == 1 and "no-such" in missing.stderr


def test_a_jsonl_run_grades_given_samples_and_compare_finds_the_flips(client, server):
    check = {**EXACT, "reference": "{{ item.answer }}"}
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    ev = client.evals.create(data_source_config={"type": "custom", "item_schema": schema,
                                                 "include_sample_schema": True}, testing_criteria=[check])
    answers = [str(i) for i in range(12)]
    a_out = [a if i < 6 else "wrong" for i, a in enumerate(answers)]  # 6 of 12 right
    b_out = [a if i not in (0, 1) and i < 10 else "wrong" for i, a in enumerate(answers)]  # 2 regress, 4 improve
    runs = []
    for outputs in (a_out, b_out):
        content = [{"item": {"answer": a}, "sample": {"output_text": o}} for a, o in zip(answers, outputs, strict=True)]
        run = client.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": {"type": "file_content",
                                                                                          "content": content}})
        runs.append(wait_for(client, ev.id, run.id))
    assert [r.result_counts.passed for r in runs] == [6, 8] and runs[0].per_model_usage == []
    item = client.evals.runs.output_items.list(runs[0].id, eval_id=ev.id).data[0]
    assert item.sample.output[0].content == "0" and item.results[0].passed

    url = f"{server.url}/v1/evals/{ev.id}/compare"
    body = httpx.get(url, params={"runs": f"{runs[0].id},{runs[1].id}"}, timeout=30).json()
    [c] = body["per_testing_criteria"]
    assert [r["id"] for r in body["runs"]] == [runs[0].id, runs[1].id] and body["items_compared"] == 12
    assert c["testing_criteria"] == "exact" and c["a"]["pass_rate"] == 0.5 and c["b"]["pass_rate"] == pytest.approx(
        8 / 12)
    assert c["flipped"] == {"regressed": [0, 1], "improved": [6, 7, 8, 9]}
    diff = c["pass_rate_difference"]
    assert diff["estimate"] == pytest.approx(2 / 12) and diff["ci_low"] < diff["estimate"] < diff["ci_high"]
    d = np.array([float(o == a) for a, o in zip(answers, b_out, strict=True)]) - np.array(
        [float(o == a) for a, o in zip(answers, a_out, strict=True)])
    assert (diff["ci_low"], diff["ci_high"]) == pytest.approx(paired_bootstrap(d, 0))
    assert httpx.get(url, params={"runs": f"{runs[0].id},{runs[1].id}"}, timeout=30).json() == body
    bad = httpx.get(url, params={"runs": runs[0].id}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "runs"
    missing = httpx.get(url, params={"runs": f"{runs[0].id},evalrun_nope"}, timeout=30)
    assert missing.status_code == 404

    with pytest.raises(openai.BadRequestError) as err:  # this eval grades given samples: each row needs one
        client.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": [
            {"item": {"answer": "1"}, "sample": {"output_text": "1"}}, {"item": {"answer": "2"}}]}})
    assert err.value.body["param"] == "data_source.source.content[1].item"


def test_bad_items_and_unknown_models_are_refused_up_front(client):
    ev = make_eval(client, [EVEN])
    bad = [ITEMS[0], ITEMS[1], {"question": "three", "n": "three"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.evals.runs.create(ev.id, data_source=completions(bad))
    assert err.value.body["param"] == "data_source.source.content[2].item"
    assert "item 2" in err.value.body["message"] and "'three' is not of type 'integer'" in err.value.body["message"]
    bad_file = client.files.create(file=("bad.jsonl", jsonl([{"item": ITEMS[0]}, {"item": {"n": 1}}])),
                                   purpose="evals")
    with pytest.raises(openai.BadRequestError) as err:
        client.evals.runs.create(ev.id, data_source={**completions(ITEMS), "source": {"type": "file_id",
                                                                                        "id": bad_file.id}})
    assert err.value.body["param"] == "data_source.source.id" and "line 2" in err.value.body["message"]
    assert "item 1" in err.value.body["message"]

    with pytest.raises(openai.NotFoundError) as err:
        client.evals.runs.create(ev.id, data_source=completions(ITEMS, model="no-such-adapter"))
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "data_source.model"
    with pytest.raises(openai.NotFoundError):
        client.evals.runs.create("eval_missing", data_source=completions(ITEMS))
    with pytest.raises(openai.BadRequestError) as err:
        client.evals.runs.create(ev.id, data_source=completions(ITEMS, sampling_params={"temperature": 5}))
    assert err.value.body["param"] == "data_source.sampling_params.temperature"
    assert client.evals.runs.list(ev.id).data == []  # nothing was stored


def test_a_grader_that_raises_on_one_item_errors_that_item_only(client):
    raises = {"type": "python", "name": "picky",
              "source": "def grade(sample, item):\n    if item['n'] == 2:\n        raise ValueError('no twos')\n"
                        "    return 1.0\n"}
    ev = make_eval(client, [raises, EVEN])
    run = client.evals.runs.create(ev.id, data_source=completions(ITEMS[:4]))
    done = wait_for(client, ev.id, run.id)
    assert done.status == "completed"
    assert done.result_counts.model_dump() == {"total": 4, "passed": 1, "failed": 2, "errored": 1}
    errored = client.evals.runs.output_items.list(run.id, eval_id=ev.id, status="errored").data
    assert [i.datasource_item_id for i in errored] == [2]
    picky = errored[0].results[0]
    assert (picky.name, picky.passed, picky.score) == ("picky", False, 0.0)
    assert picky.model_extra["errors"] == ["python_grader_runtime_error"]
    assert "no twos" in picky.model_extra["error_details"]["python_grader_runtime_error_details"]


SLOW = {"type": "python", "name": "slow",
        "source": "import time\ndef grade(sample, item):\n    time.sleep(0.4)\n    return 1.0\n"}
MANY = [{"question": f"q{n}", "n": n} for n in range(16)]


def test_cancel_keeps_the_finished_outcomes(client):
    ev = make_eval(client, [SLOW])
    run = client.evals.runs.create(ev.id, data_source=completions(MANY))
    deadline = time.monotonic() + 120
    while not client.evals.runs.output_items.list(run.id, eval_id=ev.id).data:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    canceled = client.evals.runs.cancel(run.id, eval_id=ev.id)
    assert canceled.status == "canceled"
    kept = [i.id for i in client.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=100)]
    time.sleep(1.0)  # graders in flight finish, and are not committed
    after = client.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert after.status == "canceled" and 1 <= after.result_counts.total < 16
    assert [i.id for i in client.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=100)] == kept
    assert after.result_counts.total == len(kept)
    with pytest.raises(openai.BadRequestError) as err:  # a finished run cannot be canceled again
        client.evals.runs.cancel(run.id, eval_id=ev.id)
    assert err.value.body["code"] == "invalid_run_state"
    with pytest.raises(openai.NotFoundError) as err:
        client.evals.runs.retrieve("evalrun_nothing", eval_id=ev.id)
    assert err.value.body["code"] == "run_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.evals.runs.output_items.retrieve("outputitem_nothing", eval_id=ev.id, run_id=run.id)
    assert err.value.body["code"] == "output_item_not_found"


# ---- restarts -----------------------------------------------------------------------------------------


def requests_served(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kiln:request_success_total{"))


def test_a_killed_server_resumes_the_run_without_redoing_finished_items(tiny_model, kiln_cache, tmp_path):
    srv = start(tiny_model, kiln_cache, tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ev = make_eval(client, [SLOW, EVEN])
        run = client.evals.runs.create(ev.id, data_source=completions(MANY))
        deadline = time.monotonic() + 120
        while len(client.evals.runs.output_items.list(run.id, eval_id=ev.id).data) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    finally:
        srv.stop()
    with sqlite3.connect(f"file:{tmp_path / 'evals.db'}?mode=ro", uri=True) as db:
        before = dict(db.execute("SELECT item_index, body FROM outcomes WHERE run_id = ?", (run.id,)).fetchall())
    assert 3 <= len(before) < len(MANY)

    # under maintenance the run waits (and new runs are refused), then a normal start resumes it
    srv = start(tiny_model, kiln_cache, tmp_path, KILN_SERVER_SERVING_PROFILE="maintenance")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.evals.runs.retrieve(run.id, eval_id=ev.id).status == "in_progress"
        with pytest.raises(openai.APIStatusError) as err:
            client.evals.runs.create(ev.id, data_source=completions(ITEMS))
        assert err.value.status_code == 503 and err.value.body["code"] == "inference_disabled_by_profile"
    finally:
        srv.stop_cleanly()

    srv = start(tiny_model, kiln_cache, tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        done = wait_for(client, ev.id, run.id)
        assert done.result_counts.total == len(MANY) and done.result_counts.passed == len(MANY) // 2
        items = {i.datasource_item_id: i for i in client.evals.runs.output_items.list(run.id, eval_id=ev.id,
                                                                                      limit=100)}
        assert sorted(items) == list(range(len(MANY)))
        for index, body in before.items():  # the items finished before the kill were kept, not redone
            old = json.loads(body)
            assert (items[index].id, items[index].created_at) == (old["id"], old["created_at"])
        assert requests_served(srv) == len(MANY) - len(before)  # only the unfinished items were sampled
    finally:
        srv.stop_cleanly()
