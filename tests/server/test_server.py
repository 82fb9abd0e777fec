"""The real server on loopback, driven by the official openai client and httpx."""

import asyncio
import shutil
import threading
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

from kiln.kernels import cpu as kernels

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the session's shared tiny-model server (served as MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


CHAT = [{"role": "user", "content": "hello there"}]


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    kiln = r.model_extra["kiln"]
    assert kiln["lineage"]["model"] == MODEL and len(kiln["lineage"]["weights_digest"]) == 64
    assert kiln["lineage"]["serving_profile"] == "stable" and kiln["latency"][0]["ttft_s"] is not None


def test_streaming_with_usage_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].model_extra["kiln"]["lineage"]["model"] == MODEL
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_logprobs_and_seed(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, n=3, seed=42, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    lp = a.choices[0].logprobs.content
    assert len(lp) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
    assert a.usage.completion_tokens == 18


def test_completions_echo_logprobs_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("abc")
    assert lp.token_logprobs[0] is None and len(lp.tokens) == 3 + 5
    full = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


@pytest.mark.parametrize(
    "call,status,param",
    [
        (lambda c: c.chat.completions.create(model="nope", messages=CHAT), 404, "model"),
        (lambda c: c.completions.create(model=MODEL, prompt="x", suffix="y"), 400, "suffix"),
        (lambda c: c.completions.create(model=MODEL, prompt="x", max_tokens=100000), 400, "max_tokens"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1), 400, "temperature"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={"999999": 1}), 400, "logit_bias"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=[]), 400, "messages"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21), 400,
         "top_logprobs"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
         400, "messages[0].content[1].type"),
        (lambda c: c.completions.create(model=MODEL, prompt=[]), 400, "prompt"),
    ],
)
def test_openai_errors(client, call, status, param):
    with pytest.raises(openai.APIStatusError) as e:
        call(client)
    assert e.value.status_code == status
    body = e.value.response.json()["error"]
    assert set(body) == {"message", "type", "code", "param"} and body["param"] == param


def test_malformed_bodies_get_openai_errors(server):
    for body in (b"{not json", b'{"messages": 5}', b'{"messages": [{"role": 1}]}', b"[]"):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and "Traceback" not in r.text
        assert set(r.json()["error"]) == {"message", "type", "code", "param"}
    for method, path, status, type_, code in (
            ("GET", "/v1/nothing-here", 404, "not_found_error", "route_not_found"),
            ("POST", "/v1/images/generations", 404, "not_found_error", "route_not_found"),
            ("GET", "/v1/chat/completions", 405, "invalid_request_error", "method_not_allowed")):
        r = httpx.request(method, server.url + path, json={})
        assert r.status_code == status
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": type_, "code": code,
                                     "param": None}
        assert path in r.json()["error"]["message"]


def test_a_prompt_too_long_names_the_prompt_and_bad_temperature_says_what_kiln_takes(server):
    long = "word " * 400  # the tiny model holds 256 positions
    for path, body, param in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
            ("/v1/completions", {"prompt": long}, "prompt"),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1000}, "max_tokens")):
        r = httpx.post(server.url + path, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert "from 0 (greedy) to 100" in r.json()["error"]["message"] and "0 to 2" in r.json()["error"]["message"]


def test_bad_requests_do_not_disturb_a_running_stream(client, server):
    result = {}

    def good():
        chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}))
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    t = threading.Thread(target=good)
    t.start()
    for _ in range(10):
        httpx.post(server.url + "/v1/completions", content=b'{"prompt": {"bad": 1}}',
                   headers={"content-type": "application/json"})
    t.join(60)
    assert result["finish"] == "length"


def aborted_requests(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    line = f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_client_disconnect_aborts_the_request(server):
    before = aborted_requests(server.url)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "stream": True, "ignore_eos": True}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # hang up after the first chunk
        for _ in range(100):
            m = httpx.get(server.url + "/metrics").text
            if f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in m:
                return True
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(main())
    assert f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0' in httpx.get(server.url + "/metrics").text
    assert aborted_requests(server.url) - before == 1  # cut short, not generated to its 200 tokens


def test_a_client_that_leaves_a_whole_completion_aborts_it(server):
    """Not streamed: the request is aborted when its client hangs up, not generated to its end."""
    before = aborted_requests(server.url)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 220, "n": 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    for _ in range(100):
        if aborted_requests(server.url) - before == 8:  # every choice, within moments of the hang-up
            break
        time.sleep(0.05)
    assert aborted_requests(server.url) - before == 8
    # the same request, waited for, takes longer than the hang-up: it was cut short, not finished
    started = time.monotonic()
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert time.monotonic() - started > 0.1


def test_a_top_k_past_the_vocabulary_keeps_every_token(server):
    """top_k >= the vocabulary filters nothing (however large: it once overflowed the step's int32)."""
    def text(top_k: int) -> str:
        body = {"model": MODEL, "prompt": "once upon", "max_tokens": 6, "temperature": 1.0, "seed": 5, "top_k": top_k}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(911586567261244) == text(100_000) == text(0)


def test_models_tokenize_render_detokenize(server, client):
    models = client.models.list().data  # the base model, then what the (session's shared) store holds, not loaded
    assert models[0].id == MODEL and models[0].model_extra["loaded"] is True
    assert all(m.model_extra["loaded"] is False and m.model_extra["parent"] == MODEL for m in models[1:])
    body = {"model": MODEL, "messages": CHAT}
    rendered = httpx.post(server.url + "/render", json=body).json()
    tokenized = httpx.post(server.url + "/tokenize", json=body).json()
    assert rendered["prompt_token_ids"] == tokenized["tokens"]
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert usage.prompt_tokens == rendered["count"]
    detokenized = httpx.post(server.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detokenized["prompt"].startswith("<|im_start|>user")
    assert httpx.post(server.url + "/render", json={"prompt": [1, 2, 3]}).json()["prompt_token_ids"] == [1, 2, 3]


def test_metrics_and_openapi(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_prefill_time_seconds_sum", "kiln:num_requests_running"):
        assert f"{name}{{" in text and f'model_name="{MODEL}"' in text, name
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/render"} <= set(schema["paths"])


def test_health_and_config(server):
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["backend_runtime"]["healthy"] is True
    cfg = httpx.get(server.url + "/v1/config").json()
    assert cfg["serving_profile"]["profile"] == "stable"
    assert cfg["settings"]["model"]["served_model_name"] == {"value": MODEL, "source": "environment"}
    assert cfg["model"]["quantization"] == {"value": "none",
                                            "source": "auto: the GGUF file's layers are F32, held as float"}
    pool = cfg["kv_pool"]  # the suite's servers name a block count
    assert (pool["blocks"], pool["blocks_now"], pool["reason"]) == (128, 128, "[engine] num_kv_blocks")
    assert pool["dtype"] == "float32" and cfg["settings"]["engine"]["kv_cache_dtype"]["value"] == "auto"
    assert pool["bytes"] == 128 * pool["block_bytes"] and 0 < pool["resident_bytes"] <= pool["bytes"]
    # float weights: Kiln's CPU kernels serve the decode steps' attention (where a C++ compiler built them)
    compiler = kernels.compiler() is not None
    assert cfg["backend"]["cpu_kernels"] is compiler
    assert cfg["backend"]["attention"] == ("cpu" if compiler else "xla")


def test_sigterm_drains_in_flight_requests(tiny_model, kiln_cache):
    srv = ServerProcess(tiny_model.source, str(kiln_cache))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT,
                                            max_tokens=150, temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    rest = list(stream)
    stopper.join(60)
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert srv.proc.returncode == 0


def test_api_keys_body_cap_and_queue_limit(tiny_model, kiln_cache):
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_SERVER_API_KEYS="k1,k2",
                        KILN_SERVER_MAX_REQUEST_BODY_BYTES="2000", KILN_SERVER_MAX_WAITING_REQUESTS="1",
                        KILN_ENGINE_MAX_NUM_SEQS="1")
    try:
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200
        auth = {"Authorization": "Bearer k1"}
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["error"] == {
            "message": r.json()["error"]["message"], "type": "invalid_request_error", "code": "payload_too_large",
            "param": None}
        assert "max_request_body_bytes" in r.json()["error"]["message"]

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, headers=auth, timeout=120) as c:
                body = {"messages": CHAT, "max_tokens": 60, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(6)))

        codes = [r.status_code for r in asyncio.run(burst())]
        assert 200 in codes and 429 in codes, codes
        rejected = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert rejected.json()["error"]["code"] == "queue_full"
    finally:
        srv.stop()


ENDPOINTS = {
    "health": ("GET", "/health", None),
    "health_v1": ("GET", "/v1/health", None),
    "config": ("GET", "/v1/config", None),
    "models": ("GET", "/v1/models", None),
    "chat": ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    "completion": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "prompt_logprobs": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": 1}),
    "responses": ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    "agent_run": ("POST", "/v1/responses", {
        "input": "hi", "max_output_tokens": 8, "max_tool_calls": 0, "tool_choice": "required",
        "tools": [{"type": "kiln_python", "name": "f", "source": "def f():\n    return 1\n"}]}),
    "tokenize": ("POST", "/tokenize", {"prompt": "hi"}),
    "render": ("POST", "/render", {"messages": CHAT}),
}
EXPECTED = {
    "stable": {name: 200 for name in ENDPOINTS},
    "experimental": {name: 200 for name in ENDPOINTS},
    "maintenance": {**{name: 200 for name in ENDPOINTS}, "health": 503, "health_v1": 503, "chat": 503,
                    "completion": 503, "prompt_logprobs": 503, "responses": 503,
                    "agent_run": 503},
}


@pytest.mark.parametrize("profile", ["stable", "experimental", "maintenance"])
def test_profile_endpoint_matrix(tiny_model, kiln_cache, profile):
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_SERVER_SERVING_PROFILE=f"  {profile.upper()} ")
    try:
        for name, (method, path, body) in ENDPOINTS.items():
            r = httpx.request(method, srv.url + path, json=body, timeout=60)
            assert r.status_code == EXPECTED[profile][name], (profile, name, r.text)
            data = r.json()
            if name in ("health", "health_v1", "config"):
                sp = data["serving_profile"]
                assert sp["profile"] == profile and sp["source"] == "environment"
                assert sp["effective_policy"]["inference_admission"] == (profile != "maintenance")
                assert sp["effective_policy"]["live_graph_capture"] == (profile != "maintenance")
                assert sp["effective_policy"]["vulkan_resident_prefill"] == (profile == "experimental")
            if name.startswith("health"):
                assert data["status"] == ("maintenance" if profile == "maintenance" else "ok")
                assert data["backend_runtime"]["healthy"] is True
                assert data["checks"]["inference_admission"] == (profile != "maintenance")
            if EXPECTED[profile][name] == 503 and not name.startswith("health"):
                assert data["error"]["code"] == "inference_disabled_by_profile"
    finally:
        code, out = srv.stop()
    assert code == 0
    assert ("prewarm skipped" in out) == (profile == "maintenance")
    assert f"serving profile: {profile}" in out.lower() or profile in out


def test_schemathesis_finds_no_server_errors(server):
    import subprocess
    import sys

    exe = shutil.which("schemathesis") or shutil.which("st")
    cmd = [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]
    proc = subprocess.run([*cmd, "run", server.url + "/schema/openapi.json", "--checks", "not_a_server_error",
                           "--max-examples", "15", "--url", server.url,
                           "--request-timeout", "300"],  # a fuzzed body may ask for n=128 long completions
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    import re

    total = re.search(r"Selected: (\d+)/(\d+)", proc.stdout)
    assert total and f"Tested: {total.group(2)}" in proc.stdout, proc.stdout[-3000:]  # every operation exercised
    m = re.search(r"(\d+) generated, (\d+) passed", proc.stdout)
    assert m and int(m.group(1)) > 100 and m.group(1) == m.group(2), proc.stdout[-3000:]
