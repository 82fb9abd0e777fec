"""Fleet-wide adapter promotion with three real workers sharing one store: bad requests refused naming
the field, a rollout whose eval fails at stage 2 rolled back on every worker it touched, a rollout that
goes 1 -> 2 -> 3 workers while streaming clients on the adapter see no failure, and a rollout that a
router restart resumes."""

import json
import threading
import time

import httpx
import pytest
from browser import elements, page_dom
from peft_adapters import make_peft_adapter
from router.test_router_server import RouterProcess, stop_fleet, wait_until, write_config
from server_process import ServerProcess, free_port
from tiny_models import make_hf_model

from kiln.adapters import peft_io
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
from kiln.adapters.store import AdapterStore
from kiln.router.proto import router_pb2

MODEL = "tiny-llama"
STAGES = [0.3, 0.6, 1.0]  # of three workers: 1, 2, 3
QUESTIONS = ["what is 2 + 2?", "name a colour", "how do kilns work?", "say hello"]


def save_version(root, tiny_model, tmp, seed: int, alpha: float) -> str:
    hf = make_hf_model("llama", vocab_size=260, seed=3)  # conftest's tiny_model in transformers
    peft_dir = tmp / f"peft-{seed}"
    make_peft_adapter(hf, peft_dir, rank=2, alpha=alpha, seed=seed)
    weights, info = peft_io.read_peft(peft_dir, tiny_model.config)
    manifest = Manifest(name="math", base_model=BaseModelRef(MODEL, tiny_model.weights_digest), rank=info["rank"],
                        alpha=info["alpha"], target_modules=info["target_modules"], weights_digest="",
                        provenance=provenance("test"))
    return AdapterStore(root).save(manifest, weights).version


class Fleet:
    def __init__(self, tiny_model, kiln_cache, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("rollout")
        self.store = tmp / "store"
        self.v1 = save_version(self.store, tiny_model, tmp, seed=13, alpha=4.0)
        self.workers, self.router = [], None
        try:
            self._start(tiny_model, kiln_cache, tmp)
        except BaseException:
            stop_fleet(self.router, self.workers)  # (the fixture never gets a fleet to stop)
            raise

    def _start(self, tiny_model, kiln_cache, tmp):
        self.ports = [(free_port(), free_port()) for _ in range(3)]
        for n, (zmq, replay) in enumerate(self.ports):  # w1 serves version 1; w0 and w2 have no adapter loaded
            preload = {"KILN_ADAPTERS_LOAD": "math"} if n == 1 else {}
            self.workers.append(ServerProcess(
                tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                KILN_ADAPTERS_STORE=str(self.store), KILN_ENGINE_KV_EVENTS_ENDPOINT=f"tcp://*:{zmq}",
                KILN_ENGINE_KV_EVENTS_REPLAY_ENDPOINT=f"tcp://*:{replay}",
                KILN_TRAIN_DATA_DIR=str(tmp / f"data-w{n}"), **preload))  # each its own evals and jobs
        self.v2 = save_version(self.store, tiny_model, tmp, seed=29, alpha=16.0)  # the store's latest
        self.config_dir = tmp
        self.start_router()

    def start_router(self):
        config = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "metrics_poll_ms": 100,
                  "models_refresh_secs": 1,
                  "rollout": {"state_file": "rollouts.json", "bake_secs": 1, "drain_secs": 0.5},
                  # a worker that would load the adapter on demand is never picked for it here
                  "profile": [{"name": "p", "predictor": {"adapter_load_ms": 1e6}}],
                  "workerset": [{"name": "a", "profile": "p", "kv_block_size": 16}]}
        static = [{"worker_id_str": f"w{n}", "worker_id_num": n, "model_name": MODEL,
                   "zmq_endpoint": f"tcp://127.0.0.1:{zmq}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                   "metrics_url": w.url + "/metrics", "http_url": w.url}
                  for n, ((zmq, replay), w) in enumerate(zip(self.ports, self.workers, strict=True))]
        self.router = RouterProcess(write_config(self.config_dir, config, {"a": static}))
        wait_until(lambda: self.router.get("/readyz").status_code == 200, 60, "the router to be ready")

    def post(self, **body) -> httpx.Response:
        return httpx.post(self.router.admin + "/admin/adapters/rollout", json=body, timeout=120)

    def rollout(self, rollout_id: str) -> dict:
        return self.router.get(f"/admin/adapters/rollout/{rollout_id}").json()

    def wait(self, rollout_id: str, statuses=("completed", "rolled_back", "failed"), within: float = 180) -> dict:
        wait_until(lambda: self.rollout(rollout_id)["status"] in statuses, within, f"rollout {rollout_id}: {statuses}")
        return self.rollout(rollout_id)

    def versions(self) -> list[str | None]:
        """The version of math each worker has loaded."""
        out = []
        for w in self.workers:
            entries = httpx.get(w.url + "/v1/adapters", timeout=30).json()["data"]
            out.append(next((a["version"] for a in entries if a["name"] == "math" and a["loaded"]), None))
        return out


@pytest.fixture(scope="module")
def fleet(tiny_model, kiln_cache, tmp_path_factory):
    fleet = None
    try:
        fleet = Fleet(tiny_model, kiln_cache, tmp_path_factory)
        yield fleet
    finally:
        if fleet is not None:
            stop_fleet(fleet.router, fleet.workers)


def chat(url: str, model: str, question: str) -> str:
    reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_bad_rollouts_are_refused_naming_the_field(fleet):
    good = {"name": "math", "version": int(fleet.v2), "store": str(fleet.store), "stages": STAGES}
    refused = [({"name": "nope"}, "name"), ({"version": 7}, "version"), ({"version": "x"}, "version"),
               ({"store": str(fleet.store / "nowhere")}, "store"), ({"stages": [0.5, 0.5]}, "stages"),
               ({"stages": [0, 1]}, "stages"), ({"stages": [0.5, 1.5]}, "stages"), ({"stages": []}, "stages"),
               ({"eval_id": "eval_nope"}, "eval_id"), ({"criteria": ["x"]}, "criteria"),
               ({"min_delta": 2}, "min_delta"), ({"colour": "red"}, "colour")]
    for change, param in refused:
        reply = fleet.post(**{**good, **change})
        assert reply.status_code == 400, (change, reply.text)
        assert reply.json()["error"]["param"] == param, (change, reply.json())
    assert fleet.router.get("/admin/adapters/rollout").json()["data"] == []
    assert fleet.router.get("/admin/adapters/rollout/rollout_nope").status_code == 404


def test_a_rollout_whose_eval_fails_at_stage_2_rolls_back(fleet):
    w0, w1, _ = fleet.workers
    expected = [chat(w1.url, "math", q) for q in QUESTIONS]  # what version 1 says
    assert all(chat(w0.url, MODEL, q) != e for q, e in zip(QUESTIONS, expected, strict=True))  # not the base model
    evaluation = httpx.post(w1.url + "/v1/evals", timeout=30, json={
        "name": "math answers", "data_source_config": {"type": "custom", "item_schema": {
            "type": "object", "properties": {"q": {"type": "string"}, "expected": {"type": "string"}}}},
        "testing_criteria": [{"type": "string_check", "name": "as_v1", "input": "{{ sample.output_text }}",
                              "reference": "{{ item.expected }}", "operation": "eq"}]}).json()
    source = {"type": "completions", "source": {"type": "file_content", "content": [
        {"item": {"q": q, "expected": e}} for q, e in zip(QUESTIONS, expected, strict=True)]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{ item.q }}"}]},
        "sampling_params": {"temperature": 0, "max_completion_tokens": 4}}
    reply = fleet.post(name="math", version=fleet.v2, store=str(fleet.store), stages=STAGES,
                       eval_id=evaluation["id"], criteria=["as_v1"], data_source=source)
    assert reply.status_code == 201, reply.text
    started = reply.json()
    assert started["stage_workers"] == [1, 2, 3] and started["eval_source"] == "w1"
    assert [(t["worker"], t["stage"], t["previous"]) for t in started["targets"]] == [
        ("w0", 1, None), ("w1", 2, fleet.v1), ("w2", 3, None)]
    done = fleet.wait(started["id"])
    assert done["status"] == "rolled_back", done
    assert len(done["checks"]) == 2, json.dumps(done)
    first, second = done["checks"]
    # stage 1 on w0: its base model against version 2, neither says what version 1 says: no regression
    assert first["passed"] and first["eval"]["worker"] == "w0" and first["eval"]["eval_id"] != evaluation["id"]
    # stage 2 on w1: version 1 (its previous) against version 2: the pass rate falls
    assert not second["passed"] and second["eval"]["worker"] == "w1", second
    row = second["eval"]["criteria"][0]
    assert row["baseline_pass_rate"] == 1.0 and row["candidate_pass_rate"] < 1.0, row
    assert "stage 2" in done["reason"] and "as_v1" in done["reason"]
    assert [t["state"] for t in done["targets"]] == ["restored", "restored", "waiting"]
    assert fleet.versions() == [None, fleet.v1, None]
    assert chat(w1.url, "math", QUESTIONS[0]) == expected[0]  # version 1 again
    state = fleet.router.get("/api/state").json()
    assert state["rollouts"][0]["id"] == started["id"] and state["rollouts"][0]["status"] == "rolled_back"
    html = page_dom(fleet.router.admin + "/")  # the dashboard shows it
    assert len(elements(html, data_rollout=started["id"])) == 1
    row = html.split(f'data-rollout="{started["id"]}"')[1].split("</tr>")[0]
    assert "rolled_back" in row and f"w1: restored (was {fleet.v1})" in row and "stage 2" in row, row


class Clients:
    """Streaming chat completions for the adapter, each picked by the router, until stopped."""

    def __init__(self, fleet, n: int = 2):
        self.fleet, self.stop, self.failures, self.served = fleet, threading.Event(), [], []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int):
        router = self.fleet.router.router
        while not self.stop.is_set():
            messages = [{"role": "user", "content": QUESTIONS[len(self.served) % len(QUESTIONS)]}]
            try:
                picked = router.Pick(router_pb2.PickRequest(model="math", messages=[
                    router_pb2.Message(**m) for m in messages]), timeout=60)
            except Exception as e:  # noqa: BLE001 - a failed pick is a failure
                self.failures.append(f"pick: {e}")
                continue
            failed, started = False, time.monotonic()
            try:
                text = self._stream(picked.endpoint, messages)
                self.served.append((picked.worker_id, text))
            except Exception as e:  # noqa: BLE001
                failed = True
                self.failures.append(f"{picked.worker_id}: {e}")
            took = (time.monotonic() - started) * 1e3
            router.Feedback(router_pb2.FeedbackRequest(request_id=picked.request_id, ttft_ms=took, e2e_ms=took,
                                                       failed=failed), timeout=20)

    @staticmethod
    def _stream(endpoint: str, messages: list[dict]) -> str:
        body = {"model": "math", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
        text, done = "", False
        with httpx.stream("POST", f"http://{endpoint}/v1/chat/completions", json=body, timeout=120) as reply:
            if reply.status_code != 200:
                raise AssertionError(f"{reply.status_code} {reply.read().decode()[:300]}")
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise AssertionError(chunk["error"])
                    text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        if not done:
            raise AssertionError("the stream ended without [DONE]")
        return text

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_a_rollout_goes_stage_by_stage_and_streaming_clients_never_fail(fleet):
    clients = Clients(fleet)
    try:
        wait_until(lambda: len(clients.served) >= 4, 60, "the clients' first answers")
        before = {w for w, _ in clients.served}
        assert before == {"w1"}, before  # only w1 serves math; w0 unloaded it, w2 would load it on demand
        body = {"name": "math", "version": fleet.v2, "store": str(fleet.store), "stages": STAGES, "bake_secs": 2}
        reply = fleet.post(**body)
        assert reply.status_code == 201, reply.text
        rollout_id = reply.json()["id"]
        again = fleet.post(**body)  # idempotent
        assert again.status_code == 200 and again.json()["id"] == rollout_id
        other = fleet.post(**{**body, "version": fleet.v1})
        assert other.status_code == 409 and other.json()["error"]["code"] == "rollout_in_progress"
        serving_counts = []

        def finished():
            r = fleet.rollout(rollout_id)
            serving_counts.append(sum(t["state"] == "serving" for t in r["targets"]))
            return r["status"] != "running"

        wait_until(finished, 120, "the rollout to end")
        done = fleet.rollout(rollout_id)
        served_during = len(clients.served)
        wait_until(lambda: len(clients.served) >= served_during + 4, 60, "answers after the rollout")
    finally:
        clients.close()
    assert done["status"] == "completed", done
    assert [c["stage"] for c in done["checks"]] == [1, 2, 3] and all(c["passed"] for c in done["checks"])
    assert {1, 2, 3} <= set(serving_counts), serving_counts
    assert serving_counts == sorted(serving_counts)  # the version only ever spread
    assert clients.failures == [], clients.failures[:5]
    assert fleet.versions() == [fleet.v2] * 3
    answered = sum(c["error_rates"].get("w0", {}).get("answered", 0) for c in done["checks"])
    assert answered > 0  # w0 (stage 1) took requests for math while the rollout ran
    again = fleet.post(**body)  # the same rollout, completed: returned, not redone
    assert again.status_code == 200 and again.json()["id"] == rollout_id


def test_a_restarted_router_resumes_the_rollout(fleet):
    body = {"name": "math", "version": fleet.v1, "store": str(fleet.store), "stages": STAGES, "bake_secs": 4}
    reply = fleet.post(**body)
    assert reply.status_code == 201, reply.text
    rollout_id = reply.json()["id"]
    wait_until(lambda: fleet.rollout(rollout_id)["stage"] >= 2, 60, "the rollout's second stage")
    code, output = fleet.router.stop()
    assert code == 0, output[-3000:]
    fleet.start_router()
    assert fleet.rollout(rollout_id)["status"] in ("running", "completed")
    done = fleet.wait(rollout_id)
    assert done["status"] == "completed", done
    assert fleet.versions() == [fleet.v1] * 3
    assert "resuming at stage" in fleet.router.output
