"""The KV pool's size from a memory budget, on the CPU its untouched pages left to the OS, and the
host allocator's settings for step-sized allocations."""

import asyncio
import dataclasses
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import SMALL, prompts_of, run

from kiln.config import resolve_settings
from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.kv_pool import BLOCK_ROUNDING, DeviceHeap, block_bytes, pool_dtype, size_pool
from kiln.engine.params import SamplingParams
from kiln.errors import ConfigError

MiB = 1 << 20


def test_kv_cache_memory_setting_is_parsed_and_checked():
    def resolved(text):
        return resolve_settings(env={"KILN_ENGINE_KV_CACHE_MEMORY": text}).engine.kv_cache_memory

    assert resolved("auto") == "auto"
    assert resolved("8GiB") == str(8 << 30)
    assert resolved("512 MB") == str(512 * 10**6)
    assert resolved("536870912") == "536870912"
    assert resolved("0.5") == "0.5"
    for bad in ("1.5", "0.0", "lots", "-1GiB", "12 parsecs"):
        with pytest.raises(ConfigError, match="engine.kv_cache_memory"):
            resolved(bad)
    assert resolve_settings(env={}).engine.num_kv_blocks == 0  # sized from the budget unless a count is set


def test_pool_sizes_from_each_form_of_the_setting(tiny_model):
    cfg, config = tiny_model.config, EngineConfig(**SMALL)
    per_block = block_bytes(cfg, 16, "float32")
    assert per_block == 2 * cfg.num_layers * cfg.num_kv_heads * 16 * cfg.head_dim * 4

    def size(**kw):
        return size_pool(cfg, dataclasses.replace(config, **kw), "float32", max_len=256, on_host=False)

    explicit = size(num_kv_blocks=100)
    assert (explicit.blocks, explicit.reason) == (100, "[engine] num_kv_blocks")
    exact = size(kv_cache_memory=str(300 * per_block + per_block // 2))
    assert exact.blocks == 300 and "kv_cache_memory" in exact.reason
    assert exact.to_json()["tokens"] == 299 * 16 and exact.to_json()["bytes"] == 300 * per_block
    # auto on the CPU: never more than max_num_seqs sequences of the longest length can fill
    auto = size()
    assert auto.blocks == config.max_num_seqs * (256 // 16) + 1 and "capped" in auto.reason
    # a fraction of the host's available memory, rounded so that starts repeat their step shapes
    share = size(kv_cache_memory="0.001")
    assert share.blocks % BLOCK_ROUNDING == 0 and "available host memory" in share.reason


def test_a_vulkan_device_pool_takes_a_share_of_its_heap_after_the_weights(tiny_model):
    """A Vulkan device reports its heap, not what is free: auto takes half of 0.9 of what the weights
    leave (the other half for the steps' temporaries), never a host-sized pool that cannot fit."""
    cfg, config = tiny_model.config, dataclasses.replace(EngineConfig(**SMALL), max_num_seqs=4096)
    per_block = block_bytes(cfg, 16, "float32")
    heap = DeviceHeap(memory=1000 * per_block, placed=200 * per_block, max_buffer=1 << 40)
    auto = size_pool(cfg, config, "float32", max_len=256, on_host=True, heap=heap)
    assert auto.blocks == 360 - 360 % BLOCK_ROUNDING and auto.blocks * per_block <= 0.45 * heap.free
    assert "heap" in auto.reason and "weights" in auto.reason
    share = size_pool(cfg, dataclasses.replace(config, kv_cache_memory="0.5"), "float32", max_len=256, on_host=True,
                      heap=heap)
    assert share.blocks == 384 and "heap" in share.reason  # half of what the weights leave, rounded
    with pytest.raises(ConfigError, match="kv_cache_memory"):  # weights that leave no room for one sequence
        size_pool(cfg, config, "float32", max_len=256, on_host=True,
                  heap=DeviceHeap(100 * per_block, 90 * per_block, 1 << 40))


def test_a_budget_that_cannot_hold_one_sequence_is_refused_with_the_numbers(tiny_model):
    config = dataclasses.replace(EngineConfig(**SMALL), kv_cache_memory=str(5 * block_bytes(tiny_model.config, 16,
                                                                                             "float32")))
    with pytest.raises(ConfigError) as caught:
        size_pool(tiny_model.config, config, "float32", max_len=256, on_host=False)
    message = str(caught.value)
    assert "[engine] kv_cache_memory" in message and "holds 5 blocks" in message and "needs 17 blocks" in message
    assert "max_model_len" in message


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="page residency is read on Linux")
def test_untouched_pool_pages_take_no_memory_and_written_blocks_read_back(tiny_model):
    """A pool of 64 MiB per array on the CPU: resident only where requests wrote blocks, and the
    tokens it serves equal those of a small pool's engine."""
    blocks = 64 * MiB // (block_bytes(tiny_model.config, 16, "float32") // 2)
    big = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=blocks, **SMALL))
    try:
        pool_bytes = 2 * 64 * MiB
        assert big.kv_resident_bytes < pool_bytes // 50, "a fresh pool is resident"
        prompts, params = prompts_of(6, seed=11), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [ids for ids, _, _ in run(big, prompts, params)]
        written = big.kv_resident_bytes
        assert 0 < written < pool_bytes // 10, written
    finally:
        big.shutdown()
    small = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, **SMALL))
    try:
        assert got == [ids for ids, _, _ in run(small, prompts, params)]
    finally:
        small.shutdown()


def test_the_pool_dtype_setting_resolves_against_the_model_and_route():
    assert resolve_settings(env={}).engine.kv_cache_dtype == "auto"
    assert resolve_settings(env={"KILN_ENGINE_KV_CACHE_DTYPE": "BFloat16"}).engine.kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype"):
        resolve_settings(env={"KILN_ENGINE_KV_CACHE_DTYPE": "fp8"})
    assert pool_dtype("auto", "float32") == jnp.float32 and pool_dtype("auto", "float16") == jnp.float16
    assert pool_dtype("bfloat16", "float32") == jnp.bfloat16 and pool_dtype("bfloat16", "bfloat16") == jnp.bfloat16
    with pytest.raises(ConfigError, match=r"kv_cache_dtype = bfloat16: the model is float16"):
        pool_dtype("bfloat16", "float16")
    with pytest.raises(ConfigError, match="XLA routes only"):
        pool_dtype("bfloat16", "float32", on_iree=True)


def test_a_bfloat16_pool_holds_twice_the_tokens_and_serves_what_the_float_pool_does(tiny_model):
    """Under a float32 model a bfloat16 pool takes half the bytes per block (twice the blocks in one
    budget) and, its keys and values rounded to bfloat16, gives the float pool's greedy tokens with
    logprobs within the rounding's reach."""
    cfg = tiny_model.config
    assert block_bytes(cfg, 16, jnp.bfloat16) * 2 == block_bytes(cfg, 16, jnp.float32)
    budget = str(200 * block_bytes(cfg, 16, jnp.float32))
    prompts = prompts_of(8, seed=5)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)

    async def streams(eng):
        async def one(i, prompt):
            deltas = [d async for d in eng.generate(f"bf16-{i}", prompt, params)]
            return [t for d in deltas for t in d.token_ids], [lp.logprob for d in deltas for lp in d.logprobs or []]
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = {}
    for dtype in ("auto", "bfloat16"):
        eng = AsyncEngine(tiny_model, EngineConfig(kv_cache_memory=budget, kv_cache_dtype=dtype, **SMALL))
        try:
            stored = eng.at_boundary(lambda e=eng: e._core.runner.kv.k.dtype).result(10)
            assert stored == (jnp.uint16 if dtype == "bfloat16" else jnp.float32)  # 16-bit values held as bits
            results[dtype] = (eng.kv_pool, asyncio.run(streams(eng)))
        finally:
            eng.shutdown()
    (float_pool, float_out), (half_pool, half_out) = results["auto"], results["bfloat16"]
    assert (float_pool.dtype, half_pool.dtype) == ("float32", "bfloat16")
    assert half_pool.blocks == 2 * float_pool.blocks
    same = [a[0] == b[0] for a, b in zip(float_out, half_out, strict=True)]
    assert sum(same) >= 7, same
    # where the tokens agree, so do their logprobs, up to the keys' and values' rounding
    gaps = [np.max(np.abs(np.subtract(a[1], b[1]))) for a, b in zip(float_out, half_out, strict=True) if a[0] == b[0]]
    assert max(gaps) < 0.01, gaps
    print("bfloat16 pool: same tokens in", sum(same), "of", len(same), "prompts; largest logprob gap", max(gaps))


def test_a_server_whose_budget_is_too_small_stops_at_start_naming_it(tiny_model, kiln_cache):
    from server_process import ServerProcess

    with pytest.raises(RuntimeError, match="server exited early") as caught:
        ServerProcess(tiny_model.source, str(kiln_cache), KILN_ENGINE_NUM_KV_BLOCKS="0",
                      KILN_ENGINE_KV_CACHE_MEMORY="64KiB")
    said = str(caught.value)
    assert "kiln: error: [engine] kv_cache_memory: a KV pool of 64.0 KiB" in said and "needs 17 blocks" in said
    assert "Traceback" not in said


WHERE_48_MIB_GOES = """
import ctypes, sys
if sys.argv[1] == "kiln":
    import kiln
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
block = libc.malloc(48 << 20)
for line in open("/proc/self/maps"):
    fields = line.split()
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    if lo <= block < hi:
        print(fields[5] if len(fields) > 5 else "a mapping of its own")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("env,imports,where", [({}, "nothing", "a mapping of its own"), ({}, "kiln", "[heap]"),
                                               ({"MALLOC_ARENA_MAX": "2"}, "kiln", "a mapping of its own")])
def test_importing_kiln_keeps_step_sized_allocations_on_the_heap(env, imports, where):
    # glibc maps an allocation this size afresh each time (a step's temporaries page-fault in at every
    # run); once kiln is imported it comes from the heap, unless the user set malloc's options
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env
    out = subprocess.run([sys.executable, "-c", WHERE_48_MIB_GOES, imports], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == where
