"""Serving on a tensor-parallel mesh ([engine] tensor_parallel), on 4 forced CPU devices: real servers
of one tiny llama (4 query heads, 2 KV heads) with tp = 1, 2 and 4 give the same greedy tokens and
logprobs, with and without an adapter, its weights float or quantized. On tp = 2 every split divides;
on tp = 4 the KV heads do not, so the KV pool and k/v stay whole on every device."""

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from peft_adapters import make_peft_adapter
from server_process import FEW_PROMPT_BUCKETS, FOUR_DEVICES, ServerProcess, free_port, suite_env
from tiny_models import make_hf_model, served_hf_dir

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64], list(range(20, 58)), [200, 100, 50, 25, 12, 6]]
NEW_TOKENS = 20
FOUR_DEVICE_RESULTS: list = []  # one process's tp=4 float results (base, adapted), for the two-process server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, kiln_cache, tiny_model):  # tiny_model: its conversion holds the tokenizer
    return served_hf_dir("llama", tmp_path_factory.mktemp("tp-llama"), kiln_cache, seed=21)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-adapter") / "adapter"
    make_peft_adapter(make_hf_model("llama", vocab_size=260, seed=21), path, seed=4)
    return path


def completions(url: str, model: str) -> list[tuple[list[str], list[float]]]:
    """Each prompt's greedy tokens and their logprobs, the prompts sent at once (one batch)."""
    async def one(client, prompt):
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                       "temperature": 0, "ignore_eos": True, "logprobs": 3})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return lp["tokens"], lp["token_logprobs"]

    async def every():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    return asyncio.run(every())


def serve(model_dir, kiln_cache, adapter_dir, tp: str, quantization: str, startup: dict | None = None,
          while_serving=None, **env: str) -> tuple[dict, list, list]:
    """A server on the mesh: its /v1/config mesh, the base model's results and the adapter's (and its
    step set's start into `startup`); `while_serving(url)` runs last."""
    env = {"XLA_FLAGS": FOUR_DEVICES, **FEW_PROMPT_BUCKETS, **env}
    server = ServerProcess(str(model_dir), str(kiln_cache), KILN_ENGINE_TENSOR_PARALLEL=tp,
                           KILN_MODEL_QUANTIZATION=quantization, **env)
    try:
        config = httpx.get(server.url + "/v1/config", timeout=30).json()
        mesh = config["mesh"]
        if startup is not None:
            startup.update(config["step_set"]["startup"])
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        base = completions(server.url, model)
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter_dir)},
                       timeout=120)
        assert r.status_code == 200, r.text
        adapted = completions(server.url, "a")
        slots = httpx.get(server.url + "/v1/config", timeout=30).json()["mesh"]["adapter_slot_bytes_per_device"]
        mesh["adapter_slot_bytes_per_device"] = slots  # allocated at the first load
        if while_serving is not None:
            while_serving(server.url)
    finally:
        server.stop_cleanly()
    return mesh, base, adapted


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_served_tokens_and_logprobs_on_two_and_four_devices_equal_one(model_dir, kiln_cache, adapter_dir,
                                                                      quantization):
    """Float weights split as the layouts say; int4 ones by output columns for q/k/v and gate/up."""
    mesh, base, adapted = serve(model_dir, kiln_cache, adapter_dir, "1", quantization)
    whole, whole_slots = mesh.pop("weight_bytes_per_device"), mesh.pop("adapter_slot_bytes_per_device")
    assert mesh == {"axis": None, "size": 1, "devices": []} and whole_slots > 0
    assert base != adapted  # the adapter changes the answers
    for tp in ("2", "auto"):  # auto: all four
        mesh, tp_base, tp_adapted = serve(model_dir, kiln_cache, adapter_dir, tp, quantization)
        if tp == "auto" and quantization == "none":
            FOUR_DEVICE_RESULTS.extend([tp_base, tp_adapted])
        assert mesh["axis"] == "tp" and mesh["size"] == (2 if tp == "2" else 4) and len(mesh["devices"]) == mesh["size"]
        # the projections are split (embedding, norms and, on 4 devices, k/v stay whole; quantized: o and down)
        assert mesh["weight_bytes_per_device"] < (0.8 if quantization == "none" else 0.9) * whole, (mesh, whole)
        # the adapter slots are split like the weights (B of q/k/v and gate/up by columns, A of o and down by rows)
        assert mesh["adapter_slot_bytes_per_device"] < 0.8 * whole_slots, (mesh, whole_slots)
        worst = 0.0
        for (tokens, logprobs), (tp_tokens, tp_logprobs) in zip(base + adapted, tp_base + tp_adapted, strict=True):
            assert tp_tokens == tokens
            worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, tp_logprobs, strict=True)))
        print(f"tp={mesh['size']}: largest logprob difference {worst:.2e}, weights per device "
              f"{mesh['weight_bytes_per_device']} of {whole} bytes, adapter slots "
              f"{mesh['adapter_slot_bytes_per_device']} of {whole_slots}")
        assert worst < 1e-4


def test_a_restarted_server_loads_its_steps_onto_its_devices(model_dir, kiln_cache, adapter_dir):
    """The step sets the test above built, loaded from disk: each executable runs on the devices it
    was compiled for (one device of four, or a mesh of two), not on every device of the process."""
    results = {}
    for tp in ("1", "2"):
        startup = {}
        _, base, adapted = serve(model_dir, kiln_cache, adapter_dir, tp, "none", startup)
        assert startup["built"] == 0 and startup["loaded"] > 0, startup
        results[tp] = [tokens for tokens, _ in base + adapted]
    assert results["2"] == results["1"]


def test_an_adapter_trained_on_a_mesh_serves_on_one_device(model_dir, kiln_cache, tmp_path):
    """A fine-tuning job on a tp=2 server trains on the sharded base and its loss falls; its adapter,
    from the shared store, serves the same tokens on a one-device server as on the mesh. (The other
    way round, an adapter made on one device serving on a mesh, is the first test's.)"""
    env = {"XLA_FLAGS": FOUR_DEVICES, **FEW_PROMPT_BUCKETS, "KILN_ADAPTERS_STORE": str(tmp_path / "store"),
           "KILN_TRAIN_DATA_DIR": str(tmp_path / "data"), "KILN_ADAPTERS_MAX_LORA_RANK": "8"}
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": "ok!"}]
             for q in ("hi", "why?", "who", "when", "ping", "2+2", "bye", "yes")]
    train = "\n".join(json.dumps({"messages": chat}) for chat in chats).encode()
    server = ServerProcess(str(model_dir), str(kiln_cache), KILN_ENGINE_TENSOR_PARALLEL="2", **env)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        file = client.files.create(file=("train.jsonl", train), purpose="fine-tune")
        method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 6, "batch_size": 4}}}
        job = client.fine_tuning.jobs.create(model=model, training_file=file.id, method=method, extra_body={"kiln": {
            "lora": {"rank": 8, "alpha": 16}, "learning_rate": 1e-2, "max_seq_len": 64, "adapter_name": "meshed"}})
        deadline = time.monotonic() + 300
        while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert job.status == "succeeded", job.error
        losses = [e.data["train_loss"] for e in reversed(client.fine_tuning.jobs.list_events(job.id, limit=100).data)
                  if e.type == "metrics"]
        assert len(losses) == 12 and losses[-1] < 0.85 * losses[0], losses
        on_mesh = completions(server.url, "meshed")  # loaded for serving when the job ended
    finally:
        server.stop_cleanly()
    server = ServerProcess(str(model_dir), str(kiln_cache), KILN_ENGINE_TENSOR_PARALLEL="1", **env)
    try:
        assert httpx.post(server.url + "/v1/adapters", json={"name": "meshed"}, timeout=120).status_code == 200
        on_one = completions(server.url, "meshed")
    finally:
        server.stop_cleanly()
    for (tokens, logprobs), (one_tokens, one_logprobs) in zip(on_mesh, on_one, strict=True):
        assert one_tokens == tokens
        assert max(abs(a - b) for a, b in zip(logprobs, one_logprobs, strict=True)) < 1e-4


def test_more_devices_than_the_process_has_stop_the_start(model_dir, kiln_cache):
    with pytest.raises(RuntimeError) as exc:
        ServerProcess(str(model_dir), str(kiln_cache), XLA_FLAGS=FOUR_DEVICES, KILN_ENGINE_TENSOR_PARALLEL="8")
    assert "engine.tensor_parallel = 8, but this process has 4 local cpu device(s)" in str(exc.value)


def two_free_ports() -> int:
    """A port whose next one is free too (a multi-process server's coordinator and step channel)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def test_a_server_over_two_processes_of_two_devices_equals_one_process_of_four(model_dir, kiln_cache, adapter_dir):
    """[distributed] over two processes of two CPU devices each: process 0 serves HTTP and process 1
    repeats its device work (its steps, the adapter's slot write). tp = 4 across both gives one
    process's four-device tokens and logprobs, base and adapter; process 1 answers /health as
    following; a fine-tuning job is refused (it would train in process 0 alone); stopping process 0
    stops both."""
    if not FOUR_DEVICE_RESULTS:  # (run alone: the first test did not run)
        FOUR_DEVICE_RESULTS.extend(serve(model_dir, kiln_cache, adapter_dir, "4", "none")[1:])
    base, adapted = FOUR_DEVICE_RESULTS
    two_devices = FOUR_DEVICES.replace("=4", "=2")
    run = {"KILN_DISTRIBUTED_COORDINATOR": f"127.0.0.1:{two_free_ports()}", "KILN_DISTRIBUTED_NUM_PROCESSES": "2"}
    follower_port = free_port()
    env = suite_env(str(model_dir), str(kiln_cache), XLA_FLAGS=two_devices, KILN_ENGINE_TENSOR_PARALLEL="4",
                    KILN_DISTRIBUTED_PROCESS_ID="1", KILN_SERVER_PORT=str(follower_port), **FEW_PROMPT_BUCKETS, **run)
    follower = subprocess.Popen([sys.executable, "-m", "kiln.server"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def while_serving(url: str) -> None:
        health = httpx.get(f"http://127.0.0.1:{follower_port}/health", timeout=10)
        assert (health.status_code, health.json()) == (200, {"status": "following", "process": 1})
        job = httpx.post(url + "/v1/fine_tuning/jobs", json={"model": "m", "training_file": "file-x"}, timeout=30)
        error = job.json()["error"]
        assert job.status_code == 400 and error["code"] == "multi_process_server", job.text
        assert "spans 2 processes" in error["message"]

    try:
        mesh, two_base, two_adapted = serve(model_dir, kiln_cache, adapter_dir, "4", "none", XLA_FLAGS=two_devices,
                                            KILN_DISTRIBUTED_PROCESS_ID="0", while_serving=while_serving, **run)
        said, _ = follower.communicate(timeout=120)
    finally:
        follower.kill()
    assert follower.returncode == 0, said[-3000:]
    assert "following process 0's steps" in said and "process 0 stopped" in said
    assert mesh["size"] == 4 and len(mesh["devices"]) == 4
    for (tokens, logprobs), (two_tokens, two_logprobs) in zip(base + adapted, two_base + two_adapted, strict=True):
        assert two_tokens == tokens
        assert max(abs(a - b) for a, b in zip(logprobs, two_logprobs, strict=True)) < 1e-4
