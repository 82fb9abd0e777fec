"""Training on a device mesh, on 4 forced CPU devices: `kiln train sft` with its batches' rows split
over a data-parallel axis and the weights over a tensor-parallel one gives the losses and the adapter
of one device, in one process or two joined by jax.distributed; a GRPO step and a distillation step on
a tensor-parallel engine give the gradients of a one-device engine's."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from server_process import FOUR_DEVICES, free_port

from kiln.adapters.store import AdapterStore, load_weights

CHATS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok, " + q}]}
         for q in ("hi", "why?", "who", "when", "ping", "2+2", "bye", "yes", "no")]


def mesh_env(kiln_cache, data_parallel: str, tensor_parallel: str, devices: int = 4, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**env, "XLA_FLAGS": FOUR_DEVICES.replace("=4", f"={devices}"), "KILN_CACHE_DIR": str(kiln_cache),
            "KILN_TRAIN_DATA_PARALLEL": data_parallel, "KILN_ENGINE_TENSOR_PARALLEL": tensor_parallel, **extra}


def sft_command(model, kiln_cache, tmp_path, data_parallel: str, tensor_parallel: str, name: str, devices: int = 4,
                **extra) -> tuple[list[str], dict]:
    """`kiln train sft --json` and its environment: 9 examples in batches of 3 (on two data-parallel
    devices each batch's rows are padded to 4), 2 epochs."""
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(chat) for chat in CHATS) + "\n")
    env = mesh_env(kiln_cache, data_parallel, tensor_parallel, devices, KILN_MODEL_PATH=model.source,
                   KILN_ADAPTERS_STORE=str(tmp_path / "store"), KILN_TRAIN_TENSORBOARD="false", **extra)
    args = ["--data", str(data), "--name", name, "--epochs", "2", "--batch-size", "3", "--rank", "4",
            "--learning-rate", "0.01", "--max-seq-len", "64", "--json"]
    return [sys.executable, "-m", "kiln", "train", "sft", *args], env


def train_sft(model, kiln_cache, tmp_path, data_parallel: str, tensor_parallel: str) -> subprocess.CompletedProcess:
    command, env = sft_command(model, kiln_cache, tmp_path, data_parallel, tensor_parallel,
                               f"dp{data_parallel}-tp{tensor_parallel}")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def assert_same_training(history: list[dict], reference: list[dict]) -> None:
    assert [h["step"] for h in history] == [h["step"] for h in reference] == list(range(1, 7))
    for key in ("train_loss", "grad_norm", "train_mean_token_accuracy"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in reference], rtol=2e-5, err_msg=key)


def assert_same_weights(weights: dict, reference: dict) -> None:
    for module, parts in reference.items():
        for k, value in parts.items():  # to float rounding, which Adam steps of 0.01 amplify
            np.testing.assert_allclose(weights[module][k], value, atol=3e-5, err_msg=f"{module}.{k}")


def test_sft_on_two_data_and_two_tensor_parallel_devices_equals_one_device(expressive_model, kiln_cache, tmp_path):
    """The same losses step by step, and the same adapter (to float rounding, which Adam steps of 0.01 amplify),
    saved whole, so that it serves on one device."""
    runs = {}
    for dp, tp in (("1", "1"), ("auto", "2")):  # auto: the 2 devices of 4 that tp = 2 leaves
        proc = train_sft(expressive_model, kiln_cache, tmp_path, dp, tp)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        runs[dp] = json.loads(proc.stdout)
    one, mesh = runs["1"]["history"], runs["auto"]["history"]
    assert_same_training(mesh, one)
    assert one[-1]["train_loss"] < one[0]["train_loss"]
    store = AdapterStore(tmp_path / "store")
    assert_same_weights(load_weights(store.latest("dpauto-tp2")), load_weights(store.latest("dp1-tp1")))


def test_sft_over_two_processes_of_two_devices_equals_one_process_of_four(expressive_model, kiln_cache, tmp_path):
    """Two processes joined by jax.distributed on loopback (CPU collectives through Gloo), 2 devices
    each, dp = 2 across them and tp = 2 within each: the losses and the adapter of one process with 4
    devices; process 0 alone saves it."""
    single = train_sft(expressive_model, kiln_cache, tmp_path, "2", "2")
    assert single.returncode == 0, single.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for index in range(2):
        command, env = sft_command(expressive_model, kiln_cache, tmp_path, "2", "2", "two-processes", devices=2,
                                   KILN_DISTRIBUTED_COORDINATOR=f"127.0.0.1:{port}", KILN_DISTRIBUTED_NUM_PROCESSES="2",
                                   KILN_DISTRIBUTED_PROCESS_ID=str(index), KILN_DISTRIBUTED_TIMEOUT_S="120")
        # output to files: a pipe nobody reads while the other process is waited on could fill and stall a
        # collective
        logs = (tmp_path / f"process{index}.out", tmp_path / f"process{index}.err")
        with logs[0].open("w") as out, logs[1].open("w") as err:
            procs.append((subprocess.Popen(command, env=env, stdout=out, stderr=err), logs))
    outs = []
    for proc, (out, err) in procs:
        proc.wait(timeout=300)
        assert proc.returncode == 0, err.read_text()[-3000:]
        outs.append(json.loads(out.read_text()))
    assert [o["process"] for o in outs] == [0, 1]
    assert outs[0]["artifact"]["name"] == "two-processes" and outs[1]["artifact"] is None
    reference = json.loads(single.stdout)["history"]
    for out in outs:
        assert_same_training(out["history"], reference)
    store = AdapterStore(tmp_path / "store")
    assert_same_weights(load_weights(store.latest("two-processes")), load_weights(store.latest("dp2-tp2")))


def test_a_process_that_cannot_reach_the_coordinator_fails_in_bounded_time(expressive_model, kiln_cache, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    command, env = sft_command(expressive_model, kiln_cache, tmp_path, "1", "1", "alone", devices=1,
                               KILN_DISTRIBUTED_COORDINATOR=f"127.0.0.1:{port}", KILN_DISTRIBUTED_NUM_PROCESSES="2",
                               KILN_DISTRIBUTED_PROCESS_ID="1", KILN_DISTRIBUTED_TIMEOUT_S="3")
    started = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and time.monotonic() - started < 60
    assert f"cannot reach the coordinator at distributed.coordinator = 127.0.0.1:{port} within 3 s" in proc.stdout


def test_the_process_index_comes_from_kubernetes():
    from kiln.distributed import process_id
    from kiln.errors import ConfigError

    assert process_id(3, {"JOB_COMPLETION_INDEX": "1"}) == 3
    assert process_id("auto", {"JOB_COMPLETION_INDEX": "1"}, "kiln-train-0") == 1  # an Indexed Job's pod
    assert process_id("auto", {}, "kiln-train-2") == 2  # a StatefulSet's pod
    with pytest.raises(ConfigError, match="KILN_DISTRIBUTED_PROCESS_ID"):
        process_id("auto", {}, "laptop")


def test_a_mesh_larger_than_the_devices_is_refused_naming_both_settings(expressive_model, kiln_cache, tmp_path):
    proc = train_sft(expressive_model, kiln_cache, tmp_path, "4", "2")
    assert proc.returncode == 1
    assert ("train.data_parallel = 4 times engine.tensor_parallel = 2 needs 8 devices, but 4 cpu device(s) were "
            "found") in proc.stdout


GRPO_STEP = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kiln.engine.client import AsyncEngine
    from kiln.engine.config import EngineConfig
    from kiln.models.loader import load_model
    from kiln.train.grpo import GRPOConfig, GRPORun, Rollout

    model = load_model(sys.argv[1], show_progress=False, model_id="tiny-llama")
    engine = AsyncEngine(model, EngineConfig(**json.loads(sys.argv[2])))
    try:
        config = GRPOConfig(lora_rank=4, lora_alpha=8, num_generations=2, prompts_per_step=2, learning_rate=0.05,
                            max_completion_tokens=6, micro_batch_rows=2)
        run = GRPORun(engine, [[5, 6, 7], [8, 9]], [None, None], None, config)
        rng = np.random.default_rng(0)
        groups = [[Rollout(p, rng.integers(3, 250, 5).tolist(), None, False, float(r)) for r in rewards]
                  for p, rewards in (([5, 6, 7], (1.0, 0.0)), ([8, 9], (0.2, 0.9)))]
        steps = [run.train_step(groups) for _ in range(2)]
        b = run.lora["q_proj"]["b"]
        print(json.dumps({"loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
                          "spec": str(getattr(b.sharding, "spec", None)), "q_b": np.asarray(b).ravel().tolist()}))
    finally:
        engine.shutdown()
""")


def test_a_grpo_step_on_a_tensor_parallel_engine_equals_one_device(expressive_model, kiln_cache):
    """The policy's LoRA params are split like the weights (B of q by columns) and its steps, on the
    same rollouts, give the one-device losses, gradient norms and updated params."""
    from conftest import POLICY_ENGINE

    out = {}
    for tp in (1, 2):
        engine = json.dumps({**POLICY_ENGINE, "decode_row_buckets": [8], "prefill_token_buckets": [32],
                             "tensor_parallel": tp})
        env = mesh_env(kiln_cache, "1", "1")
        proc = subprocess.run([sys.executable, "-c", GRPO_STEP, expressive_model.source, engine], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[tp] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out[1]["spec"] == "None" and out[2]["spec"] == "P(None, None, 'tp')"
    for key in ("loss", "grad_norm", "q_b"):
        np.testing.assert_allclose(out[2][key], out[1][key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert max(abs(x) for x in out[1]["q_b"]) > 0  # the steps moved B from zero


OPD_STEP = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kiln.engine.client import AsyncEngine
    from kiln.engine.config import EngineConfig
    from kiln.engine.lora_slots import AdapterWeights
    from kiln.models.loader import load_model
    from kiln.train.grpo import Rollout
    from kiln.train.opd import OPDConfig, OPDRun, Teacher

    model = load_model(sys.argv[1], show_progress=False, model_id="tiny-llama")
    engine = AsyncEngine(model, EngineConfig(**json.loads(sys.argv[2])))
    try:
        rng = np.random.default_rng(0)
        cfg = model.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"q_proj": (cfg.hidden_size, q), "v_proj": (cfg.hidden_size, kv)}
        weights = {m: {"a": 0.1 * rng.standard_normal((cfg.num_layers, i, 4)).astype(np.float32),
                       "b": 0.1 * rng.standard_normal((cfg.num_layers, 4, o)).astype(np.float32)}
                   for m, (i, o) in shapes.items()}
        teacher = Teacher.adapter(model, AdapterWeights("teacher", "1", weights, 2.0, 4))
        config = OPDConfig(lora_rank=4, lora_alpha=8, num_generations=2, prompts_per_step=2, learning_rate=0.05,
                           max_completion_tokens=6, micro_batch_rows=2, jsd_beta=0.5)
        run = OPDRun(engine, [[5, 6, 7], [8, 9]], teacher, config)
        groups = [[Rollout(p, rng.integers(3, 250, 5).tolist(), [-1.0] * 5, False, 0.0) for _ in range(2)]
                  for p in ([5, 6, 7], [8, 9])]
        steps = [run.train_step(groups) for _ in range(2)]
        print(json.dumps({k: [s[k] for s in steps] for k in ("loss", "grad_norm", "reverse_kl", "jsd")}))
    finally:
        engine.shutdown()
""")


def test_a_distillation_step_on_a_tensor_parallel_engine_equals_one_device(expressive_model, kiln_cache):
    """On-policy distillation from an adapter teacher, with the full-distribution JSD term: the teacher's
    logprobs and the student's gradients on the mesh are the one-device ones."""
    from conftest import POLICY_ENGINE

    out = {}
    for tp in (1, 2):
        engine = json.dumps({**POLICY_ENGINE, "decode_row_buckets": [8], "prefill_token_buckets": [32],
                             "tensor_parallel": tp})
        proc = subprocess.run([sys.executable, "-c", OPD_STEP, expressive_model.source, engine],
                              env=mesh_env(kiln_cache, "1", "1"), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[tp] = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("loss", "grad_norm", "reverse_kl", "jsd"):
        np.testing.assert_allclose(out[2][key], out[1][key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert out[1]["jsd"][0] > 0 and out[1]["grad_norm"][0] > 0


@pytest.mark.parametrize("value", ["0", "x"])
def test_bad_data_parallel_values_are_refused(value, kiln_cache):
    proc = subprocess.run([sys.executable, "-m", "kiln", "config", "--json"], capture_output=True, text=True,
                          env=mesh_env(kiln_cache, value, "1"), timeout=120)
    assert proc.returncode != 0 and "KILN_TRAIN_DATA_PARALLEL" in proc.stdout + proc.stderr


def test_a_server_over_several_processes_needs_the_coordinator(kiln_cache):
    """(A server over two processes is tests/engine/test_tensor_parallel.py's.)"""
    env = mesh_env(kiln_cache, "1", "1", KILN_DISTRIBUTED_NUM_PROCESSES="2", KILN_SERVER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "kiln.server"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "distributed.num_processes = 2 needs distributed.coordinator" in proc.stderr
