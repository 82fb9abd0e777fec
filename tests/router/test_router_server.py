"""The router process end to end: `python -m kiln.router --config ...` on loopback ports, talked to
with a real gRPC client (the committed stubs) and over its admin HTTP.

Two routers are started, once per module each: one in mock mode, and one in live mode whose
workers are stand-ins: a real Kiln KVEventPublisher each (KV events) and a small HTTP server each
(/metrics with vLLM's gauge names, /v1/models and /render)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_process import free_port

from kiln.engine.kv_events import KVEventPublisher
from kiln.kv_wire import BlockRemoved, BlockStored
from kiln.router.proto import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
BS = 4  # the test worker sets' kv_block_size


# ---- helpers ------------------------------------------------------------------------------------


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stop_fleet(router, servers) -> None:
    """Stops a RouterProcess (it must exit 0; None: none started) and then Kiln servers, whatever the
    router did."""
    try:
        if router is not None:
            code, output = router.stop()
            assert code == 0, output[-4000:]
    finally:
        for server in servers:
            server.stop_cleanly()


def to_toml(doc: dict, prefix: str = "") -> str:
    """Scalars and arrays as `key = value`; dicts as [tables]; lists of dicts as [[arrays of tables]]."""

    def tables(v):
        return isinstance(v, list) and v and all(isinstance(x, dict) for x in v)

    lines = [f"{k} = {json.dumps(v)}" for k, v in doc.items() if not isinstance(v, dict) and not tables(v)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += [f"[{prefix}{k}]", to_toml(v, f"{prefix}{k}.")]
        elif tables(v):
            for item in v:
                lines += [f"[[{prefix}{k}]]", to_toml(item, f"{prefix}{k}.")]
    return "\n".join(lines) + "\n"


def write_config(tmp: Path, config: dict, worker_sets: dict[str, list[dict]]) -> Path:
    """The router's TOML with a workers file per worker set (name -> its workers)."""
    for ws in config["workerset"]:
        path = tmp / f"workers-{ws['name']}.toml"
        path.write_text(to_toml({"workers": worker_sets[ws["name"]]}))
        ws["discovery"] = {"workers_file": str(path)}
    path = tmp / "router.toml"
    path.write_text(to_toml(config))
    return path


class RouterProcess:
    """`python -m kiln.router --config FILE`, with the addresses it logs; `stop()` sends SIGTERM."""

    def __init__(self, config: Path, admin: bool = True, **env_overrides: str) -> None:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", **env_overrides}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.router", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.grpc = self._logged(r"gRPC listening on (\S+)")
        self.admin = "http://" + self._logged(r"admin HTTP listening on http://(\S+)") if admin else None
        self.channel = grpc.insecure_channel(self.grpc)
        self.router = router_pb2_grpc.RouterStub(self.channel)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _logged(self, pattern: str) -> str:
        def found():
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"router exited ({self.proc.returncode}):\n{self.output[-4000:]}")
            return next((m.group(1) for line in list(self.lines) if (m := re.search(pattern, line))), None)

        return wait_until(found, 60, f"the router to log {pattern!r}")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.admin + path, timeout=10)

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the router's /metrics (labels must match exactly), None if absent."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in self.get("/metrics").text.splitlines():
            if line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            got_name, _, got_labels = sample.partition("{")
            got = ",".join(sorted(got_labels.rstrip("}").split(","))) if got_labels else ""
            if got_name == name and got == want:
                return float(value)
        return None

    def stop(self) -> tuple[int, str]:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode, self.output


def code_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, timeout=20, **kwargs)
    return e.value.code(), e.value.details()


def chunks(data: bytes, size: int = 7, **meta) -> list[router_pb2.BodyChunk]:
    parts = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    return [
        router_pb2.BodyChunk(data=p, last=i == len(parts) - 1, **(meta if i == 0 else {})) for i, p in enumerate(parts)
    ]


# ---- the generated code -------------------------------------------------------------------------


def test_the_generated_code_matches_router_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the stubs")
    from kiln.router.proto.generate import generate

    for path in generate(tmp_path):
        committed = ROOT / "kiln" / "router" / "proto" / path.name
        assert path.read_text() == committed.read_text(), (
            f"{committed.name} differs from what router.proto generates: run python -m kiln.router.proto.generate"
        )


# ---- mock mode ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mock")
    config = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "mock_mode": True,
        "body_max_request_kb": 2,
        "body_max_total_kb": 3,
        "body_idle_timeout_secs": 2,
        "body_ttl_secs": 4,
        "profile": [{"name": "p", "predictor": {"base_ms": 123.0}}],
        "workerset": [
            {"name": "a", "profile": "p", "kv_block_size": BS},
            {"name": "b", "profile": "p", "kv_block_size": BS},
        ],
        "metrics": {"tenant_labels": ["acme"]},
        "rate_limit": {"enabled": True},
    }
    workers = {
        "a": [
            {"worker_id_str": f"w{i}", "worker_id_num": i, "model_name": "m", "http_url": f"http://10.0.0.{i}:8000"}
            for i in range(4)
        ],
        "b": [{"worker_id_str": "x0", "worker_id_num": 10, "model_name": "m2"}],
    }
    router = RouterProcess(write_config(tmp, config, workers))
    yield router
    code, output = router.stop()
    assert code == 0, output[-4000:]
    assert "router stopped" in output


def test_mock_picks_are_deterministic(mock):
    seen = set()
    for i in range(24):
        request = router_pb2.PickRequest(model="m", prompt=f"prompt {i}", tenant="acme")
        first = mock.router.Pick(request, timeout=20)
        again = mock.router.Pick(request, timeout=20)
        assert (first.worker_id, first.endpoint) == (again.worker_id, again.endpoint)
        assert first.workerset == "a" and first.predicted_ms == 123.0 and first.cached_blocks == 0
        assert first.reason == "mock" and first.request_id and first.request_id != again.request_id
        assert first.endpoint == f"10.0.0.{first.worker_id[1:]}:8000"
        seen.add(first.worker_id)
    assert len(seen) > 1  # the hash spreads prompts over the set's workers
    ids = mock.router.Pick(router_pb2.PickRequest(model="m", token_ids=list(range(10))), timeout=20)
    assert ids.prompt_blocks == 10 // BS
    assert mock.router.Pick(router_pb2.PickRequest(model="m2", prompt="x"), timeout=20).worker_id == "x0"


def test_mock_errors(mock):
    code, details = code_of(mock.router.Pick, router_pb2.PickRequest(model="nope", prompt="hi"))
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details
    code, details = code_of(mock.router.Pick, router_pb2.PickRequest(model="m"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details
    code, details = code_of(mock.router.Pick, router_pb2.PickRequest(prompt="hi"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model" in details


def test_health_and_reflection(mock):
    health = health_pb2_grpc.HealthStub(mock.channel)
    for service in ("", "kiln.router.v1.Router", "kiln.router.v1.RateLimiter"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=20)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service
    assert code_of(health.Check, health_pb2.HealthCheckRequest(service="nope"))[0] == grpc.StatusCode.NOT_FOUND

    reflection = reflection_pb2_grpc.ServerReflectionStub(mock.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(reflection.ServerReflectionInfo(iter([request]), timeout=20))
    services = {s.name for s in response.list_services_response.service}
    assert {"kiln.router.v1.Router", "kiln.router.v1.RateLimiter", "grpc.health.v1.Health"} <= services
    assert "kiln.router.v1.TokenReview" not in services  # [token_review] is off


def test_rate_limiter_admits_everything(mock):
    limiter = router_pb2_grpc.RateLimiterStub(mock.channel)
    assert limiter.Reserve(router_pb2.ReserveRequest(tenant="acme", tokens=10**9), timeout=20).admitted
    assert "admits every reservation" in mock.output


def test_push_body_picks_as_pick_does(mock):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    body = json.dumps({"model": "m", "messages": messages, "stream": True, "max_tokens": 5}).encode()
    pushed = mock.router.PushBody(iter(chunks(body, request_id="r-1", tenant="acme")), timeout=20)
    picked = mock.router.Pick(
        router_pb2.PickRequest(model="m", messages=[router_pb2.Message(**m) for m in messages]), timeout=20
    )
    assert pushed.worker_id == picked.worker_id and pushed.request_id == "r-1"
    completion = json.dumps({"model": "m", "prompt": "prompt 3"}).encode()
    pushed = mock.router.PushBody(iter(chunks(completion, size=1000)), timeout=20)
    picked = mock.router.Pick(router_pb2.PickRequest(model="m", prompt="prompt 3"), timeout=20)
    assert pushed.worker_id == picked.worker_id
    # the end of the stream ends the body, even without a last chunk
    pushed = mock.router.PushBody(iter([router_pb2.BodyChunk(data=completion)]), timeout=20)
    assert pushed.worker_id == picked.worker_id


def test_push_body_errors(mock):
    push = mock.router.PushBody
    for data, words in [
        (b'{"model": "m", "prompt": ', "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompt": "hi"}', "no model"),
        (b'{"model": "m"}', "prompt"),
    ]:
        code, details = code_of(push, iter(chunks(data)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (data, details)
    assert code_of(push, iter([]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, details = code_of(push, iter(chunks(json.dumps({"model": "nope", "prompt": "x"}).encode())))
    assert code == grpc.StatusCode.NOT_FOUND

    big = json.dumps({"model": "m", "prompt": "x" * 3000}).encode()  # over body_max_request_kb = 2
    code, details = code_of(push, iter(chunks(big, size=500)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "body_max_request_kb" in details

    def stalls():
        yield router_pb2.BodyChunk(data=b'{"model": "m", ')
        time.sleep(3)  # over body_idle_timeout_secs = 2
        yield router_pb2.BodyChunk(data=b'"prompt": "x"}', last=True)

    started = time.monotonic()
    code, details = code_of(push, stalls())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "body_idle_timeout_secs" in details
    assert time.monotonic() - started < 3.5  # refused at the idle timeout (2 s), not at the TTL (4 s)
    assert mock.metric("kiln_router_body_rejections_total", reason="too_large") == 1
    assert mock.metric("kiln_router_body_rejections_total", reason="idle") == 1
    wait_until(lambda: mock.metric("kiln_router_body_bytes_buffered") == 0, what="bodies to be released")


def test_a_body_still_arriving_after_body_ttl_secs_is_dropped(mock):
    """A stream that never pauses past body_idle_timeout_secs (2 s) but is still arriving after body_ttl_secs
    (4 s) is refused with DEADLINE_EXCEEDED, and its bytes leave the server-wide budget (3 KB): a body that
    needs nearly all of it is taken right after."""
    held = []

    def trickles():
        yield router_pb2.BodyChunk(data=b'{"model": "m", "prompt": "' + b"t" * 1500)
        for _ in range(40):  # 20 s at most; the TTL ends it after about 4
            time.sleep(0.5)
            held.append(mock.metric("kiln_router_body_bytes_buffered"))
            yield router_pb2.BodyChunk(data=b"t")
        yield router_pb2.BodyChunk(data=b'"}', last=True)

    started = time.monotonic()
    code, details = code_of(mock.router.PushBody, trickles())
    took = time.monotonic() - started
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "body_ttl_secs" in details, details
    assert 3.5 < took < 15, took
    assert max(h or 0 for h in held) >= 1500  # the bytes were held while the stream was open
    assert mock.metric("kiln_router_body_rejections_total", reason="ttl") == 1
    wait_until(lambda: mock.metric("kiln_router_body_bytes_buffered") == 0, what="the body to be released")
    big = json.dumps({"model": "m", "prompt": "b" * 1900}).encode()  # within 2 KB, most of the 3 KB budget
    assert mock.router.PushBody(iter(chunks(big, size=500)), timeout=20).worker_id


def test_bodies_share_one_budget(mock):
    """Two streams within body_max_request_kb (2 KB) that together exceed body_max_total_kb (3 KB)."""
    resume = threading.Event()
    first_half = b'{"model": "m", "prompt": "' + b"a" * 1500
    results = {}

    def slow():
        yield router_pb2.BodyChunk(data=first_half)
        resume.wait(10)
        yield router_pb2.BodyChunk(data=b'"}', last=True)

    thread = threading.Thread(target=lambda: results.update(slow=mock.router.PushBody(slow(), timeout=20)))
    thread.start()
    try:
        wait_until(lambda: mock.metric("kiln_router_body_bytes_buffered") == len(first_half), what="the first half")
        second = json.dumps({"model": "m", "prompt": "b" * 1600}).encode()
        code, details = code_of(mock.router.PushBody, iter(chunks(second, size=400)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "body_max_total_kb" in details
    finally:
        resume.set()
        thread.join(20)
    assert results["slow"].worker_id  # the first stream was unaffected


def test_mock_feedback_and_admin(mock):
    pick = mock.router.Pick(router_pb2.PickRequest(model="m", prompt="feedback", request_id="fb-1"), timeout=20)
    assert pick.request_id == "fb-1"
    feedback = router_pb2.FeedbackRequest(request_id="fb-1", ttft_ms=150.0, e2e_ms=700.0)
    assert mock.router.Feedback(feedback, timeout=20).known
    assert not mock.router.Feedback(router_pb2.FeedbackRequest(request_id="fb-1", ttft_ms=1.0), timeout=20).known
    assert not mock.router.Feedback(router_pb2.FeedbackRequest(request_id="never"), timeout=20).known
    code, _ = code_of(mock.router.Feedback, router_pb2.FeedbackRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    ready = mock.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"]
    # tenant_labels = ["acme"]: acme is its own label, every other tenant is "other"
    mock.router.Pick(router_pb2.PickRequest(model="m2", prompt="t", tenant="acme"), timeout=20)
    mock.router.Pick(router_pb2.PickRequest(model="m2", prompt="t", tenant="zeta"), timeout=20)
    labels = {"workerset": "b", "worker": "x0", "reason": "mock"}
    assert mock.metric("kiln_router_picks_total", **labels, tenant="acme") >= 1
    assert mock.metric("kiln_router_picks_total", **labels, tenant="other") >= 1
    assert mock.metric("kiln_router_picks_total", **labels, tenant="zeta") is None
    assert mock.metric("kiln_router_prediction_error_ms_count", workerset="a") == 1
    assert mock.metric("kiln_router_prediction_error_ms_bucket", workerset="a", le="0.0") == 0
    assert mock.metric("kiln_router_prediction_error_ms_bucket", workerset="a", le="50.0") == 1
    assert mock.metric("kiln_router_prediction_abs_error_ms_sum", workerset="a") == pytest.approx(150.0 - 123.0)
    assert mock.metric("kiln_router_feedback_total", outcome="unknown") == 2
    # the observed latencies, labelled like the picks (the pick had no tenant: "other")
    observed = {"workerset": "a", "worker": pick.worker_id, "tenant": "other"}
    assert mock.metric("kiln_router_ttft_ms_count", **observed) == 1
    assert mock.metric("kiln_router_ttft_ms_sum", **observed) == 150.0
    assert mock.metric("kiln_router_e2e_ms_count", **observed) == 1
    assert mock.metric("kiln_router_e2e_ms_sum", **observed) == 700.0
    assert mock.metric("kiln_router_e2e_ms_bucket", **observed, le="400.0") == 0
    assert mock.metric("kiln_router_e2e_ms_bucket", **observed, le="800.0") == 1
    state = mock.get("/api/state").json()
    assert state["mode"] == "mock" and state["workers_total"] == 5
    fed = next(w for w in state["workers"] if w["worker"] == pick.worker_id)
    assert (fed["ttft_ms"], fed["e2e_ms"]) == (150.0, 700.0)
    assert [w["worker"] for w in state["workers"]] == ["w0", "w1", "w2", "w3", "x0"]


def test_token_review_without_an_api_server_is_unavailable(tmp_path):
    """With credentials [token_review] loads and serves; an API server that cannot be reached is UNAVAILABLE.
    (Reviews against a working API server: tests/router/test_router_k8s.py.)"""
    kubeconfig = tmp_path / "kubeconfig"
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    config = {
        "listen": "127.0.0.1:0",
        "mock_mode": True,
        "profile": [{"name": "p"}],
        "workerset": [{"name": "a", "profile": "p", "kv_block_size": BS}],
        "token_review": {"enabled": True},
    }
    workers = {"a": [{"worker_id_str": "w0", "worker_id_num": 0, "model_name": "m"}]}
    router = RouterProcess(write_config(tmp_path, config, workers), admin=False, KUBECONFIG=str(kubeconfig))
    try:
        review = router_pb2_grpc.TokenReviewStub(router.channel).Review
        code, details = code_of(review, router_pb2.TokenReviewRequest(token="t", audiences=["a"]))
        assert code == grpc.StatusCode.UNAVAILABLE and f"cannot reach {server}" in details
        health = health_pb2_grpc.HealthStub(router.channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="kiln.router.v1.TokenReview"), timeout=20).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        # a second router cannot take the same port
        busy = tmp_path / "busy"
        busy.mkdir()
        path = write_config(busy, {**config, "listen": router.grpc}, workers)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        proc = subprocess.run(
            [sys.executable, "-m", "kiln.router", "--config", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=ROOT,
        )
        assert proc.returncode == 1 and "cannot serve gRPC on listen" in proc.stderr, proc.stderr[-2000:]
    finally:
        code, output = router.stop()
    assert code == 0, output[-4000:]


# ---- live mode: stand-in workers ----------------------------------------------------------------


class FakeWorker:
    """A worker's HTTP side (/metrics, /v1/models, /render) and its KV event publisher."""

    def __init__(self, num: int, kv_usage: float, models: list[str], render_ids: list[int]) -> None:
        self.num, self.kv_usage, self.models, self.render_ids = num, kv_usage, models, render_ids
        self.renders: list[dict] = []
        self.publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        self.port = 0
        self.server: ThreadingHTTPServer | None = None
        self.start()

    def metrics(self) -> str:
        lines = []
        for name, value in [
            ("vllm:num_requests_running", 0),
            ("vllm:num_requests_waiting", 0),
            ("vllm:kv_cache_usage_perc", self.kv_usage),
        ]:
            lines += [
                f"# TYPE {name} gauge",
                f'{name}{{engine="0",model_name="m"}} {value}',
                f'{name}{{engine="0",model_name="another"}} 0.99',  # another model's: not read
            ]
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, ctype: str, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                if self.path == "/metrics":
                    self._send(200, "text/plain; version=0.0.4", worker.metrics().encode())
                elif self.path == "/v1/models":
                    cards = [{"id": m, "object": "model", "owned_by": "kiln"} for m in worker.models]
                    self._send(200, "application/json", json.dumps({"object": "list", "data": cards}).encode())
                else:
                    self._send(404, "text/plain", b"not found")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path != "/render":
                    return self._send(404, "text/plain", b"not found")
                worker.renders.append(body)
                self._send(200, "application/json", json.dumps({"prompt_token_ids": worker.render_ids}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop_http(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        return {
            "worker_id_str": f"w{self.num}",
            "worker_id_num": self.num,
            "model_name": "m",
            "zmq_endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
            "metrics_url": self.url + "/metrics",
            "http_url": self.url,
            "availability_zone": f"zone-{self.num % 2}",
        }

    def store(self, tokens: list[int], block_size: int = BS, first_hash: int = 1000) -> None:
        """BlockStored events for the full blocks of `tokens`, chained from the prompt's start."""
        hashes = [first_hash + i for i in range(len(tokens) // block_size)]
        self.publisher.publish(
            [BlockStored(hashes, None, tokens[: len(hashes) * block_size], block_size, None, "GPU", None)]
        )


PREFIX = list(range(100, 132))  # 8 blocks of 4
RENDERED = PREFIX + [7, 8, 9]  # what every /render answers: the prefix and a partial block
KV = {0: 0.25, 1: 0.75, 2: 0.5, 3: 0.0}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    workers = {n: FakeWorker(n, KV[n], ["m", "m-lora"] if n == 2 else ["m"], RENDERED) for n in range(4)}
    config = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "metrics_poll_ms": 100,
        "models_refresh_secs": 1,
        "replay_timeout_ms": 2000,
        "profile": [
            {
                "name": "p",
                # a cached block saves 20 ms, and 5 ms is a tie: prefixes decide, then load, then kv_usage
                "predictor": {"attention_uncached_block_ms": 20.0},
                "picker": {"tie_tolerance_ms": 5.0},
            }
        ],
        "workerset": [{"name": "a", "profile": "p", "kv_block_size": BS}],
        "metrics": {"tenant_labels": "all"},
    }
    router = RouterProcess(write_config(tmp, config, {"a": [w.config() for w in workers.values()]}))
    try:
        # ready once the workers are reachable, before any of them has sent a KV event
        router.ready_before_events = wait_until(lambda: (r := router.get("/readyz")).status_code == 200 and r, 10,
                                                "/readyz with idle workers")
        workers[1].store(PREFIX)
        workers[3].store(list(range(8)), block_size=8)  # not the set's block size: w3 is evicted

        def synced():
            for w in workers.values():  # a live message each; the first one replays what came before
                w.publisher.publish([BlockRemoved([10**9], "GPU")])
            state = router.get("/api/state").json()
            by_id = {w["worker"]: w for w in state["workers"]}
            return (
                by_id["w1"]["index_blocks"] == len(PREFIX) // BS
                and by_id["w3"]["evicted"]
                and all(by_id[f"w{n}"]["kv_usage"] == KV[n] for n in range(3))
                and "m-lora" in by_id["w2"]["models"]
            )

        wait_until(synced, 30, "KV events, scrapes and models to reach the router")
        router.workers = workers
        yield router
    finally:
        code, output = router.stop()
        for w in workers.values():
            w.publisher.close()
            w.stop_http()
    assert code == 0, output[-4000:]


def pick_and_finish(router, **fields) -> router_pb2.PickResponse:
    """Pick, then report it finished, so that it leaves no request in flight to weigh on the next pick."""
    response = router.router.Pick(router_pb2.PickRequest(model=fields.pop("model", "m"), **fields), timeout=20)
    assert router.router.Feedback(
        router_pb2.FeedbackRequest(request_id=response.request_id, ttft_ms=400.0, e2e_ms=900.0), timeout=20
    ).known
    return response


def test_readyz_is_ready_with_reachable_workers_and_cold_caches(live):
    assert live.ready_before_events.json() == {"ready": True, "reasons": []}
    ready = live.get("/readyz")  # and stays ready once a worker is evicted: the others are reachable
    assert ready.status_code == 200 and ready.json() == {"ready": True, "reasons": []}


def test_readyz_says_which_workers_are_not_reachable(tmp_path):
    """A worker set whose only worker answers nothing (no HTTP, no KV-event publisher) is not ready."""
    gone = [free_port() for _ in range(3)]
    worker = {"worker_id_str": "w0", "worker_id_num": 0, "model_name": "m", "zmq_endpoint": f"tcp://127.0.0.1:{gone[0]}",
              "http_url": f"http://127.0.0.1:{gone[1]}", "metrics_url": f"http://127.0.0.1:{gone[1]}/metrics"}
    config = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "metrics_poll_ms": 100, "models_refresh_secs": 1,
              "profile": [{"name": "p"}], "workerset": [{"name": "a", "profile": "p", "kv_block_size": BS}]}
    router = RouterProcess(write_config(tmp_path, config, {"a": [worker]}))
    try:
        time.sleep(1.0)
        r = router.get("/readyz")
        assert r.status_code == 503
        assert r.json()["reasons"] == ["worker set a: no worker is reachable yet (w0 has not answered /v1/models)"]
    finally:
        code, output = router.stop()
    assert code == 0, output[-4000:]


def test_the_worker_holding_the_prefix_is_picked(live):
    hit = pick_and_finish(live, token_ids=PREFIX + [1, 2, 3, 4, 5])
    assert (hit.worker_id, hit.cached_blocks, hit.prompt_blocks) == ("w1", 8, 9)
    assert hit.endpoint == f"127.0.0.1:{live.workers[1].port}"
    # a cold prompt: every prediction ties, and the least loaded KV cache (w0, 0.25) wins; w3 is evicted
    cold = pick_and_finish(live, token_ids=list(range(500, 540)))
    assert (cold.worker_id, cold.cached_blocks, cold.reason) == ("w0", 0, "load")
    assert cold.predicted_ms > hit.predicted_ms


def test_messages_are_rendered_by_a_worker(live):
    before = sum(len(w.renders) for w in live.workers.values())
    messages = [router_pb2.Message(role="user", content="hello")]
    picked = pick_and_finish(live, messages=messages)
    assert (picked.worker_id, picked.cached_blocks, picked.prompt_blocks) == ("w1", 8, 8)
    renders = [r for w in live.workers.values() for r in w.renders]
    assert len(renders) == before + 1
    assert renders[-1]["model"] == "m" and renders[-1]["messages"] == [{"role": "user", "content": "hello"}]
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
    pushed = live.router.PushBody(iter(chunks(body)), timeout=20)
    assert pushed.worker_id == "w1" and [r for w in live.workers.values() for r in w.renders][-1]["prompt"] == "hi"
    live.router.Feedback(router_pb2.FeedbackRequest(request_id=pushed.request_id, failed=True), timeout=20)


def test_an_adapter_goes_where_v1_models_lists_it(live):
    picked = pick_and_finish(live, model="m-lora", token_ids=PREFIX)
    assert (picked.worker_id, picked.reason) == ("w2", "only")
    assert picked.cached_blocks == 0  # w1's blocks are the base model's, not the adapter's
    code, details = code_of(live.router.Pick, router_pb2.PickRequest(model="nope", token_ids=[1, 2]))
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details


def test_requests_in_flight_count_until_feedback(live):
    """Without feedback a pick stays in flight on its worker until a scrape begun after it completes."""
    tokens = PREFIX + [9, 9, 9, 9]
    first = live.router.Pick(router_pb2.PickRequest(model="m", token_ids=tokens, request_id="if-1"), timeout=20)
    state = live.get("/api/state").json()
    inflight = {w["worker"]: w["inflight"] for w in state["workers"]}
    assert first.worker_id == "w1"
    assert inflight["w1"] in (0, 1)  # (1 unless a scrape of w1 completed meanwhile)
    live.router.Feedback(router_pb2.FeedbackRequest(request_id="if-1", ttft_ms=100.0), timeout=20)
    assert {w["worker"]: w["inflight"] for w in live.get("/api/state").json()["workers"]}["w1"] == 0


def test_feedback_and_metrics(live):
    pick_and_finish(live, token_ids=PREFIX, tenant="acme")
    pick_and_finish(live, token_ids=PREFIX)
    m = live.metric
    assert m("kiln_router_picks_total", workerset="a", worker="w1", reason="best", tenant="acme") >= 1
    assert m("kiln_router_picks_total", workerset="a", worker="w1", reason="best", tenant="unknown") >= 1
    assert m("kiln_router_feedback_total", outcome="ok") >= 2
    assert m("kiln_router_prediction_error_ms_count", workerset="a") >= 2
    # pick_and_finish reports ttft_ms 400 and e2e_ms 900, labelled by worker set, worker and tenant
    for tenant in ("acme", "unknown"):
        assert m("kiln_router_ttft_ms_count", workerset="a", worker="w1", tenant=tenant) >= 1
        assert m("kiln_router_e2e_ms_count", workerset="a", worker="w1", tenant=tenant) >= 1
    acme = {"workerset": "a", "worker": "w1", "tenant": "acme"}
    assert m("kiln_router_e2e_ms_sum", **acme) == 900.0 * m("kiln_router_e2e_ms_count", **acme)
    # fewer than MIN_OBSERVATIONS TTFTs so far: the calibration is counting, not applied
    assert m("kiln_router_calibration_observations_total", workerset="a") >= 2
    assert m("kiln_router_calibration_scale", workerset="a", term="queue") == 1.0
    assert m("kiln_router_calibration_scale", workerset="a", term="prefill") == 1.0
    assert m("kiln_router_calibration_offset_ms", workerset="a") == 0.0
    assert m("kiln_router_worker_kv_usage", workerset="a", worker="w0") == 0.25
    assert m("kiln_router_worker_alive", workerset="a", worker="w1") == 1
    assert m("kiln_router_worker_evicted", workerset="a", worker="w3") == 1
    assert m("kiln_router_worker_index_blocks", workerset="a", worker="w1") == 8
    assert m("kiln_router_index_blocks", workerset="a") == 8
    assert m("kiln_router_ingest_batches_total", workerset="a", worker="w1") >= 1
    assert m("kiln_router_ingest_replays_total", workerset="a", worker="w0", result="ok") is not None
    assert m("kiln_router_pick_seconds_count") >= 2
    assert not live.router.Feedback(router_pb2.FeedbackRequest(request_id="unknown-id"), timeout=20).known


def test_dashboard_and_state(live):
    page = live.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/api/state" in page.text and "<script>" in page.text
    assert not re.search(r"(src|href)=|@import|url\(", page.text)  # self-contained: no external assets
    state = live.get("/api/state").json()
    assert state["mode"] == "live" and state["ready"]
    w = {x["worker"]: x for x in state["workers"]}
    assert set(w) == {"w0", "w1", "w2", "w3"}
    assert w["w0"]["engine"] == "kiln" and w["w0"]["labels"] == {"availability_zone": "zone-0"}
    assert w["w3"]["evicted"] and "block_size 8" in w["w3"]["evicted_reason"]
    assert w["w1"]["picks"] >= 1 and w["w1"]["predicted_ms"] is not None
    assert (w["w1"]["ttft_ms"], w["w1"]["e2e_ms"]) == (400.0, 900.0)
    calibration = state["worker_sets"][0]["calibration"]
    assert not calibration["active"] and calibration["observations"] >= 1
    assert (calibration["queue_scale"], calibration["prefill_scale"], calibration["offset_ms"]) == (1.0, 1.0, 0.0)


def test_the_dashboard_draws_kv_usage_bars(live):
    from browser import runs, screenshot

    from kiln.router.dashboard import KV_BAR_PX, KV_FILL, KV_TRACK

    image = screenshot(live.admin + "/", width=1600, height=500, wait_ms=3000)
    bars = set()
    for row in image:
        for run in runs(row, {"fill": KV_FILL, "track": KV_TRACK}):
            if run["fill"] + run["track"] == KV_BAR_PX:
                bars.add(run["fill"])
    assert bars == {round(KV[n] * KV_BAR_PX) for n in range(4)}, bars  # 30, 90, 60 and 0 px of 120


def test_a_dead_worker_is_not_picked(live):
    """Stopping a worker's HTTP server kills it (its scrapes fail); with none left: UNAVAILABLE."""
    w1 = live.workers[1]
    alive = {w["worker"]: w["alive"] for w in live.get("/api/state").json()["workers"]}
    assert all(alive.values())
    try:
        w1.stop_http()
        wait_until(lambda: not _worker(live, "w1")["alive"], what="w1 to be dead")
        picked = pick_and_finish(live, token_ids=PREFIX)
        assert picked.worker_id in ("w0", "w2") and picked.cached_blocks == 0
        for n in (0, 2):
            live.workers[n].stop_http()
        wait_until(lambda: not _worker(live, "w0")["alive"] and not _worker(live, "w2")["alive"], what="all dead")
        code, details = code_of(live.router.Pick, router_pb2.PickRequest(model="m", token_ids=PREFIX))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "w0 dead" in details and "w1 dead" in details and "w3 evicted" in details
    finally:
        for n in (0, 1, 2):
            if live.workers[n].server is None:
                live.workers[n].start()  # back on the same port
    wait_until(lambda: all(_worker(live, f"w{n}")["alive"] for n in (0, 1, 2)), what="the workers to be back")
    assert pick_and_finish(live, token_ids=PREFIX).worker_id == "w1"


def _worker(router, name: str) -> dict:
    return next(w for w in router.get("/api/state").json()["workers"] if w["worker"] == name)
