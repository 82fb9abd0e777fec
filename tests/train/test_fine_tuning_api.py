"""OpenAI's files and fine-tuning jobs API on a real server, through the official `openai`
client: upload, a job that trains and serves its adapter at once, events, checkpoints, pause,
resume, cancel, bad input, and a server killed with SIGKILL mid-job that resumes."""

import json
import signal
import time

import httpx
import numpy as np
import openai
import pytest
from browser import chromium, elements, page_dom, screenshot
from server_process import SUITE_ENGINE, ServerProcess

MODEL = "tiny-llama"
REPLY = "kiln says hi"
QUESTIONS = ["hello", "what is this?", "who are you", "tell me a joke", "ping", "name a colour", "2+2", "bye"]


def jsonl(records) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


TRAIN = jsonl([{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": REPLY}]}
               for q in QUESTIONS])
VALID = jsonl([{"messages": [{"role": "user", "content": "good morning"}, {"role": "assistant", "content": REPLY}]}])
KILN = {"lora": {"rank": 8, "alpha": 16}, "learning_rate": 1e-2, "max_seq_len": 64}


def method(n_epochs, batch_size=4):
    return {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": n_epochs, "batch_size": batch_size,
                                                                      "learning_rate_multiplier": 1}}}


def start(expressive_model, kiln_cache, data_dir, store, **env):
    return ServerProcess(expressive_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                         KILN_TRAIN_DATA_DIR=str(data_dir), KILN_ADAPTERS_STORE=str(store),
                         KILN_ADAPTERS_MAX_LORA_RANK="8", **env)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def server(expressive_model, kiln_cache, tmp_path_factory, store_dir, other_tokenizer_gguf):
    teachers = f"twin={expressive_model.source},stranger={other_tokenizer_gguf}"
    srv = start(expressive_model, kiln_cache, tmp_path_factory.mktemp("data"), store_dir, KILN_TRAIN_TEACHERS=teachers)
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_for(client, job_id, statuses, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert job.status != "failed", job.error
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {job.status} after {timeout} s")


def test_a_job_trains_an_adapter_that_serves_at_once(server, client, expressive_model, kiln_cache, store_dir,
                                                     tmp_path):
    train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
    valid = client.files.create(file=("valid.jsonl", VALID), purpose="fine-tune")
    assert (train.object, train.purpose, train.bytes) == ("file", "fine-tune", len(TRAIN))
    assert train.filename == "train.jsonl"
    assert client.files.retrieve(train.id).id == train.id
    assert client.files.content(train.id).read() == TRAIN
    assert train.id in [f.id for f in client.files.list().data]

    job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, validation_file=valid.id, suffix="hi",
                                         seed=3, method=method(12), metadata={"team": "kiln"},
                                         extra_body={"kiln": {**KILN, "checkpoint_every": 5}})
    assert job.object == "fine_tuning.job" and job.status in ("queued", "running") and job.seed == 3
    assert job.model_extra["kiln"]["plan"]["required_bytes"] > 0
    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model and done.trained_tokens > 0 and done.finished_at >= done.created_at
    assert done.hyperparameters.n_epochs == 12 and done.metadata == {"team": "kiln"}

    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    metrics = [e.data for e in events if e.type == "metrics"]
    assert len(metrics) == 24 and metrics[0]["step"] == 24  # newest first
    assert metrics[0]["train_loss"] < 0.1 * metrics[-1]["train_loss"]
    assert {"step", "train_loss", "valid_loss", "tokens_per_second", "learning_rate"} <= set(metrics[0])
    assert events[0].message == "The job has successfully completed"
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [20, 15, 10, 5]
    assert checkpoints[0].metrics.train_loss is not None and checkpoints[0].fine_tuning_job_id == job.id

    # the adapter serves at once, by the job's fine_tuned_model name
    reply = client.chat.completions.create(model=done.fine_tuned_model, messages=[{"role": "user", "content": "ping"}],
                                           max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == REPLY
    base = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ping"}], max_tokens=20,
                                          temperature=0)
    assert base.choices[0].message.content != REPLY
    assert job.id in [j.id for j in client.fine_tuning.jobs.list().data]

    runtime = httpx.get(server.url + "/v1/runtime", timeout=30).json()
    assert runtime["memory"]["weights_bytes"] > 0 and runtime["memory"]["kv_pool_bytes"] > 0
    assert runtime["jobs"] == {"running": None, "queued": []} and "active_writer" in runtime["ownership"]

    # a second Kiln on the same store (as after a restart) serves the job's model by name: it is listed,
    # and its first request loads it from the store
    other = start(expressive_model, kiln_cache, tmp_path / "other-data", store_dir)
    try:
        other_client = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0)
        listed = {m.id: m.model_extra["loaded"] for m in other_client.models.list().data}
        assert listed[MODEL] is True and listed[done.fine_tuned_model] is False
        reply = other_client.chat.completions.create(model=done.fine_tuned_model, max_tokens=20, temperature=0,
                                                     messages=[{"role": "user", "content": "ping"}])
        assert reply.choices[0].message.content == REPLY
        listed = {m.id: m.model_extra["loaded"] for m in other_client.models.list().data}
        assert listed[done.fine_tuned_model] is True
        with pytest.raises(openai.NotFoundError) as err:
            other_client.chat.completions.create(model="ft:nothing", max_tokens=2,
                                                 messages=[{"role": "user", "content": "ping"}])
        assert err.value.body["code"] == "model_not_found"
    finally:
        other.stop_cleanly()

    deleted = client.files.delete(valid.id)
    assert deleted.deleted and valid.id not in [f.id for f in client.files.list().data]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(valid.id)


def metrics_events(client, job_id) -> list[dict]:
    """A job's metrics events' data, oldest first."""
    return [e.data for e in reversed(client.fine_tuning.jobs.list_events(job_id, limit=10_000).data)
            if e.type == "metrics"]


def curve_points(html: str) -> int:
    [curve] = elements(html, id="job-curve")
    return int(curve["data-points"])


def test_the_console_shows_a_job_training_live_and_its_adapter_once_done(server, client):
    chromium()  # skips without a browser
    train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, suffix="console", method=method(40, 2),
                                         extra_body={"kiln": KILN})
    page = f"{server.url}/console?job={job.id}"

    deadline = time.monotonic() + 300
    while len(metrics_events(client, job.id)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    first = curve_points(page_dom(page))
    assert first >= 2 and client.fine_tuning.jobs.retrieve(job.id).status == "running"  # 160 steps: still going
    while len(metrics_events(client, job.id)) < first + 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    html = page_dom(page)
    assert curve_points(html) > first  # the curve gained points while the job ran
    [panel] = elements(html, id="job")
    assert panel["data-state"] == "ok"

    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    html = page_dom(page)
    assert curve_points(html) == 160
    assert elements(html, data_name=done.fine_tuned_model, data_state="live"), "the job's adapter is not shown live"
    # the page's data: the job's curve is its metrics events, the adapter names the job that made it
    shown = httpx.get(f"{server.url}/console/api/jobs/{job.id}", timeout=30).json()
    assert [m["train_loss"] for m in shown["series"]] == [m["train_loss"] for m in metrics_events(client, job.id)]
    assert shown["status"] == "succeeded" and shown["fine_tuned_model"] == done.fine_tuned_model
    adapters = httpx.get(f"{server.url}/console/api/adapters", timeout=30).json()["data"]
    [adapter] = [a for a in adapters if a["name"] == done.fine_tuned_model]
    assert adapter["state"] == "live" and adapter["job"] == job.id and adapter["loaded_at"] > 0
    overview = httpx.get(f"{server.url}/console/api/overview", timeout=30).json()
    assert overview["inference"] == {"on": True, "reason": None} and overview["status"] == "ok"
    assert overview["counters"]["generation_tokens"] >= 0 and 0 <= overview["kv_cache"]["usage"] <= 1
    assert overview["accelerator"]["training_slices"]["count"] >= 0 and overview["jobs"]["running"] is None

    image = screenshot(page, wait_ms=2500)
    assert image.std() > 10 and len(np.unique(image.reshape(-1, 3), axis=0)) > 20, "the console rendered blank"

    # an unknown job: a 404 from the data route, a not-found state on the page
    r = httpx.get(f"{server.url}/console/api/jobs/ftjob-nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    [panel] = elements(page_dom(f"{server.url}/console?job=ftjob-nope"), id="job")
    assert panel["data-state"] == "not-found"


PROMPTS = jsonl([{"messages": [{"role": "user", "content": q}], "answer": "k"} for q in QUESTIONS])
HAS_K = {"type": "string_check", "name": "has_k", "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}",
         "operation": "like"}


def reinforcement(grader, **hp):
    return {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hp}}


def test_a_reinforcement_job_runs_grpo_with_a_grader(server, client):
    train = client.files.create(file=("prompts.jsonl", PROMPTS), purpose="fine-tune")  # prompts only: accepted
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id, validation_file=train.id,
        method=reinforcement(HAS_K, n_epochs=1, batch_size=4, eval_interval=1, eval_samples=1),
        extra_body={"kiln": {**KILN, "grpo": {"num_generations": 4, "max_completion_tokens": 8}}})
    assert job.method.type == "reinforcement" and job.model_extra["kiln"]["config"]["loss_type"] == "dapo"
    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert [m["step"] for m in metrics] == [2, 1]
    assert {"reward_mean", "reward_std", "kl", "clip_fraction", "entropy", "completion_length", "rollout_seconds",
            "train_seconds", "tokens_per_second", "valid_reward_mean"} <= set(metrics[0])
    assert 0.0 <= metrics[0]["reward_mean"] <= 1.0 and 0 < metrics[0]["completion_length"] <= 8
    reply = client.chat.completions.create(model=done.fine_tuned_model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop")
    adapters = httpx.get(server.url + "/v1/adapters", timeout=30).json()["data"]
    manifest = next(a for a in adapters if a["name"] == done.fine_tuned_model)
    assert manifest.get("manifest", manifest)  # listed
    resident = httpx.get(server.url + "/v1/runtime", timeout=30).json()
    assert resident["jobs"]["running"] is None


def test_a_distillation_job_runs_on_policy_distillation(server, client):
    train = client.files.create(file=("prompts.jsonl", PROMPTS), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id,
        method={"type": "distillation", "distillation": {"teacher": MODEL, "hyperparameters": {"batch_size": 4}}},
        extra_body={"kiln": {**KILN, "distillation": {"num_generations": 2, "max_completion_tokens": 6,
                                                      "jsd_beta": 0.5}}})
    assert job.method.type == "distillation" and job.model_extra["kiln"]["config"]["jsd_beta"] == 0.5
    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert len(metrics) == 2 and abs(metrics[-1]["reverse_kl"]) < 1e-3  # the student starts as its base teacher
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.create(model=MODEL, training_file=train.id,
                                       method={"type": "distillation", "distillation": {"teacher": "nobody"}})
    assert err.value.body["param"] == "method.distillation.teacher"


def test_a_distillation_job_learns_from_a_configured_teacher_model(server, client):
    """train.teachers: a model loaded into the server's process when a job first names it; one
    with another tokenizer is refused."""
    train = client.files.create(file=("prompts.jsonl", PROMPTS), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id,
        method={"type": "distillation", "distillation": {"teacher": "twin", "hyperparameters": {"batch_size": 4}}},
        extra_body={"kiln": {**KILN, "distillation": {"num_generations": 2, "max_completion_tokens": 6}}})
    assert job.to_dict()["method"]["distillation"]["teacher"] == "twin"
    assert job.model_extra["kiln"]["plan"]["serving"]["teacher_weights"] > 0
    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert abs(metrics[-1]["reverse_kl"]) < 1e-3  # the twin has the base model's weights
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.create(model=MODEL, training_file=train.id,
                                       method={"type": "distillation", "distillation": {"teacher": "stranger"}})
    assert err.value.body["code"] == "teacher_tokenizer_mismatch"
    assert err.value.body["param"] == "method.distillation.teacher"


def test_a_reinforcement_job_trains_on_rollouts_a_client_scores(server, client):
    """kiln.rollouts = "external": the client samples and scores; each POST of scored groups is
    one training step, answered with its metrics; `final` ends the job."""
    train = client.files.create(file=("prompts.jsonl", PROMPTS), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id, method={"type": "reinforcement", "reinforcement": {}},
        extra_body={"kiln": {**KILN, "rollouts": "external", "grpo": {"max_steps": 10}}})
    url = f"{server.url}/v1/fine_tuning/jobs/{job.id}/rollouts"
    group = {"messages": [{"role": "user", "content": "say k"}],
             "completions": [{"text": "k", "reward": 1.0}, {"text": "no", "reward": 0.0},
                             {"text": "kk", "reward": 1.0, "truncated": True}]}
    first = httpx.post(url, json={"groups": [group, {**group, "prompt": "k?", "messages": None}]}, timeout=300)
    assert first.status_code == 400 and first.json()["error"]["param"] == "groups[1]"
    first = httpx.post(url, json={"groups": [group]}, timeout=300)
    assert first.status_code == 200, first.text
    assert first.json()["step"] == 1 and first.json()["metrics"]["reward_mean"] == pytest.approx(2 / 3)
    last = httpx.post(url, json={"groups": [group, {"prompt": "k?", "completions": group["completions"]}],
                                 "final": True}, timeout=300)
    assert last.status_code == 200 and last.json()["step"] == 2 and last.json()["final"]
    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error and done.fine_tuned_model
    bad = httpx.post(url, json={"groups": [group]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "job_not_active"
    short = {**group, "completions": group["completions"][:1]}
    other = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id, method={"type": "reinforcement", "reinforcement": {}},
        extra_body={"kiln": {**KILN, "rollouts": "external"}})
    r = httpx.post(f"{server.url}/v1/fine_tuning/jobs/{other.id}/rollouts", json={"groups": [short]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "groups[0].completions"
    client.fine_tuning.jobs.cancel(other.id)


LOOKUP = {"type": "kiln_python", "name": "lookup", "description": "Looks a key up",
          "parameters": {"type": "object", "properties": {"key": {"enum": ["a", "b"]}}, "required": ["key"]},
          "source": "def lookup(key):\n    return {'a': 'found it', 'b': 'nothing here'}[key]\n"}
# the grader reads the episode: 1 when the tool's first output (a transcript item) found the key
FOUND_IT = {"type": "string_check", "name": "found_it", "operation": "eq", "reference": "found it",
            "input": "{{ sample.output_items[1].output }}"}
AGENT = {"tools": [LOOKUP], "tool_choice": {"type": "function", "name": "lookup"}, "max_tool_calls": 1}


def test_a_reinforcement_job_whose_rollouts_are_agent_runs(server, client):
    train = client.files.create(file=("prompts.jsonl", PROMPTS), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id, validation_file=train.id,
        method=reinforcement(FOUND_IT, n_epochs=1, batch_size=4, eval_interval=2),
        extra_body={"kiln": {**KILN, "max_seq_len": 256, "agent": AGENT,
                             "grpo": {"num_generations": 4, "max_completion_tokens": 32}}})
    assert job.model_extra["kiln"]["agent"] == AGENT
    done = wait_for(client, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert [m["step"] for m in metrics] == [2, 1]
    # every episode called the tool, and the grader read its output: some found the key, some not
    assert 0.0 < metrics[-1]["reward_mean"] < 1.0 and "valid_reward_mean" in metrics[0]
    # two model turns around the tool's output: more tokens than one call's arguments
    assert all(m["completion_length"] > 8 for m in metrics)


def test_bad_reinforcement_jobs_get_a_400(server, client):
    train = client.files.create(file=("prompts.jsonl", PROMPTS), purpose="fine-tune")
    cases = [
        (reinforcement({**HAS_K, "operation": "contains"}), None, "method.reinforcement.grader.operation"),
        (reinforcement({"type": "nope"}), None, "method.reinforcement.grader.type"),
        (reinforcement(HAS_K), {"grpo": {"loss_type": "ppo"}}, "kiln.grpo"),
        (reinforcement(HAS_K), {"grpo": {"beta": "high"}}, "kiln.grpo.beta"),
        (reinforcement(HAS_K), {"grpo": {"clip": 1}}, "kiln.grpo.clip"),
        (reinforcement(HAS_K, compute_multiplier=100), None, "hyperparameters.compute_multiplier"),
        (reinforcement(HAS_K), {"agent": {"tools": []}}, "kiln.agent.tools"),
        (reinforcement(HAS_K), {"agent": {**AGENT, "colour": "red"}}, "kiln.agent.colour"),
        (reinforcement(HAS_K), {"agent": {"tools": [{**LOOKUP, "source": "def lookup(:"}]}},
         "kiln.agent.tools[0].source"),
        (reinforcement(HAS_K), {"agent": {"tools": [{"type": "mcp", "server_label": "x", "require_approval": "never",
                                                     "server_url": "http://127.0.0.1:9/mcp"}]}},
         "kiln.agent.tools[0].server_url"),
        (reinforcement(HAS_K), {"agent": {**AGENT, "max_turns": 0}}, "kiln.agent.max_turns"),
        (reinforcement(HAS_K), {"agent": AGENT, "rollouts": "external"}, "kiln.agent"),
    ]
    for method_body, kiln, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method_body,
                                           extra_body={"kiln": kiln} if kiln else None)
        assert err.value.body["param"] == param, err.value.body
    sft_file = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as err:  # a conversation that ends with the answer is no prompt
        client.fine_tuning.jobs.create(model=MODEL, training_file=sft_file.id, method=reinforcement(HAS_K))
    assert err.value.body["param"] == "training_file" and "assistant turn" in err.value.body["message"]


def test_pause_resume_and_cancel(server, client):
    train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
    long_job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method(40),
                                              extra_body={"kiln": KILN})
    queued = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method(1),
                                            extra_body={"kiln": KILN})
    wait_for(client, long_job.id, ("running",))
    assert client.fine_tuning.jobs.retrieve(queued.id).status == "queued"  # one job trains at a time
    with pytest.raises(openai.BadRequestError, match="used by fine-tuning job") as err:
        client.files.delete(train.id)
    assert err.value.body["code"] == "file_in_use"
    assert client.fine_tuning.jobs.cancel(queued.id).status == "cancelled"

    client.fine_tuning.jobs.pause(long_job.id)
    paused = wait_for(client, long_job.id, ("paused",), timeout=120)
    step = paused.model_extra["kiln"]["step"]
    assert step < 80
    resumed = client.fine_tuning.jobs.resume(long_job.id)
    assert resumed.status in ("queued", "running")
    wait_for(client, long_job.id, ("running",))
    client.fine_tuning.jobs.cancel(long_job.id)
    cancelled = wait_for(client, long_job.id, ("cancelled",), timeout=120)
    assert cancelled.finished_at is not None and cancelled.fine_tuned_model is None
    events = client.fine_tuning.jobs.list_events(long_job.id, limit=1000)  # no maximum: at most what exists
    messages = [e.message for e in events.data]
    assert any(m.startswith("Resumed from the checkpoint at step") for m in messages) and not events.has_more
    with pytest.raises(openai.BadRequestError, match="is cancelled, not paused") as err:
        client.fine_tuning.jobs.resume(long_job.id)
    assert err.value.body["code"] == "invalid_job_state"
    with pytest.raises(openai.BadRequestError, match="has already cancelled") as err:
        client.fine_tuning.jobs.cancel(long_job.id)
    assert err.value.body["code"] == "invalid_job_state"
    with pytest.raises(openai.NotFoundError) as err:
        client.fine_tuning.jobs.retrieve("ftjob-nothing")
    assert err.value.body["code"] == "job_not_found" and err.value.body["type"] == "not_found_error"


@pytest.mark.parametrize("content, code, message", [
    (TRAIN + b'{"messages": [}\n', "invalid_file", "line 9: not valid JSON"),
    (jsonl([{"prompt": "a", "completion": 1}]), "invalid_file", "line 1: 'prompt' and 'completion' must be strings"),
    (jsonl([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}]),
     "no_trainable_tokens", "no trainable tokens"),
])
def test_bad_files_are_refused_at_upload(client, content, code, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("bad.jsonl", content), purpose="fine-tune")
    assert err.value.body["code"] == code and message in err.value.body["message"]


def test_bad_jobs_get_a_400_and_leave_nothing_behind(server, client):
    train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
    before = len(client.fine_tuning.jobs.list(limit=100).data)
    long_text = jsonl([{"prompt": "x" * 30000, "completion": "y"}])
    huge = client.files.create(file=("long.jsonl", long_text), purpose="fine-tune")
    cases = [
        (dict(model="no-such-model", training_file=train.id), "model_not_found", "model"),
        (dict(model=MODEL, training_file="file-missing"), "file_not_found", "training_file"),
        (dict(model=MODEL, training_file=train.id, method=method(0)), "invalid_hyperparameter",
         "hyperparameters.n_epochs"),
        (dict(model=MODEL, training_file=train.id, method=method(1, batch_size=1000)), "invalid_hyperparameter",
         "hyperparameters.batch_size"),
        (dict(model=MODEL, training_file=train.id, extra_body={"kiln": {"lora": {"rank": 64}}}),
         "invalid_hyperparameter", "kiln.lora.rank"),
        (dict(model=MODEL, training_file=train.id, method={"type": "dpo"}), "unsupported_method", "method.type"),
        (dict(model=MODEL, training_file=huge.id, method=method(1, batch_size=256),
              extra_body={"kiln": {"max_seq_len": 40000}}), "insufficient_memory", None),
    ]
    for kwargs, code, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(**kwargs)
        assert err.value.body["code"] == code, err.value.body
        assert err.value.body["param"] == param
    assert "MiB" in err.value.body["message"]  # the memory refusal gives the numbers
    assert len(client.fine_tuning.jobs.list(limit=100).data) == before
    # serving is unaffected
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.choices[0].finish_reason == "length"


GATE_ITEMS = [{"question": q, "reply": REPLY} for q in QUESTIONS]
SAYS_HI = {"type": "string_check", "name": "says_hi", "input": "{{ sample.output_text }}",
           "reference": "{{ item.reply }}", "operation": "like"}
GATE_SOURCE = {"type": "completions", "sampling_params": {"temperature": 0, "max_completion_tokens": 12},
               "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{ item.question }}"}]},
               "source": {"type": "file_content", "content": [{"item": i} for i in GATE_ITEMS]}}


def gated_job(client, train_id, gate, n_epochs, learning_rate=1e-2, **kiln):
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=train_id, method=method(n_epochs),
                                         extra_body={"kiln": {**KILN, "learning_rate": learning_rate, "gate": gate,
                                                              **kiln}})
    done = wait_for(client, job.id, ("succeeded", "failed", "cancelled"))
    assert done.status == "succeeded", done.error
    return done, [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]


def adapter_listing(server, name):
    return next(a for a in httpx.get(server.url + "/v1/adapters").json()["data"] if a["name"] == name)


def test_the_promotion_gate_loads_an_adapter_that_beats_its_baseline_and_keeps_one_that_does_not(server, client):
    evaluation = client.evals.create(
        name="says hi", testing_criteria=[SAYS_HI],
        data_source_config={"type": "custom", "item_schema": {
            "type": "object", "properties": {"question": {"type": "string"}, "reply": {"type": "string"}},
            "required": ["question", "reply"]}})
    train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")

    # trained well, against the base model (which the gate evaluates first: no run of it exists)
    gate = {"eval_id": evaluation.id, "baseline": "base", "min_delta": 0.5, "min_pass_rate": 0.75,
            "data_source": GATE_SOURCE}
    good, events = gated_job(client, train.id, gate, n_epochs=12)
    result = good.model_extra["kiln"]["gate_result"]
    assert result["passed"] and result["reasons"] == [], result
    [criterion] = result["criteria"]
    assert criterion["baseline_pass_rate"] == 0.0 and criterion["candidate_pass_rate"] >= 0.75
    assert criterion["pass_rate_difference"]["ci_low"] <= criterion["pass_rate_difference"]["estimate"]
    assert any(m.startswith("Gate: evaluating the baseline") for m in events)
    assert f"Adapter {good.fine_tuned_model} loaded for serving" in events
    assert good.fine_tuned_model in [m.id for m in client.models.list().data]
    listed = adapter_listing(server, good.fine_tuned_model)
    assert listed["loaded"] and listed["eval_results"]["gate"]["passed"]
    assert listed["eval_results"]["gate"]["candidate_run"] == result["candidate_run"]
    runs = {r.id: r for r in client.evals.runs.list(evaluation.id).data}
    assert runs[result["candidate_run"]].model == good.fine_tuned_model
    assert runs[result["baseline_run"]].model == MODEL and runs[result["baseline_run"]].status == "completed"

    # barely trained, against the good adapter's run (reused, not run again): it stays in the store
    gate = {"eval_id": evaluation.id, "baseline": result["candidate_run"], "min_delta": 0.0}
    weak, events = gated_job(client, train.id, gate, n_epochs=1, learning_rate=1e-6)
    weak_result = weak.model_extra["kiln"]["gate_result"]
    assert not weak_result["passed"] and weak_result["baseline_run"] == result["candidate_run"]
    assert "says_hi: pass rate changed by" in weak_result["reasons"][0]
    assert any(m.startswith("Gate failed: says_hi") and "is not loaded" in m for m in events)
    assert weak.fine_tuned_model not in [m.id for m in client.models.list().data]
    listed = adapter_listing(server, weak.fine_tuned_model)
    assert not listed["loaded"] and listed["eval_results"]["gate"]["passed"] is False
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=weak.fine_tuned_model, messages=[{"role": "user", "content": "hi"}])
    assert len(client.evals.runs.list(evaluation.id).data) == 3  # one more: the weak candidate's

    # auto_load false never loads, even when the gate passes; the candidate runs as a Responses
    # request (an agent run, here without tools) on the same items
    lenient = {"eval_id": evaluation.id, "baseline": result["candidate_run"], "min_delta": -1.0,
               "data_source": {**GATE_SOURCE, "type": "responses"}}
    kept, _ = gated_job(client, train.id, lenient, n_epochs=1, learning_rate=1e-6, auto_load=False)
    kept_result = kept.model_extra["kiln"]["gate_result"]
    assert kept_result["passed"]
    assert client.evals.runs.retrieve(kept_result["candidate_run"], eval_id=evaluation.id).data_source.type == (
        "responses")
    assert not adapter_listing(server, kept.fine_tuned_model)["loaded"]

    # the console shows each job's gate, the eval's runs with their pass rates, and compares two of them
    console = f"{server.url}/console/api"
    assert httpx.get(f"{console}/jobs/{good.id}", timeout=30).json()["gate_result"] == result
    [shown] = [e for e in httpx.get(f"{console}/evals", timeout=30).json()["data"] if e["id"] == evaluation.id]
    by_id = {r["id"]: r for r in shown["runs"]}
    assert len(by_id) == 4 and by_id[result["baseline_run"]]["pass_rates"][0]["pass_rate"] == 0.0
    pair = f"{result['baseline_run']},{result['candidate_run']}"
    compared = httpx.get(f"{console}/evals/{evaluation.id}/compare", params={"runs": pair}, timeout=30).json()
    assert compared == httpx.get(f"{server.url}/v1/evals/{evaluation.id}/compare", params={"runs": pair},
                                 timeout=30).json()
    report = httpx.get(server.url + by_id[result["candidate_run"]]["report"], timeout=30)
    assert report.status_code == 200 and result["candidate_run"] in report.text
    r = httpx.get(f"{console}/evals/{evaluation.id}/compare", params={"runs": "evalrun_nope,evalrun_nix"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "runs"
    if chromium(required=False):  # and the page draws them
        html = page_dom(f"{server.url}/console?job={good.id}&eval={evaluation.id}&runs={pair}")
        [panel] = elements(html, id="compare")
        assert panel["data-state"] == "ok" and "Promotion gate: " in html and "says_hi" in html

    # bad gates are refused when the job is created
    bad = [({"eval_id": "eval_missing"}, "eval_not_found", "kiln.gate.eval_id"),
           ({"eval_id": evaluation.id, "criteria": ["nope"]}, None, "kiln.gate.criteria"),
           ({"eval_id": evaluation.id, "baseline": "no-such-adapter"}, "model_not_found", "kiln.gate.baseline"),
           ({"eval_id": evaluation.id, "min_delta": 2}, None, "kiln.gate.min_delta"),
           ({"eval_id": evaluation.id, "colour": "red"}, None, "kiln.gate"),
           ({"eval_id": evaluation.id, "data_source": {**GATE_SOURCE, "type": "jsonl"}}, None,
            "kiln.gate.data_source")]
    for gate, code, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method(1),
                                           extra_body={"kiln": {**KILN, "gate": gate}})
        assert (err.value.body["code"], err.value.body["param"]) == (code, param), err.value.body


def kill_after_first_checkpoint(expressive_model, kiln_cache, tmp_path, data: bytes, **create) -> tuple:
    """Starts a server, creates a job, SIGKILLs the server once the job has a checkpoint, and
    starts a new server on the same data and store; returns (the new server, the job id)."""
    data_dir, store = tmp_path / "data", tmp_path / "store"
    srv = start(expressive_model, kiln_cache, data_dir, store)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        train = client.files.create(file=("train.jsonl", data), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, **create)
        deadline = time.monotonic() + 300
        while not client.fine_tuning.jobs.checkpoints.list(job.id).data:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    finally:
        srv.stop()
    return start(expressive_model, kiln_cache, data_dir, store), job


def test_a_killed_server_resumes_the_job_from_its_checkpoint(expressive_model, kiln_cache, tmp_path):
    srv, job = kill_after_first_checkpoint(expressive_model, kiln_cache, tmp_path, TRAIN, method=method(15),
                                           extra_body={"kiln": {**KILN, "checkpoint_every": 4}})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
        steps_before = max(e.data["step"] for e in events if e.type == "metrics")
        done = wait_for(client, job.id, ("succeeded", "failed"))
        assert done.status == "succeeded", done.error
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
        resumed = next(m for m in messages if m.startswith("Resumed from the checkpoint at step"))
        assert steps_before - int(resumed.rsplit(" ", 1)[1]) <= 4  # at most checkpoint_every steps lost
        reply = client.chat.completions.create(model=done.fine_tuned_model,
                                               messages=[{"role": "user", "content": "ping"}], max_tokens=20,
                                               temperature=0)
        assert reply.choices[0].message.content == REPLY
    finally:
        srv.stop_cleanly()


def test_a_killed_server_resumes_a_reinforcement_job(expressive_model, kiln_cache, tmp_path):
    srv, job = kill_after_first_checkpoint(
        expressive_model, kiln_cache, tmp_path, PROMPTS, method=reinforcement(HAS_K, n_epochs=2, batch_size=2),
        extra_body={"kiln": {**KILN, "checkpoint_every": 2, "grpo": {"num_generations": 2,
                                                                      "max_completion_tokens": 4}}})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        done = wait_for(client, job.id, ("succeeded", "failed"))
        assert done.status == "succeeded", done.error
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
        resumed = next(m for m in messages if m.startswith("Resumed from the checkpoint at step"))
        assert int(resumed.rsplit(" ", 1)[1]) >= 2
        metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
        assert max(m["step"] for m in metrics) == 8  # 2 epochs of 8 prompts, 2 a step
    finally:
        srv.stop_cleanly()


def test_under_maintenance_jobs_train_while_inference_is_refused(expressive_model, kiln_cache, tmp_path):
    srv = start(expressive_model, kiln_cache, tmp_path / "data", tmp_path / "store",
                KILN_SERVER_SERVING_PROFILE="maintenance")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method(2),
                                             extra_body={"kiln": KILN})
        done = wait_for(client, job.id, ("succeeded",))
        assert done.fine_tuned_model in [a["name"] for a in httpx.get(srv.url + "/v1/adapters").json()["data"]]
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=done.fine_tuned_model, messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503 and err.value.body["code"] == "inference_disabled_by_profile"
        # a gate evaluates, and maintenance admits no evaluation: a gated job is refused
        ev = client.evals.create(name="x", testing_criteria=[SAYS_HI],
                                 data_source_config={"type": "custom", "item_schema": {"type": "object"}})
        with pytest.raises(openai.APIStatusError) as err:
            client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method(1), extra_body={
                "kiln": {**KILN, "gate": {"eval_id": ev.id, "data_source": GATE_SOURCE}}})
        assert err.value.status_code == 503 and err.value.body["code"] == "inference_disabled_by_profile"
    finally:
        srv.stop_cleanly()


def test_a_job_that_does_not_fit_shrinks_the_kv_pool_and_serving_goes_on(expressive_model, kiln_cache, tmp_path):
    """With almost no memory budget, the plan takes the job's bytes from the KV pool: the pool
    shrinks at an iteration boundary (a stream running meanwhile keeps its blocks and its exact
    greedy tokens) and grows back after the job."""
    blocks = int(SUITE_ENGINE["KILN_ENGINE_NUM_KV_BLOCKS"])  # the suite's pool: its steps are built already
    srv = start(expressive_model, kiln_cache, tmp_path / "data", tmp_path / "store", KILN_TRAIN_MEMORY_BUDGET_BYTES="1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "tell me a long story"}], max_tokens=150,
                   temperature=0, extra_body={"ignore_eos": True})
        expected = client.chat.completions.create(**ask).choices[0].message.content
        train = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
        stream = client.chat.completions.create(**ask, stream=True)
        first = next(iter(stream))  # the stream holds KV blocks when the job shrinks the pool
        # one row per step: a job small enough that the suite's small pool can make room for it
        job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, method=method(3, batch_size=1),
                                             extra_body={"kiln": KILN})
        resize = job.model_extra["kiln"]["plan"]["kv_resize"]
        assert resize["from_blocks"] == blocks and 17 <= resize["to_blocks"] < blocks
        text = (first.choices[0].delta.content or "") + "".join(c.choices[0].delta.content or "" for c in stream)
        seen = set()
        while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed"):
            seen.add(httpx.get(srv.url + "/v1/runtime", timeout=30).json()["memory"]["kv_pool"]["blocks"])
            time.sleep(0.2)
        assert job.status == "succeeded", job.error
        assert text == expected
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
        assert any(m.startswith(f"Shrinking the KV pool from {blocks}") for m in messages)
        assert f"KV pool grown back to {blocks} blocks" in messages
        assert resize["to_blocks"] in seen
        kv = httpx.get(srv.url + "/v1/runtime", timeout=30).json()["memory"]["kv_pool"]
        assert kv["blocks"] == kv["configured_blocks"] == blocks
        assert client.chat.completions.create(**ask).choices[0].message.content == expected
    finally:
        srv.stop_cleanly()
