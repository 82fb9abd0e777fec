"""The IREE routes (llvm-cpu, and Vulkan on Mesa's lavapipe where installed) against the XLA route
on the tiny model: same greedy tokens, same sampled tokens for a seed, KV resident on the device,
prefix-reuse quarantine on Vulkan, module cache, and route selection from capabilities."""

import asyncio
import gc
import os
import random
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("iree.runtime")

from kiln.engine.backends import select_backend  # noqa: E402
from kiln.engine.client import AsyncEngine  # noqa: E402
from kiln.engine.config import EngineConfig  # noqa: E402
from kiln.engine.params import SamplingParams  # noqa: E402
from kiln.errors import BackendUnavailable, ConfigError  # noqa: E402
from kiln.iree.device import probe, with_buffer_limit  # noqa: E402

# the engine settings of the IREE server and qualify tests too: they share compiled modules
SMALL = dict(num_kv_blocks=32, block_size=16, decode_row_buckets=(1, 4), prefill_token_buckets=(32,),
             max_num_seqs=4, max_num_batched_tokens=32)


def vulkan_available() -> bool:
    try:
        probe("vulkan")  # without opening the device: an open lavapipe device keeps two threads polling
        return True
    except BackendUnavailable:
        return False


VULKAN = pytest.mark.skipif(not vulkan_available(), reason="no Vulkan driver (apt-get install mesa-vulkan-drivers)")
ROUTES = ["iree-cpu", pytest.param("vulkan", marks=VULKAN)]


def run(eng, prompts, params, adapter=None):
    async def one(p):
        ids = []
        async for d in eng.generate(f"r-{random.random()}", p, params, adapter=adapter):
            ids += d.token_ids
        return ids

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def xla_engine(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(**SMALL))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def iree_cache(kiln_cache):
    """Compiled IREE modules shared by the tests (and the servers, which cache under kiln_cache)."""
    return kiln_cache / "iree"


@pytest.fixture(scope="module", autouse=True)
def close_devices():
    """Collects the module's routes when it ends: an open device holds its memory (lavapipe's is the
    host's) and, on lavapipe, two polling threads, and the engines' reference cycles wait for a collection."""
    yield
    gc.collect()


@pytest.fixture(scope="module", params=ROUTES)
def iree_engine(request, tiny_model, iree_cache):
    route = select_backend(request.param, iree_cache)
    eng = AsyncEngine(tiny_model, EngineConfig(**SMALL), backend=route)
    yield eng
    eng.shutdown()
    del eng, route
    gc.collect()


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 101, 102]]


def test_greedy_tokens_equal_xla(xla_engine, iree_engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert run(iree_engine, PROMPTS, params) == run(xla_engine, PROMPTS, params)


def test_seeded_sampling_equal_xla(xla_engine, iree_engine):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    assert run(iree_engine, PROMPTS[:2], params) == run(xla_engine, PROMPTS[:2], params)


def test_an_adapter_serves_on_the_route_as_on_xla(tiny_model, xla_engine, iree_engine):
    """A LoRA adapter in a slot: rows with and without it share steps, and every row's greedy tokens
    equal XLA's (the adapter changes them, so its weights are applied on the device)."""
    from kiln.engine.lora_slots import AdapterWeights
    from kiln.models.lora import TARGET_MODULES, module_shapes

    if iree_engine._core.backend.name == "vulkan":  # it passes there too, in 100+ s of lavapipe compiles
        pytest.skip("LoRA buckets on lavapipe are left out of the suite for time")
    cfg, rng = tiny_model.config, np.random.default_rng(5)
    weights = {m: {"a": (0.3 * rng.standard_normal((cfg.num_layers, i, 8))).astype(np.float32),
                   "b": (0.3 * rng.standard_normal((cfg.num_layers, 8, o))).astype(np.float32)}
               for m, (i, o) in module_shapes(cfg).items() if m in TARGET_MODULES}
    adapter = AdapterWeights("random", "v1", weights, 2.0, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def both(eng):
        async def main():
            return await asyncio.gather(asyncio.to_thread(run, eng, PROMPTS[:2], params, adapter),
                                        asyncio.to_thread(run, eng, PROMPTS[2:], params))
        return asyncio.run(main())

    with_adapter, plain = both(iree_engine)
    assert (with_adapter, plain) == tuple(both(xla_engine))
    assert with_adapter != run(xla_engine, PROMPTS[:2], params)


def test_kv_stays_on_device(iree_engine):
    route = iree_engine._core.backend
    run(iree_engine, [PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    up, down = route.bytes_moved()
    run(iree_engine, [PROMPTS[0]], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    up2, down2 = route.bytes_moved()
    kv_bytes = sum(np.prod(x.shape) * 4 for x in iree_engine._core.runner.kv)
    per_step = (up2 - up + down2 - down) / 8  # the second run has about 8 more steps
    assert per_step < kv_bytes / 10, (per_step, kv_bytes)
    assert isinstance(iree_engine._core.runner.kv.k, route.device.rt.DeviceArray)


def test_vulkan_quarantines_prefix_reuse(iree_engine):
    core = iree_engine._core
    assert core.pool.enable_caching == (core.backend.name != "vulkan")


@VULKAN
def test_vulkan_probe_reads_the_largest_buffer_and_the_pool_fits_it(tiny_model):
    """IREE's device dump has no buffer limits; an opened route reads maxStorageBufferRange from the
    Vulkan loader (lavapipe: 128 MiB, the spec's least), and an auto pool keeps K and V within it."""
    import dataclasses

    from kiln.engine.kv_pool import DeviceHeap, block_bytes, size_pool

    caps = with_buffer_limit(probe("vulkan"))  # as the route holds them once opened
    assert 0 < caps.max_buffer_bytes <= caps.memory_bytes
    if caps.name.startswith("llvmpipe"):
        assert caps.max_buffer_bytes == 128 << 20
    cfg = tiny_model.config
    per_array = block_bytes(cfg, 16, "float32") // 2
    heap = DeviceHeap(caps.memory_bytes, 0, max_buffer=64 * per_array)  # a small limit for the tiny model
    config = dataclasses.replace(EngineConfig(**SMALL), num_kv_blocks=0, kv_cache_memory="auto", max_num_seqs=64)
    pool = size_pool(cfg, config, "float32", max_len=cfg.max_position_embeddings, on_host=True, heap=heap)
    assert pool.blocks * per_array <= heap.max_buffer and "binds at most" in pool.reason
    with pytest.raises(ConfigError, match="num_kv_blocks"):  # a count beyond the buffer is refused at start
        size_pool(cfg, dataclasses.replace(config, num_kv_blocks=65), "float32", max_len=256, on_host=True, heap=heap)


def test_marketing_name_changes_nothing(tmp_path):
    base = {"route": "vulkan", "device_type": "cpu", "dtypes": ["f32", "f16", "i8"], "subgroup_size": 8,
            "memory_bytes": 1 << 31, "max_buffer_bytes": 1 << 31, "name": "llvmpipe", "vendor_id": "0x10005",
            "driver": "Mesa"}
    famous = {**base, "name": "NVIDIA GeForce RTX 9090 Ti", "vendor_id": "0x10de", "driver": "NVIDIA 999.1"}
    a = select_backend("auto", tmp_path, capabilities=base).choice
    b = select_backend("auto", tmp_path, capabilities=famous).choice
    assert (a.route, a.reason) == (b.route, b.reason) == ("xla", a.reason)
    assert "type cpu" in a.reason


def test_modules_are_cached_on_disk(tiny_model, tmp_path):
    """A second engine on the same cache directory compiles nothing: every bucket is a cache hit."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    counts = []
    for _ in range(2):
        route = select_backend("iree-cpu", tmp_path)
        small = {**SMALL, "decode_row_buckets": (1,), "prefill_token_buckets": (16,), "max_num_batched_tokens": 16}
        eng = AsyncEngine(tiny_model, EngineConfig(**small), backend=route)
        try:
            run(eng, [PROMPTS[0]], params)
        finally:
            eng.shutdown()
        counts.append((route.cache.compiles, route.cache.hits))
    assert counts[0][0] > 0 and counts[1][0] == 0 and counts[1][1] >= counts[0][0]


def test_requested_route_unavailable_is_clear(tmp_path):
    """Asking for Vulkan where the loader finds no driver names the route and how to install one."""
    code = "from kiln.engine.backends import select_backend; import sys; select_backend('vulkan', sys.argv[1])"
    nowhere = str(tmp_path / "none.json")
    env = {**os.environ, "VK_ICD_FILENAMES": nowhere, "VK_DRIVER_FILES": nowhere}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "BackendUnavailable: route vulkan" in out.stderr and "mesa-vulkan-drivers" in out.stderr, out.stderr[-2000:]


def test_bucket_gate_refuses_a_step_that_computes_wrong(tiny_model, iree_cache, monkeypatch):
    """Steps compiled to multiply in bfloat16 (IREE's contraction demotion) write K/V off by about
    1e-3 of their size, float32 ones by about 1e-6 on this model: with the gate's K/V tolerance
    at 1e-4, the float32 steps serve and the bfloat16 ones are refused, every bucket, so a batch
    that no passing bucket fits gets 503 route_unsupported rather than wrong tokens."""
    import kiln.engine.bucket_gate as gate
    import kiln.iree.compile as compile_module
    from kiln.errors import BackendCannotRun

    monkeypatch.setattr(gate, "KV_RTOL", 1e-4)
    config = EngineConfig(**{**SMALL, "decode_row_buckets": (1,)})
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def last_delta(eng):
        async def deltas():
            return [d async for d in eng.generate("gated", PROMPTS[0], params)]

        return asyncio.run(deltas())[-1]

    float32 = AsyncEngine(tiny_model, config, backend=select_backend("iree-cpu", iree_cache))
    try:
        assert last_delta(float32).finish_reason == "length" and not float32._core.runner.gate_failed
    finally:
        float32.shutdown()
    demoted = (*compile_module.TARGET_FLAGS["llvm-cpu"], "--iree-global-opt-demote-contraction-inputs-operations=all",
               "--iree-global-opt-demote-contraction-inputs-type=bf16")
    monkeypatch.setitem(compile_module.TARGET_FLAGS, "llvm-cpu", demoted)
    bf16 = AsyncEngine(tiny_model, config, backend=select_backend("iree-cpu", iree_cache))
    try:
        final = last_delta(bf16)
        assert final.finish_reason == "error" and isinstance(final.error, BackendCannotRun), final
        assert final.token_ids == []
        failed = bf16._core.runner.gate_failed
        assert failed and all(why.startswith("call 1:") for why in failed.values()), failed
    finally:
        bf16.shutdown()


@VULKAN
def test_resident_prefill_feeds_prompts_as_decode_steps(tiny_model, iree_cache, xla_engine):
    """The experimental profile's resident prefill on Vulkan: prompts go in one token per active
    row, so only decode-shaped buckets (one query per row) ever compile, and the tokens equal
    XLA's; a request asking for prompt logprobs keeps the whole-prompt path."""
    route = select_backend("vulkan", iree_cache)
    eng = AsyncEngine(tiny_model, EngineConfig(**SMALL, resident_prefill=True), backend=route)
    try:
        assert eng._core.resident_prefill
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert run(eng, PROMPTS, params) == run(xla_engine, PROMPTS, params)
        assert eng._core.runner.forwards and all(b.kind == "decode" for b in eng._core.runner.forwards)
        run(eng, [PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        assert any(b.kind == "prefill" for b in eng._core.runner.forwards)
    finally:
        eng.shutdown()
    stable = AsyncEngine(tiny_model, EngineConfig(**SMALL), backend=route)
    try:
        assert not stable._core.resident_prefill
    finally:
        stable.shutdown()


def test_a_batch_whose_bucket_fails_its_gate_runs_split(tiny_model, iree_cache, xla_engine, monkeypatch):
    """When the only bucket that fits a batch fails its correctness gate (lavapipe's 8-row prefill
    did), the batch is not refused: it runs again as halves (a lone prompt as half its chunk) in
    buckets that passed, and its tokens equal XLA's."""
    import kiln.engine.runner as runner_module
    from kiln.iree.compile import ModuleCache

    real = runner_module.check_bucket
    # gate again and keep no verdict: the injection decides, and only here
    monkeypatch.setattr(ModuleCache, "verdict", lambda *args: None)
    monkeypatch.setattr(ModuleCache, "record_verdict", lambda *args: None)
    monkeypatch.setattr(runner_module, "check_bucket", lambda runner, bucket, executable, lora: (
        "injected: wrong tokens" if bucket.kind == "prefill" and bucket.tokens == 32
        else real(runner, bucket, executable, lora)))
    config = EngineConfig(**{**SMALL, "prefill_token_buckets": (16, 32)})
    eng = AsyncEngine(tiny_model, config, backend=select_backend("iree-cpu", iree_cache))
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert run(eng, PROMPTS, params) == run(xla_engine, PROMPTS, params)
        failed = eng._core.runner.gate_failed
        assert failed and all(b.kind == "prefill" and b.tokens == 32 for b in failed), failed
        assert eng.snapshot["step_failures"] == 0
        assert all(b.tokens == 16 for b in eng._core.runner.forwards if b.kind == "prefill")
    finally:
        eng.shutdown()
