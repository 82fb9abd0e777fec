"""A real server whose steps run the Pallas paged-attention kernel (`[engine] attention = "pallas"`,
in Pallas's interpret mode on the CPU) or Kiln's CPU kernel (`auto` on a CPU, where a C++ compiler
builds it) serves the greedy tokens and logprobs of XLA's attention, on one device and over a
tensor-parallel mesh, and says which kernel it runs in /v1/config."""

import asyncio

import httpx
import pytest
from server_process import FEW_PROMPT_BUCKETS, FOUR_DEVICES, ServerProcess
from tiny_models import served_hf_dir

from kiln.kernels import cpu as kernels

COMPILER = kernels.compiler() is not None
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64], list(range(20, 58)), [200, 100, 50, 25, 12, 6]]


def served(model_dir, kiln_cache, attention: str, **env) -> tuple[str, list]:
    server = ServerProcess(str(model_dir), str(kiln_cache), KILN_ENGINE_ATTENTION=attention, **env,
                           **FEW_PROMPT_BUCKETS, KILN_ENGINE_NUM_KV_BLOCKS="64",
                           KILN_ENGINE_MAX_NUM_BATCHED_TOKENS="64")
    try:
        kernel = httpx.get(server.url + "/v1/config", timeout=30).json()["backend"]["attention"]
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]

        async def one(client, prompt):
            r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            return lp["tokens"], lp["token_logprobs"]

        async def every():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                return await asyncio.gather(*(one(client, p) for p in PROMPTS))

        results = asyncio.run(every())
    finally:
        server.stop_cleanly()
    return kernel, results


@pytest.mark.parametrize("variant", ["gemma2", "gpt-oss"])
def test_the_kernel_serves_what_xla_attention_serves(tmp_path_factory, kiln_cache, tiny_model, variant):
    """Gemma 2's soft-capped scores and every other layer windowed (24 tokens, which the longest prompt
    passes); gpt-oss's sinks and windows. (Llama: the mesh test below, on one device too.)"""
    model_dir = served_hf_dir(variant, tmp_path_factory.mktemp(f"attention-{variant}"), kiln_cache, seed=21)
    kernel, xla = served(model_dir, kiln_cache, "xla")
    assert kernel == "xla"
    for setting, expected in (("pallas", "pallas"), ("auto", "cpu" if COMPILER else "xla")):
        kernel, served_tokens = served(model_dir, kiln_cache, setting)
        assert kernel == expected  # auto, on a CPU: Kiln's CPU kernel
        for (tokens, logprobs), (xla_tokens, xla_logprobs) in zip(served_tokens, xla, strict=True):
            assert tokens == xla_tokens
            assert max(abs(a - b) for a, b in zip(logprobs, xla_logprobs, strict=True)) < 1e-4


def test_the_kernel_runs_per_device_on_a_tensor_parallel_mesh(tmp_path_factory, kiln_cache, tiny_model):
    """Llama on one device; on tp = 2 each device runs the kernel on its one KV head of two; on tp = 4,
    where the heads do not divide, every device runs both: the tokens and logprobs of one device's XLA
    attention in every case."""
    model_dir = served_hf_dir("llama", tmp_path_factory.mktemp("attention-tp"), kiln_cache, seed=21)
    kernel, reference = served(model_dir, kiln_cache, "xla")
    assert kernel == "xla"
    for tp in ("1", "2", "4"):
        mesh = {} if tp == "1" else {"KILN_ENGINE_TENSOR_PARALLEL": tp, "XLA_FLAGS": FOUR_DEVICES}
        kernel, results = served(model_dir, kiln_cache, "pallas", **mesh)
        assert kernel == "pallas"
        for (tokens, logprobs), (xla_tokens, xla_logprobs) in zip(results, reference, strict=True):
            assert tokens == xla_tokens
            assert max(abs(a - b) for a, b in zip(logprobs, xla_logprobs, strict=True)) < 1e-4
