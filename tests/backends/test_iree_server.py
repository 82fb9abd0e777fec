"""`python -m kiln.server` on the Vulkan route: the same OpenAI API, greedy completions equal to the
XLA route's, the route and its reason in /health and /v1/config, prefix hits quarantined on
Vulkan, and a route that cannot run here stopping startup with a clear message."""

import os
import subprocess
import sys

import httpx
import pytest
from server_process import ServerProcess, free_port
from test_iree_route import VULKAN

pytest.importorskip("iree.runtime")

MODEL = "tiny"
PROMPTS = ["hello there", "The quick brown fox", "abcabcabc"]


def serve(model, kiln_cache, route: str) -> ServerProcess:
    return ServerProcess(model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                         KILN_BACKEND_ROUTE=route, KILN_ENGINE_DECODE_ROW_BUCKETS="1,4",
                         KILN_ENGINE_PREFILL_TOKEN_BUCKETS="32", KILN_ENGINE_MAX_NUM_BATCHED_TOKENS="32",
                         KILN_ENGINE_MAX_NUM_SEQS="4", KILN_ENGINE_NUM_KV_BLOCKS="32")


def completions(url: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


@pytest.fixture(scope="module")
def xla_texts(expressive_model, kiln_cache):
    # the expressive tiny llama: its logits are far apart, so that greedy tokens are equal across
    # backends whose float rounding differs (the default init's logits are nearly tied)
    srv = serve(expressive_model, kiln_cache, "xla")
    try:
        yield completions(srv.url)
    finally:
        srv.stop()


@VULKAN
def test_server_on_vulkan_route(expressive_model, kiln_cache, xla_texts):
    """(The iree-cpu route shares all of this but the quarantine; its parity is tested on the engine.)"""
    route = "vulkan"
    srv = serve(expressive_model, kiln_cache, route)
    try:
        assert completions(srv.url) == xla_texts
        health = httpx.get(srv.url + "/health", timeout=30).json()
        assert health["backend_runtime"]["route"] == route
        assert health["backend_runtime"]["route_reason"] == "requested"
        config = httpx.get(srv.url + "/v1/config", timeout=30).json()
        backend = config["backend"]
        assert config["kv_pool"]["resident_bytes"] is None  # the pool is the Vulkan device's
        assert backend["route"] == route and backend["capabilities"]["route"] == route
        assert set(backend["gates"]) == {"sort", "top_k"}
        assert backend["resident_prefill"] is False  # experimental only
        # the same prompts again: still no prefix hit on Vulkan (quarantine: fresh prefill)
        completions(srv.url)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
        assert (float(hits[0].split()[-1]) if hits else 0.0) == 0, hits
    finally:
        srv.stop()


def test_unavailable_route_stops_startup(tiny_model, kiln_cache, tmp_path):
    nowhere = str(tmp_path / "none.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(JAX_PLATFORMS="cpu", KILN_MODEL_PATH=tiny_model.source, KILN_CACHE_DIR=str(kiln_cache),
               KILN_BACKEND_ROUTE="vulkan", VK_ICD_FILENAMES=nowhere, VK_DRIVER_FILES=nowhere,
               KILN_SERVER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-m", "kiln.server"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "kiln: error: backend: route vulkan" in out.stderr, out.stderr[-3000:]
    assert "mesa-vulkan-drivers" in out.stderr
    assert "Traceback" not in out.stderr
