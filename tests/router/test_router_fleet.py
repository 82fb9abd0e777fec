"""The router in front of real Kiln workers: ready while the fleet is idle (no KV event has been sent),
picks that go out at once, prefix affinity once there is traffic, and adapter affinity (a request for
an adapter goes to the worker that has it loaded, unless that worker is overloaded)."""

import concurrent.futures
import threading
import time

import httpx
import pytest
from peft_adapters import make_peft_adapter
from router.test_router_server import RouterProcess, stop_fleet, wait_until, write_config
from server_process import ServerProcess, free_port
from tiny_models import make_hf_model

from kiln.adapters import peft_io
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
from kiln.adapters.store import AdapterStore
from kiln.router.calibration import scraped_prefill_scale
from kiln.router.config import Predictor
from kiln.router.proto import router_pb2
from kiln.router.scrape import PrefillCounters, parse_metrics

MODEL = "tiny-llama"
READY_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model):
    """An adapter store both workers share, holding `math`."""
    hf = make_hf_model("llama", vocab_size=260, seed=3)  # conftest's tiny_model in transformers
    peft_dir = tmp_path_factory.mktemp("peft") / "math"
    make_peft_adapter(hf, peft_dir, rank=2, alpha=4.0, seed=13)
    weights, info = peft_io.read_peft(peft_dir, tiny_model.config)
    root = tmp_path_factory.mktemp("store")
    AdapterStore(root).save(Manifest(name="math", base_model=BaseModelRef(MODEL, tiny_model.weights_digest),
                                     rank=info["rank"], alpha=info["alpha"], target_modules=info["target_modules"],
                                     weights_digest="", provenance=provenance("test")), weights)
    return root


@pytest.fixture(scope="module")
def fleet(tiny_model, kiln_cache, store, tmp_path_factory):
    """Two idle workers on one store (w0 has `math` loaded, w1 lists it to load on demand) and a router
    started in front of them; `fleet.ready_after_s` is how long /readyz took to answer 200."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    workers = []
    router = None
    try:
        for n, (zmq, replay) in enumerate(ports):
            # w0 runs two requests at a time, so that more wait there (see the adapter test)
            preload = {"KILN_ADAPTERS_LOAD": "math", "KILN_ENGINE_MAX_NUM_SEQS": "2"} if n == 0 else {}
            workers.append(ServerProcess(
                tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL, KILN_ADAPTERS_STORE=str(store),
                KILN_ENGINE_KV_EVENTS_ENDPOINT=f"tcp://*:{zmq}",  # (a wildcard host binds)
                KILN_ENGINE_KV_EVENTS_REPLAY_ENDPOINT=f"tcp://*:{replay}",
                # each its own jobs and evals: none that another test left behind resumes here and loads it
                KILN_TRAIN_DATA_DIR=str(tmp_path_factory.mktemp(f"data-w{n}")), **preload))
        config = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "metrics_poll_ms": 100,
                  "models_refresh_secs": 1,
                  # the tiny model's prompts are a few blocks: a cached one saves 20 ms, so that they count
                  "profile": [{"name": "p", "predictor": {"attention_uncached_block_ms": 20.0}}],
                  "workerset": [{"name": "a", "profile": "p", "kv_block_size": 16}]}
        static = [{"worker_id_str": f"w{n}", "worker_id_num": n, "model_name": MODEL,
                   "zmq_endpoint": f"tcp://127.0.0.1:{zmq}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                   "metrics_url": w.url + "/metrics", "http_url": w.url} for n, ((zmq, replay), w) in
                  enumerate(zip(ports, workers, strict=True))]
        started = time.monotonic()
        router = RouterProcess(write_config(tmp_path_factory.mktemp("fleet"), config, {"a": static}))
        router.not_ready_reasons = []
        while (r := router.get("/readyz")).status_code != 200:
            router.not_ready_reasons += r.json()["reasons"]
            assert time.monotonic() - started < 60, r.json()
            time.sleep(0.05)
        router.ready_after_s = time.monotonic() - started
        router.workers = workers
        yield router
    finally:
        stop_fleet(router, workers)


def state_of(router, worker: str) -> dict:
    return next(w for w in router.get("/api/state").json()["workers"] if w["worker"] == worker)


def send(router, picked, model: str, messages: list[dict], max_tokens: int = 4) -> str:
    """Sends the chat completion to the picked worker and reports it back; the reply's text."""
    started = time.monotonic()
    reply = httpx.post(f"http://{picked.endpoint}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    took_ms = (time.monotonic() - started) * 1e3
    assert reply.status_code == 200, reply.text
    assert router.router.Feedback(router_pb2.FeedbackRequest(
        request_id=picked.request_id, ttft_ms=took_ms, e2e_ms=took_ms), timeout=20).known
    return reply.json()["choices"][0]["message"]["content"]


def pick(router, model: str, messages: list[dict], **fields):
    return router.router.Pick(router_pb2.PickRequest(
        model=model, messages=[router_pb2.Message(**m) for m in messages], **fields), timeout=60)


def test_an_idle_fleet_is_ready_within_seconds_and_its_first_picks_go_out(fleet):
    assert fleet.ready_after_s < READY_WITHIN_S, (fleet.ready_after_s, fleet.not_ready_reasons)
    assert all("reachable" in r or "listed" in r for r in fleet.not_ready_reasons), fleet.not_ready_reasons
    assert all(state_of(fleet, f"w{n}")["index_blocks"] == 0 for n in range(2))  # no KV event came: caches are cold
    messages = [{"role": "user", "content": "the first request of an idle fleet"}]
    picked = pick(fleet, MODEL, messages)
    assert picked.worker_id in ("w0", "w1") and picked.cached_blocks == 0
    assert send(fleet, picked, MODEL, messages)


def test_prefix_affinity_once_there_is_traffic(fleet):
    long = [{"role": "user", "content": "a long shared system prompt about kilns, glazes and firing schedules " * 2}]
    first = pick(fleet, MODEL, long)
    send(fleet, first, MODEL, long)
    def settled():  # its KV events in the index, and a scrape since the request ended
        state = state_of(fleet, first.worker_id)
        return state["index_blocks"] >= first.prompt_blocks and state["running"] == state["waiting"] == 0

    wait_until(settled, 30, "the worker's KV events and an idle scrape")
    again = pick(fleet, MODEL, long)
    assert again.worker_id == first.worker_id and again.cached_blocks > 0, again
    send(fleet, again, MODEL, long)


def test_an_adapter_goes_to_the_worker_that_has_it_loaded_unless_it_is_overloaded(fleet):
    wait_until(lambda: state_of(fleet, "w1")["adapters_unloaded"] == ["math"], 20, "w1's /v1/models")
    assert state_of(fleet, "w0")["adapters_unloaded"] == [] and "math" in state_of(fleet, "w0")["models"]
    messages = [{"role": "user", "content": "what is 2 + 2?"}]
    def idle():  # a scrape taken while the last request ran still counts it until the next one
        return all(state_of(fleet, f"w{n}")["running"] == state_of(fleet, f"w{n}")["waiting"] == 0 for n in range(2))

    for _ in range(4):  # one after the other: w0 holds math loaded, w1 would load it first
        wait_until(idle, 30, "the router to see an idle fleet")
        picked = pick(fleet, "math", messages)
        loads = [(w["worker"], w["running"], w["waiting"], w["inflight"], w["kv_usage"])
                 for w in fleet.get("/api/state").json()["workers"]]
        assert picked.worker_id == "w0", (picked, loads)
        send(fleet, picked, "math", messages)
    # the load is a cost in the prediction, not a filter: requests waiting on w0 (it runs two at a time)
    # outweigh it, and w1 gets the next
    stop = threading.Event()

    def occupy():  # a stream on w0 (the tiny model's whole context), closed (so aborted) once the pick is made
        body = {"model": "math", "messages": messages, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://{picked.endpoint}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # two run, ten wait (a second or more here)
        streams = [pool.submit(occupy) for _ in range(12)]
        try:
            wait_until(lambda: state_of(fleet, "w0")["waiting"] >= 2, 30, "requests waiting on w0")
            busy = pick(fleet, "math", messages)
        finally:
            stop.set()
        for f in streams:
            f.result()
    assert busy.worker_id == "w1", busy
    view = fleet.get("/api/state").json()
    assert any(w["adapters_unloaded"] == ["math"] for w in view["workers"])
    fleet.router.Feedback(router_pb2.FeedbackRequest(request_id=busy.request_id, failed=True), timeout=20)


def test_the_router_prices_prefill_at_the_speed_the_workers_report(fleet):
    """Before any Feedback would calibrate it, the worker set's prefill scale comes from the workers'
    own /metrics: their prefill time against what the profile's coefficients predict for it."""
    predictor = Predictor(attention_uncached_block_ms=20.0)  # the fleet's profile
    messages = [{"role": "user", "content": "how fast do you prefill?"}]

    def matches():
        samples = [parse_metrics(httpx.get(w.url + "/metrics").text, MODEL) for w in fleet.workers]
        expected = scraped_prefill_scale(predictor, 16, PrefillCounters.total(s.prefill for s in samples))
        assert expected is not None, samples  # the tests before sent more than enough requests
        pick(fleet, MODEL, messages)  # (a pick reads the scrape)
        calibration = fleet.get("/api/state").json()["worker_sets"][0]["calibration"]
        return calibration["scraped_prefill_scale"] == pytest.approx(expected) and calibration["prefill_scale"] != 1.0

    wait_until(matches, 30, "the router's prefill scale to be the workers' measured one")
