"""Shared pieces of the benchmarks: the chat workload, the bare decode step, the matmul peak,
and transformers on the same weights."""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.engine.buckets import StepBucket
from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.params import SamplingParams
from kiln.engine.sampling import RowSampling
from kiln.engine.steps import TokenFeed
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.config import ModelConfig
from kiln.models.decoder import matmul
from kiln.models.loader import default_model_path
from kiln.models.lora import module_shapes

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Explain how a bicycle works.",
    "List three uses of copper.", "Why is the sky blue?", "Give me one tip for learning to cook.",
    "What is a prime number?", "Name a famous painter and one of their works.",
]


def chat_prompts(tok, n: int) -> list[list[int]]:
    """n short chat prompts (the default model's template), cycling through QUESTIONS."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]),
                       add_special_tokens=False) for i in range(n)]


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn, timed round-robin (after one untimed call each) so that the
    machine's noise hits them all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def step_flops(cfg: ModelConfig, rows: int) -> float:
    """Matmul FLOPs of one decode step of `rows` rows: every projection plus the LM head."""
    per_layer = sum(i * o for i, o in module_shapes(cfg).values())
    return 2.0 * rows * (cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size)


def matmul_chain(cfg: ModelConfig, rows: int, dtype=jnp.float32) -> Callable[[], None]:
    """A plain jitted chain of the step's matmuls (same shapes and weight dtype, one weight per layer
    and projection, streamed as the step streams them): the reference peak the step is held against."""
    key = jax.random.PRNGKey(0)
    shapes = module_shapes(cfg)
    weights = [{m: (0.02 * jax.random.normal(jax.random.fold_in(key, 10 * i + j), s)).astype(dtype)
                for j, (m, s) in enumerate(shapes.items())} for i in range(cfg.num_layers)]
    head = (0.02 * jax.random.normal(key, (cfg.hidden_size, cfg.vocab_size))).astype(dtype)
    x = jax.random.normal(key, (rows, cfg.hidden_size))

    @jax.jit
    def chain(weights, head, h):
        for w in weights:
            q, k, v = matmul(h, w["q_proj"]), matmul(h, w["k_proj"]), matmul(h, w["v_proj"])
            h = h + matmul(q + 0.0 * (k.sum() + v.sum()), w["o_proj"])
            h = h + matmul(jax.nn.silu(matmul(h, w["gate_proj"])) * matmul(h, w["up_proj"]), w["down_proj"])
        return matmul(h, head)

    return lambda: chain(weights, head, x).block_until_ready()


def first_layers(model, layers: int):
    """The model cut to its first `layers` layers: the same step with less device work per token (a
    step of a few milliseconds on a CPU, the size of a small model's step on an accelerator)."""
    params = dict(model.params)
    params["layers"] = params["layers"][:layers] if isinstance(params["layers"], list) else \
        jax.tree.map(lambda x: x[:layers], params["layers"])
    return dataclasses.replace(model, config=dataclasses.replace(model.config, num_layers=layers), params=params)


def decoding_core(model, rows: int, context: int, **config) -> EngineCore:
    """An EngineCore with `rows` requests each decoding at about `context` tokens of context."""
    core = EngineCore(model, EngineConfig(**{"num_kv_blocks": 2048, "max_num_seqs": max(rows, 1),
                                             "decode_row_buckets": (1, 2, 4, 8, 16, 32, 64), **config}))
    prompts = chat_prompts(model.tokenizer, rows)
    greedy = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        for req in core.make_requests(f"r{i}", (p * (context // len(p) + 1))[: context - 4], greedy):
            core.add_request(req)
    while any(r.in_prefill or not r.output_ids for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    while min(r.num_tokens for r in core.scheduler.running) < context:
        core.step()
    core.flush()  # nothing in flight
    return core


def decode_step_args(core: EngineCore) -> tuple[StepBucket, tuple, RowSampling]:
    """The padded inputs of one decode step of the core's running rows: the forward step's
    arguments after the params and the KV state, and the sampler's row arrays."""
    runner = core.runner
    rows = [(r, 1) for r in core.scheduler.running]
    bucket = runner.bucket_for(rows)
    # each row recomputes its last token: same shapes and blocks as its next decode step
    work = [RowWork([r.all_ids[r.num_computed - 1]], r.num_computed - 1, r.block_ids) for r, _ in rows]
    inputs = build_step_inputs(work, runner.block_size, num_tokens=bucket.tokens, num_tiles=bucket.tiles,
                               tile_size=bucket.tile_size, table_columns=runner.table_columns)
    feed = TokenFeed(np.zeros(runner.layout.feed_rows, np.int32), np.full(bucket.tokens, -1, np.int32))
    return bucket, (inputs, np.arange(bucket.rows, dtype=np.int32), np.full(bucket.tokens, -1, np.int32), None, feed), \
        runner.layout.sampling_arrays(rows, bucket.rows)


def bare_step(core: EngineCore) -> tuple[Callable[[], None], StepBucket]:
    """The decode step (forward and sampler executables) of the core's running rows with its inputs
    built once: device time only."""
    runner = core.runner
    bucket, args, rs = decode_step_args(core)
    forward, sampler = runner.forward_for(bucket), runner.sampler_for(bucket.rows)

    def run():
        row_logits, _, runner.kv = forward(runner.params, runner.kv, *args)
        np.asarray(sampler(row_logits, rs)[0].tokens)

    return run, bucket


def engine_step_times(core: EngineCore, blocks: int = 5, steps: int = 8) -> dict[str, float]:
    """Seconds per decode step of the core's running rows: the bare step (device time only), the
    engine's step (`EngineCore.step` in a row, flushed at the end: with async scheduling each step's
    host work overlaps the one before on the device), what the engine adds to the bare step (the
    median of block-by-block differences: blocks of each alternate, so noise hits both alike, and each
    block's bare step runs at the rows' context then), and the host's work per engine step (its wall
    time less the wait for the device's results)."""
    fetch, waits = core.runner.fetch, []

    def timed_fetch(pending):
        t0 = time.perf_counter()
        try:
            return fetch(pending)
        finally:
            waits.append(time.perf_counter() - t0)

    core.runner.fetch = timed_fetch
    core.step(), core.flush()  # an untimed first call
    bare, engine, host = [], [], []
    for _ in range(blocks):
        run, _ = bare_step(core)  # the rows' decode step at their context now (which the engine grows)
        run()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        bare.append((time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        core.flush()
        engine.append((time.perf_counter() - t0) / steps)
        for _ in range(steps):
            waits.clear()
            t0 = time.perf_counter()
            core.step()
            host.append(time.perf_counter() - t0 - sum(waits))
        core.flush()
    core.runner.fetch = fetch
    return {"bare": statistics.median(bare), "engine": statistics.median(engine),
            "added": statistics.median(e - b for e, b in zip(engine, bare, strict=True)),
            "host": statistics.median(host)}


def model_path() -> Path:
    """The model the benches run: the server's own setting, KILN_MODEL_PATH (a GGUF file or an HF
    directory), else the embedded default model."""
    return Path(os.environ["KILN_MODEL_PATH"]) if os.environ.get("KILN_MODEL_PATH") else default_model_path()


def load_transformers(dtype: str = "float32"):
    """transformers on the same weights, on the GPU when torch sees one."""
    import torch
    from transformers import AutoModelForCausalLM

    path = model_path()
    where = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(str(path.parent if where else path), dtype=getattr(torch, dtype),
                                                **where).to(device).eval()


def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> Callable[[], None]:
    """transformers' batched greedy generate (left-padded, exactly new_tokens each)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)

    def run():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        do_sample=False, pad_token_id=0)
        if hf.device.type == "cuda":
            torch.cuda.synchronize()

    return run


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`python -m kiln.server` on a free loopback port with these KILN_* settings; returns once
    /health answers 200 (prewarm done)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kiln.server"], env={**os.environ, **env,
                            "KILN_SERVER_PORT": str(port)}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during startup")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy")
