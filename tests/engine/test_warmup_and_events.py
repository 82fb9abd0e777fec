"""`kiln warmup` builds the step set into the cache (a second process compiles nothing) and the
engine publishes its prefix-cache blocks as vLLM-format KV events over ZMQ."""

import asyncio
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import msgpack
import zmq
from server_process import ServerProcess, suite_env

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams


def test_second_warmup_process_compiles_nothing(tmp_path, tiny_model):
    env = suite_env(str(tiny_model.source), str(tmp_path / "cache"))  # a cache of its own: the first run builds
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "kiln", "warmup"], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        m = re.search(r"warmup: (\d+) step executables ready .*\((\d+) built, (\d+) loaded from disk\)", proc.stdout)
        assert m, proc.stdout + proc.stderr[-2000:]
        runs.append(tuple(int(x) for x in m.groups()))
    (executables, built1, _), (executables2, built2, loaded2) = runs
    assert executables == executables2 and executables > 4
    assert built1 == executables
    assert built2 == 0 and loaded2 == executables
    assert any((tmp_path / "cache" / "jax").iterdir())


def test_steps_stored_again_after_an_upgrade_still_run(tmp_path, tiny_model):
    """An upgrade that changes the step sources but not the programs finds its stored steps gone (their
    keys changed) and JAX's own cache still full. The steps it stores then must run in the next start
    (one that JAX loaded from its cache stores without some of its kernels on XLA:CPU), and that start
    loads them all instead of building them again."""
    cache = tmp_path / "cache"
    for start in ("first", "after the upgrade", "the next"):
        server = ServerProcess(str(tiny_model.source), str(cache), KILN_MODEL_SERVED_MODEL_NAME="tiny")
        try:
            r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                           timeout=120)
            startup = httpx.get(server.url + "/v1/config").json()["step_set"]["startup"]
        finally:
            server.stop()
        assert r.status_code == 200, (start, r.text)
        if start == "the next":
            assert startup["built"] == 0 and startup["loaded"] == startup["executables"] > 0, startup
        if start == "first":
            shutil.rmtree(cache / "jax" / "kiln-steps")  # what a change to the step sources does to their keys


def test_warmup_interrupted_with_ctrl_c_exits_quietly(tmp_path, tiny_model):
    env = suite_env(str(tiny_model.source), str(tmp_path / "cache"))  # an empty cache: it has steps to build
    # As from a terminal: SIGINT neither blocked nor ignored. A test runner's state can be either (a
    # child inherits the forking thread's signal mask), so the child sets that before it runs Kiln.
    terminal = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execv(sys.executable, [sys.executable, '-m', 'kiln', 'warmup'])")
    proc = subprocess.Popen([sys.executable, "-c", terminal], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "cache" / "jax").exists():  # the model is loaded, the compilation cache set up
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "kiln: warmup interrupted" in err and "Traceback" not in err


def test_engine_publishes_kv_events(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=8, block_size=16, decode_row_buckets=(1, 2),
                                               prefill_token_buckets=(16, 32, 64), max_num_seqs=2,
                                               max_num_batched_tokens=64, kv_events_endpoint="tcp://127.0.0.1:*"))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(eng._core.publisher.endpoint)
    try:
        asyncio.run(asyncio.sleep(0.3))  # let the subscription reach the publisher
        prompt = list(range(10, 60))  # 50 tokens: 3 full blocks

        async def go(rid, p):
            async for _ in eng.generate(rid, p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)):
                pass

        asyncio.run(go("a", prompt))
        # a second, different long prompt forces evictions in the 7-block pool
        asyncio.run(go("b", list(range(100, 190))))
        events = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while poller.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            ts, batch, rank = msgpack.unpackb(payload)
            events += batch
        stored = [e for e in events if e[0] == "BlockStored"]
        removed = [e for e in events if e[0] == "BlockRemoved"]
        assert stored and stored[0][3] == prompt[:48] and stored[0][2] is None and stored[0][4] == 16
        assert len(stored[0][1]) == 3
        assert removed and set(removed[0][1]) <= {h for e in stored for h in e[1]}
    finally:
        sub.close(0)
        eng.shutdown()
