"""Adapters over HTTP on the real server: load/list/unload, vLLM's endpoints, selection by
`model`, lineage, refusals, transitions under streaming traffic, API keys and maintenance."""

import threading
import time

import httpx
import numpy as np
import openai
import pytest
from peft_adapters import make_peft_adapter, reference_greedy
from server_process import ServerProcess
from tiny_models import make_hf_model

from kiln.adapters import peft_io
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
from kiln.adapters.store import AdapterStore

MODEL = "tiny-llama"
PROMPT = [7, 44, 101, 9, 250, 3]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    hf = make_hf_model("llama", vocab_size=260, seed=3)  # conftest's tiny_model in transformers
    root = tmp_path_factory.mktemp("peft")
    return {
        "sql": (root / "sql", make_peft_adapter(hf, root / "sql", rank=4, alpha=8.0, seed=11)),
        "chat": (root / "chat",
                 make_peft_adapter(hf, root / "chat", rank=8, alpha=8.0, seed=12, modules=["q_proj", "v_proj"])),
        "math": (root / "math", make_peft_adapter(hf, root / "math", rank=2, alpha=4.0, seed=13)),
        "huge": (root / "huge", make_peft_adapter(hf, root / "huge", rank=32, alpha=32.0, seed=14)),
    }


@pytest.fixture(scope="module")
def server(tiny_model, kiln_cache, tmp_path_factory):
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                        KILN_ADAPTERS_STORE=str(tmp_path_factory.mktemp("store")), KILN_ADAPTERS_MAX_LORAS="2")
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(client, model, n=8, prompt=PROMPT):
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": False})


def test_load_select_list_unload_and_reload_from_the_store(server, client, adapters, tiny_model):
    # the start left its LoRA steps (2 decode and 2 prefill buckets) for the first adapter load, and
    # ran the 1-row decode step and the prefill steps of up to 64 tokens (16 and 64) once before ready
    startup = httpx.get(server.url + "/v1/config").json()["step_set"]["startup"]
    assert startup["deferred"] == 4 and startup["primed"] == 3
    r = httpx.post(server.url + "/v1/adapters", json={"name": "sql", "path": str(adapters["sql"][0])},
                   timeout=600)  # builds the LoRA steps first
    assert r.status_code == 200, r.text
    loaded = r.json()
    assert loaded["name"] == "sql" and loaded["rank"] == 4 and loaded["manifest_digest"].startswith("sha256:")
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql"].model_extra["parent"] == MODEL
    assert cards["sql"].model_extra["root"] == f"peft:{adapters['sql'][0]}"
    assert cards[MODEL].model_extra["parent"] is None

    out = greedy(client, "sql")
    expected = tiny_model.tokenizer.decode(reference_greedy(adapters["sql"][1], PROMPT, 8))
    assert out.model == "sql" and out.choices[0].text == expected
    lineage = out.model_extra["kiln"]["lineage"]
    assert lineage["adapter"] == "sql" and lineage["adapter_manifest_digest"] == loaded["manifest_digest"]
    assert greedy(client, MODEL).choices[0].text != expected  # the base model answers differently
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          stream=True, stream_options={"include_usage": True})
    chunks = list(chat)
    assert chunks[-1].model == "sql" and chunks[-1].model_extra["kiln"]["lineage"]["adapter"] == "sql"

    metrics = httpx.get(server.url + "/metrics").text
    assert f'kiln:step_compile_waits_total{{model_name="{MODEL}"}} 0.0' in metrics  # built before the load returned
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    assert f'kiln:lora_slots_used{{model_name="{MODEL}"}} 1.0' in metrics
    assert "kiln:writer_operations_total" in metrics
    listed = httpx.get(server.url + "/v1/adapters").json()
    assert [(a["name"], a["loaded"]) for a in listed["data"]] == [("sql", True)] and listed["max_loras"] == 2
    r = httpx.delete(server.url + "/v1/adapters/sql")
    assert r.status_code == 200 and r.json()["unloaded"] is True
    with pytest.raises(openai.NotFoundError) as err:  # unloaded here: not served by name until loaded again
        greedy(client, "sql")
    assert err.value.body["code"] == "model_not_found"
    # the import left a Kiln artifact in the store: load it back by name
    assert [(a["name"], a["loaded"]) for a in httpx.get(server.url + "/v1/adapters").json()["data"]] == [("sql", False)]
    again = httpx.post(server.url + "/v1/adapters", json={"name": "sql"}, timeout=60).json()
    assert again["manifest_digest"] == loaded["manifest_digest"] and again["source"] == "store"
    assert greedy(client, "sql").choices[0].text == expected
    assert httpx.delete(server.url + "/v1/adapters/sql").status_code == 200


def test_vllm_load_and_unload_endpoints(server, client, adapters):
    url = server.url + "/v1/"
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"][0])}
    r = httpx.post(url + "load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    r = httpx.post(url + "load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    first = greedy(client, "chat").choices[0].text
    replace = {**body, "lora_path": str(adapters["math"][0]), "load_inplace": True}
    r = httpx.post(url + "load_lora_adapter", json=replace, timeout=60)
    assert r.status_code == 200
    assert greedy(client, "chat").choices[0].text != first  # replaced in place
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully."
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"


@pytest.mark.parametrize(
    "method,path,body,status,code",
    [
        ("post", "/v1/adapters", {"name": "../etc", "path": "/tmp"}, 400, "invalid_adapter_name"),
        ("post", "/v1/adapters", {"name": "a/b"}, 400, "invalid_adapter_name"),
        ("post", "/v1/load_lora_adapter", {"lora_name": "..", "lora_path": "/tmp"}, 400, "invalid_adapter_name"),
        ("post", "/v1/adapters", {"name": MODEL, "path": "/tmp"}, 400, "invalid_adapter_name"),
        ("post", "/v1/adapters", {"name": "ghost"}, 404, "adapter_not_found"),
        ("post", "/v1/adapters", {"name": "ghost", "path": "/nonexistent/adapter"}, 404, "adapter_not_found"),
        ("post", "/v1/adapters", {"name": "notadapter", "path": "/tmp"}, 400, "invalid_adapter"),
        ("post", "/v1/adapters", {"path": "/tmp"}, 400, None),
        ("post", "/v1/adapters", {"name": 3}, 400, None),
        ("delete", "/v1/adapters/ghost", None, 404, "adapter_not_found"),
    ],
)
def test_adapter_refusals(server, client, method, path, body, status, code):
    r = httpx.request(method.upper(), server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and "Traceback" not in error["message"]
    assert greedy(client, MODEL, n=2).choices[0].finish_reason == "length"  # the server is unharmed


def test_a_second_load_of_a_loaded_name_is_refused(server, adapters):
    body = {"name": "twice", "path": str(adapters["math"][0])}
    assert httpx.post(server.url + "/v1/adapters", json=body, timeout=60).status_code == 200
    r = httpx.post(server.url + "/v1/adapters", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_already_loaded"
    assert httpx.delete(server.url + "/v1/adapters/twice", timeout=60).status_code == 200


def test_rank_above_the_slots_is_refused(server, adapters):
    r = httpx.post(server.url + "/v1/adapters", json={"name": "huge", "path": str(adapters["huge"][0])}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_rank_too_large"
    assert "huge" not in [a["name"] for a in httpx.get(server.url + "/v1/adapters").json()["data"]]


def test_transitions_during_streaming_traffic_drop_no_request(server, client, adapters):
    url = server.url + "/v1/"
    r = httpx.post(url + "adapters", json={"name": "sql", "path": str(adapters["sql"][0])}, timeout=60)
    assert r.status_code == 200
    errors, done = [], []
    stop = threading.Event()

    def traffic(model):
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        while not stop.is_set():
            try:
                stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                chunks = list(stream)
                finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
                assert finish == ["length"] and chunks[-1].usage.completion_tokens == 20
                done.append(model)
            except Exception as exc:  # noqa: BLE001 - every failure is a dropped request
                errors.append(f"{model}: {exc!r}")

    def progress(k=2):  # let k more streams finish, so traffic spans every transition
        target, deadline = len(done) + k, time.monotonic() + 120
        while len(done) < target and not errors and time.monotonic() < deadline:
            time.sleep(0.01)

    threads = [threading.Thread(target=traffic, args=(m,)) for m in (MODEL, "sql", MODEL, "sql")]
    for t in threads:
        t.start()
    progress()
    # loads, a replacement and an unload while streams run; three adapters over two slots
    for call in (("adapters", {"name": "math", "path": str(adapters["math"][0])}),
                 ("adapters", {"name": "chat", "path": str(adapters["chat"][0])}),
                 ("adapters", {"name": "sql", "path": str(adapters["math"][0]), "replace": True}),
                 ("unload_lora_adapter", {"lora_name": "chat"})):
        r = httpx.post(url + call[0], json=call[1], timeout=120)
        assert r.status_code == 200, r.text
        progress()
    stop.set()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    assert done.count("sql") >= 4 and done.count(MODEL) >= 4
    for name in ("sql", "math"):
        assert httpx.delete(url + f"adapters/{name}").status_code == 200


@pytest.fixture(scope="module")
def locked_server(tiny_model, kiln_cache, tmp_path_factory, adapters):
    """Maintenance profile with API keys and an adapter preloaded from the store at startup."""
    store = tmp_path_factory.mktemp("store2")
    weights, info = peft_io.read_peft(adapters["math"][0], tiny_model.config)
    AdapterStore(store).save(Manifest(name="math", base_model=BaseModelRef(MODEL, tiny_model.weights_digest),
                                      rank=info["rank"], alpha=info["alpha"], target_modules=info["target_modules"],
                                      weights_digest="", provenance=provenance("test")), weights)
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                        KILN_ADAPTERS_STORE=str(store), KILN_SERVER_API_KEYS="s3cret",
                        KILN_SERVER_SERVING_PROFILE="maintenance", KILN_ADAPTERS_LOAD="math")
    yield srv
    srv.stop_cleanly()


def test_maintenance_runs_adapter_transitions_and_keys_guard_them(locked_server, adapters):
    url, auth = locked_server.url + "/v1/", {"Authorization": "Bearer s3cret"}
    assert httpx.get(url + "adapters").status_code == 401
    r = httpx.post(url + "adapters", json={"name": "sql", "path": str(adapters["sql"][0])}, timeout=60)
    assert r.status_code == 401
    assert httpx.post(url + "unload_lora_adapter", json={"lora_name": "math"}).status_code == 401
    listed = httpx.get(url + "adapters", headers=auth).json()["data"]
    assert [(a["name"], a["loaded"], a["slot"]) for a in listed] == [("math", True, 1)]  # preloaded
    r = httpx.post(url + "adapters", json={"name": "sql", "path": str(adapters["sql"][0])}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text  # writers run while inference is off
    assert httpx.delete(url + "adapters/math", headers=auth).status_code == 200
    r = httpx.post(url + "completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}, headers=auth)
    assert r.status_code == 503 and r.json()["error"]["code"] == "inference_disabled_by_profile"
    assert np.isfinite(len(httpx.get(url + "models", headers=auth).json()["data"]))


def test_the_console_needs_a_key_and_says_why_inference_is_off(locked_server):
    base, auth = locked_server.url, {"Authorization": "Bearer s3cret"}
    for route in ("overview", "jobs", "adapters", "evals"):
        r = httpx.get(f"{base}/console/api/{route}", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", route
    assert httpx.get(f"{base}/console/api/overview", headers={"Authorization": "Bearer nope"}).status_code == 401
    page = httpx.get(f"{base}/console")
    assert page.status_code == 401 and "/console?key=" in page.text  # the page says how to open it
    assert httpx.get(f"{base}/console?key=nope").status_code == 401

    # ?key= trades the key for a cookie and drops it from the address; the cookie opens the data routes
    with httpx.Client(base_url=base, timeout=30) as browser:
        r = browser.get("/console", params={"key": "s3cret", "job": "ftjob-x"})
        assert r.status_code == 303 and r.headers["location"] == "/console?job=ftjob-x"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "s3cret" not in cookie
        assert browser.get("/console").status_code == 200
        overview = browser.get("/console/api/overview").json()
    assert overview == {**overview, "status": "maintenance", "serving_profile": "maintenance"}
    assert overview["inference"]["on"] is False and "maintenance" in overview["inference"]["reason"]
    loaded = {a["name"] for a in httpx.get(f"{base}/v1/adapters", headers=auth, timeout=30).json()["data"]
              if a["loaded"]}
    adapters = httpx.get(f"{base}/console/api/adapters", headers=auth, timeout=30).json()["data"]
    assert loaded and {a["name"] for a in adapters if a["state"] == "live"} == loaded


def test_the_console_page_works_in_a_browser_under_maintenance(locked_server):
    from browser import elements, page_dom

    loaded = [a["name"] for a in httpx.get(f"{locked_server.url}/v1/adapters", timeout=30,
                                           headers={"Authorization": "Bearer s3cret"}).json()["data"] if a["loaded"]]
    html = page_dom(f"{locked_server.url}/console?key=s3cret")
    [banner] = elements(html, id="banner")
    assert "hidden" not in banner and "maintenance" in html.split('id="banner"')[1].split("</div>")[0]
    assert loaded and all(elements(html, data_name=name, data_state="live") for name in loaded)
