"""Failure boundaries on real servers on loopback: device loss is process-terminal, a failed
accelerator step fails only its own requests, and malformed requests change nothing."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import jax
import pytest
from server_process import ServerProcess, free_port

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.faults import DeviceLossInjector, is_device_loss
from kiln.engine.metrics import EngineMetrics
from kiln.errors import DeviceLost

MODEL = "tiny-llama"
LONG = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}


def _chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def _sse(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def _assert_error(body: dict, code: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["code"] == code, body
    assert error["message"]


# ---- recognising device loss -------------------------------------------------------------------


@pytest.mark.parametrize("message,lost", [
    ("INTERNAL: DEVICE_LOST: injected", True),
    ("INTERNAL: Failed to launch kernel: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered", True),
    ("INTERNAL: CUDA error: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure", True),
    ("vkQueueSubmit failed: VK_ERROR_DEVICE_LOST", True),
    ("INTERNAL: Generated function failed: CpuCallback error", False),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB", False),
    ("INVALID_ARGUMENT: Executable expected shape f32[8] for argument 2", False),
])
def test_only_clearly_fatal_runtime_errors_are_device_loss(message, lost):
    assert is_device_loss(jax.errors.JaxRuntimeError(message)) is lost
    assert not is_device_loss(ValueError(message))
    assert is_device_loss(DeviceLost("gone"))


def test_injector_raises_after_n_dispatched_steps():
    never, after_two = DeviceLossInjector(0), DeviceLossInjector(2)
    for _ in range(2):
        never.before_step(), after_two.before_step()
    never.before_step()
    with pytest.raises(jax.errors.JaxRuntimeError, match="DEVICE_LOST") as exc:
        after_two.before_step()
    assert is_device_loss(exc.value)


def test_device_loss_in_the_engine_fails_every_caller(tiny_model):
    """Callers without HTTP (evals, rollouts) see the same: DeviceLost, blocks freed, nothing runs again."""
    from kiln.engine.params import SamplingParams

    engine = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=32, block_size=16, max_num_seqs=4,
                                                  max_num_batched_tokens=32, decode_row_buckets=(4,),
                                                  prefill_token_buckets=(32,), inject_device_loss_after_steps=3))
    try:
        free = engine.at_boundary(lambda: engine._core.pool.num_free).result(30)
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        with pytest.raises(DeviceLost):
            engine.complete([[5, 6, 7], [8, 9]], params, timeout=120)
        assert engine.device_lost is not None and engine.alive()
        assert engine._core.pool.num_free == free and not engine._core.scheduler.requests
        with pytest.raises(DeviceLost):
            engine.complete([[5, 6, 7]], params, timeout=30)
        with pytest.raises(DeviceLost):
            engine.at_boundary(lambda: None).result(30)
        assert engine.snapshot["steps"] == 3 and engine.snapshot["device_lost"]
    finally:
        engine.shutdown()


def test_a_device_loss_outside_the_steps_ends_serving_too(tiny_model):
    """A training job's own accelerator work reports a lost device: the running request fails
    with it and nothing runs again, as when a step loses it."""
    from kiln.engine.params import SamplingParams

    engine = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=32, block_size=16, max_num_seqs=4,
                                                  max_num_batched_tokens=32, decode_row_buckets=(4,),
                                                  prefill_token_buckets=(32,)))
    try:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        outcome: dict = {}

        def first():
            try:
                outcome["result"] = engine.complete([[5, 6, 7]], params, timeout=120)
            except Exception as exc:
                outcome["error"] = exc

        running = threading.Thread(target=first)
        running.start()
        deadline = time.monotonic() + 60
        while engine.snapshot["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        report = engine.report_device_loss(jax.errors.JaxRuntimeError("INTERNAL: DEVICE_LOST: in a training step"))
        with pytest.raises(DeviceLost):
            report.result(30)
        running.join(60)
        assert not running.is_alive() and isinstance(outcome.get("error"), DeviceLost), outcome
        assert engine.device_lost is not None
        assert "in a training step" in engine.device_lost.message
        with pytest.raises(DeviceLost):
            engine.complete([[5, 6]], params, timeout=30)
    finally:
        engine.shutdown()


# ---- device loss: a subprocess server with [debug] inject_device_loss_after_steps ---------------

LOSS_AFTER = 150  # steps: a 200-token request is still running when the device goes


@pytest.fixture(scope="module")
def lossy_server(tiny_model, kiln_cache):
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                        KILN_DEBUG_INJECT_DEVICE_LOSS_AFTER_STEPS=str(LOSS_AFTER))
    yield srv
    code, out = srv.stop()
    assert code == 0, out[-3000:]
    assert "Traceback" not in out and "device lost" in out, out[-3000:]


def test_device_loss_ends_in_flight_requests_and_is_permanent(lossy_server):
    url = lossy_server.url
    assert httpx.get(url + "/health").json()["backend_runtime"]["healthy"] is True
    a_body, b_body = _chat("first", **LONG), {"model": MODEL, "prompt": "second", "stream": True, **LONG}
    prompt_tokens = sum(httpx.post(url + "/tokenize", json={"model": MODEL, **body}).json()["count"]
                        for body in ({"messages": a_body["messages"]}, {"prompt": b_body["prompt"]}))
    prompt_tokens_before = _metric(url, "kiln:prompt_tokens_total")
    # B, a stream, starts first; once it has produced a token, A (non-streamed) joins its batch. Each
    # needs 200 steps and the device lasts 150, so both are in flight when it goes. (Watching /metrics
    # for A to run would cost tens of a tiny model's steps, and B could then arrive after the loss.)
    plain: dict = {}
    a = threading.Thread(target=lambda: plain.update(r=httpx.post(url + "/v1/chat/completions", json=a_body,
                                                                  timeout=120)))
    events: list = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json=b_body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if a.ident is None and isinstance(events[-1], dict) and events[-1].get("choices"):
                    a.start()
    assert a.ident is not None, events
    a.join(120)
    # A was prefilled before the loss: both prompts were processed
    assert _metric(url, "kiln:prompt_tokens_total") - prompt_tokens_before == prompt_tokens

    assert any(e["choices"] and e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e)
    assert events[-1] == "[DONE]"
    _assert_error(events[-2], "device_lost")
    assert events[-2]["error"]["type"] == "service_unavailable"
    assert plain["r"].status_code == 503
    _assert_error(plain["r"].json(), "device_lost")
    steps = _metric(url, "kiln:engine_steps_total")
    assert steps == LOSS_AFTER

    for _ in range(2):  # and it stays that way: no request runs, health stays unhealthy
        r = httpx.post(url + "/v1/chat/completions", json=_chat("third", max_tokens=2))
        assert r.status_code == 503
        _assert_error(r.json(), "device_lost")
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 503
        _assert_error(r.json(), "device_lost")
        for path in ("/health", "/v1/health"):
            h = httpx.get(url + path)
            assert h.status_code == 503 and h.json()["status"] == "unhealthy"
            backend = h.json()["backend_runtime"]
            assert backend["healthy"] is False and backend["restart_required"] is True
            assert backend["reason"].startswith("device_lost") and "DEVICE_LOST" in backend["reason"]
        time.sleep(0.5)
    assert _metric(url, "kiln:device_lost") == 1
    assert _metric(url, "kiln:engine_steps_total") == steps  # the engine was not restarted
    assert _metric(url, "kiln:num_requests_running") == 0
    # what needs no accelerator still answers
    assert httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "abc"}).status_code == 200


# ---- one failed step, malformed requests: an in-process server on the real engine ---------------


class StepFault:
    """Makes the next step whose batch holds a request with `prompt_token` in its prompt fail
    as the accelerator would, once that request has produced `after_tokens` tokens; with
    `take_kv`, the failure also consumes the (donated) KV state."""

    def __init__(self, runner):
        self.runner, self.real_launch = runner, runner._launch
        self.armed: tuple[int, int, bool] | None = None
        self.fired = 0
        runner._launch = self

    def arm(self, prompt_token: int, after_tokens: int = 0, take_kv: bool = False) -> None:
        self.armed = (prompt_token, after_tokens, take_kv)

    def __call__(self, rows, bucket, forward, feed):
        if self.armed is not None:
            token, after, take_kv = self.armed
            if any(token in r.prompt_ids and len(r.output_ids) >= after for r, _ in rows):
                self.armed = None
                self.fired += 1
                if take_kv:
                    self.runner.kv.k.delete()
                    self.runner.kv.v.delete()
                raise jax.errors.JaxRuntimeError("INTERNAL: injected step failure")
        return self.real_launch(rows, bucket, forward, feed)


@contextlib.contextmanager
def in_process_server(engine, tmp):
    """A server in this process (uvicorn on loopback) on an engine the test can reach."""
    import uvicorn

    from kiln.adapters.registry import AdapterRegistry
    from kiln.adapters.store import AdapterStore
    from kiln.config import resolve_settings
    from kiln.server.app import create_app
    from kiln.server.state import ServerState

    settings = resolve_settings(env={"XDG_CACHE_HOME": str(tmp), "KILN_MODEL_SERVED_MODEL_NAME": MODEL})
    state = ServerState(settings, engine, engine._core.metrics, AdapterRegistry(engine, AdapterStore(tmp / "adapters")))
    state.prewarm = "done"
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    engine = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4,
                                                  max_num_batched_tokens=64, decode_row_buckets=(1, 2, 4),
                                                  prefill_token_buckets=(16, 32, 64)), EngineMetrics(MODEL))
    with in_process_server(engine, tmp_path_factory.mktemp("live")) as url:
        yield url, engine, StepFault(engine._core.runner)


def _engine_state(engine) -> dict:
    """The scheduler and block pool as the engine thread sees them, between two steps."""
    core = engine._core
    return engine.at_boundary(lambda: {
        "free": core.pool.num_free, "requests": len(core.scheduler.requests),
        "running": len(core.scheduler.running), "waiting": len(core.scheduler.waiting)}).result(30)


def _idle(engine) -> dict:
    deadline = time.monotonic() + 30
    while (state := _engine_state(engine))["requests"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    return state


@pytest.mark.parametrize("take_kv", [False, True], ids=["step", "step-and-kv"])
def test_failed_step_fails_only_its_request(live, take_kv):
    url, engine, fault = live
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4},
                    timeout=120)  # its first steps may compile
    assert ok.status_code == 200
    initial = _idle(engine)
    failures = _metric(url, "kiln:step_failures_total")

    fault.arm(prompt_token=201, take_kv=take_kv)  # fails the request's first step (its prefill)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [201, 9, 9, 9], **LONG}, timeout=60)
    assert r.status_code == 500 and fault.armed is None
    _assert_error(r.json(), "accelerator_error")
    assert r.json()["error"]["type"] == "internal_error"

    fault.arm(prompt_token=202, after_tokens=5, take_kv=take_kv)  # fails a stream midway
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": [202, 9, 9], "stream": True, **LONG}) as s:
        events = _sse(s)
    assert fault.armed is None, "the fault never fired"
    assert events[-1] == "[DONE]"
    _assert_error(events[-2], "accelerator_error")
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events[:-2])

    assert _idle(engine) == initial  # every block and scheduler slot of the failed requests is back
    assert _metric(url, "kiln:step_failures_total") == failures + 2
    for _ in range(2):  # the engine goes on
        r = httpx.post(url + "/v1/chat/completions", json=_chat("after", max_tokens=6, temperature=0),
                       timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    h = httpx.get(url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["backend_runtime"]["healthy"] is True
    assert _metric(url, "kiln:device_lost") == 0


def test_a_stopped_engine_refuses_inference_with_engine_unavailable(tiny_model, tmp_path):
    engine = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=32, block_size=16, max_num_seqs=4,
                                                  max_num_batched_tokens=32, decode_row_buckets=(4,),
                                                  prefill_token_buckets=(32,)), EngineMetrics(MODEL))
    with in_process_server(engine, tmp_path) as url:
        engine.shutdown()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503
        _assert_error(r.json(), "engine_unavailable")
        h = httpx.get(url + "/health", timeout=30)
        assert h.status_code == 503 and h.json()["status"] == "unhealthy"
        assert h.json()["backend_runtime"]["reason"].startswith("engine_stopped")


MALFORMED = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b'{"model": "tiny-llama"}', 400),
    ("/v1/chat/completions", json.dumps(_chat("x", temperature=-3)).encode(), 400),
    ("/v1/chat/completions", json.dumps(_chat("x", max_tokens=10_000_000)).encode(), 400),
    ("/v1/chat/completions", json.dumps(_chat("x", top_logprobs=3)).encode(), 400),
    ("/v1/chat/completions", json.dumps({**_chat("x"), "model": "nope"}).encode(), 404),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [999_999]}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": []}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}).encode(), 400),
    ("/v1/completions", b"[1, 2, 3]", 400),
]


def test_malformed_requests_leave_health_unchanged(live):
    url, engine, _ = live
    initial = _idle(engine)
    with httpx.Client(base_url=url, headers={"content-type": "application/json"}, timeout=120) as client:
        for _ in range(3):
            for path, body, status in MALFORMED:
                r = client.post(path, content=body)
                assert r.status_code == status, (path, body, r.text)
                assert r.json()["error"]["message"], r.text
        for path in ("/health", "/v1/health"):
            h = client.get(path)
            assert h.status_code == 200 and h.json()["status"] == "ok"
            assert h.json()["backend_runtime"] == {**h.json()["backend_runtime"], "healthy": True, "reason": None}
        assert client.post("/v1/chat/completions", json=_chat("fine", max_tokens=3)).status_code == 200
    assert _idle(engine) == initial


# ---- an accelerator failure on an IREE route quarantines the route ----------------------------


def test_a_failed_step_on_an_iree_route_quarantines_it_and_xla_serves_on(tiny_model, kiln_cache, live,
                                                                         tmp_path):
    """iree-cpu fails one step: that request gets 500, the route is out of service until a restart
    (health 503 degraded), and every later request is served on XLA with the XLA route's tokens."""
    pytest.importorskip("iree.runtime")
    from test_iree_route import SMALL

    from kiln.engine.backends import select_backend

    xla_url = live[0]
    route = select_backend("iree-cpu", kiln_cache / "iree")
    engine = AsyncEngine(tiny_model, EngineConfig(**SMALL), EngineMetrics(MODEL), backend=route)
    fault = StepFault(engine._core.runner)
    prompt = {"model": MODEL, "prompt": [40, 41, 42, 43], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with in_process_server(engine, tmp_path) as url:
        expected = httpx.post(xla_url + "/v1/completions", json=prompt, timeout=120).json()["choices"][0]["text"]
        r = httpx.post(url + "/v1/completions", json=prompt, timeout=300)  # compiles and gates its buckets
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        h = httpx.get(url + "/health", timeout=30)
        assert h.status_code == 200 and h.json()["backend_runtime"]["route"] == "iree-cpu"

        fault.arm(prompt_token=201, after_tokens=3)  # a stream fails midway, on the device
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": [201, 9, 9], "stream": True, **LONG}) as s:
            events = _sse(s)
        assert fault.armed is None, "the fault never fired"
        _assert_error(events[-2], "accelerator_error")

        for path in ("/health", "/v1/health"):
            h = httpx.get(url + path, timeout=30)
            assert h.status_code == 503 and h.json()["status"] == "degraded", h.text
            backend = h.json()["backend_runtime"]
            assert backend["healthy"] is False and backend["restart_required"] is True
            assert backend["reason"].startswith("route_quarantined: iree-cpu: ") and "injected" in backend["reason"]
            assert backend["route"].startswith("xla:") and "quarantined" in backend["route_reason"]
        config = httpx.get(url + "/v1/config", timeout=30).json()["backend"]
        assert config["route"] == "xla" and config["quarantined"].startswith("iree-cpu: ")
        assert _metric(url, "kiln:route_quarantined") == 1 and _metric(url, "kiln:device_lost") == 0

        for _ in range(2):  # requests go on, on XLA, with XLA's tokens
            r = httpx.post(url + "/v1/completions", json=prompt, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        assert not engine._core.runner.backend.is_iree and len(route.resident) == 0
        assert _idle(engine)["requests"] == 0
