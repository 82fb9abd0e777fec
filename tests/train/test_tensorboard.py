"""TensorBoard event files of training runs (kiln.train.tensorboard), read back with TensorBoard's own
EventAccumulator: a run in Python (`sft()`, through `drive`) and a fine-tuning job write each step's
metrics at its step, `[train] log_dir` moves the files, `[train] tensorboard = false` writes none, a
writer that fails leaves the run going, and a gate's numbers have tags of their own."""

import hashlib
import json
import logging
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kiln.config import resolve_settings
from kiln.train.sft import sft
from kiln.train.tensorboard import TensorBoard, gate_scalars, metric_scalars

REPLY = "kiln says hi"
QUESTIONS = ["hello", "ping", "bye", "who are you"]


def jsonl(records) -> str:
    return "\n".join(json.dumps(r) for r in records) + "\n"


TRAIN = jsonl([{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": REPLY}]}
               for q in QUESTIONS])
VALID = jsonl([{"messages": [{"role": "user", "content": "good morning"}, {"role": "assistant", "content": REPLY}]}])


def event_dirs(root):
    """The directories under `root` holding event files."""
    return sorted({p.parent for p in root.rglob("events.out.tfevents.*")})


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the event files in `directory`, as TensorBoard reads them."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_written(history: list[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of `metric` at every step that has it, as an event file holds it (float32)."""
    return [(m["step"], float(np.float32(m[metric]))) for m in history if metric in m]


def run_sft(model, tmp_path, **env):
    settings = resolve_settings(None, env={"KILN_TRAIN_DATA_DIR": str(tmp_path / "data"), **env})
    return sft(TRAIN, "tb-run", model=model, validation=VALID, settings=settings, save=False, progress=False,
               n_epochs=2, batch_size=2, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, max_seq_len=64)


def test_a_python_run_writes_every_steps_metrics_at_its_step(tiny_model, tmp_path):
    history = run_sft(tiny_model, tmp_path).history
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    [directory] = event_dirs(tmp_path)  # by default under <data dir>/runs/<name>/<time>
    assert directory.parent == tmp_path / "data" / "runs" / "tb-run"
    written = scalars(directory)
    assert written["train/loss"] == as_written(history, "train_loss")
    for tag, metric in (("train/learning_rate", "learning_rate"), ("train/grad_norm", "grad_norm"),
                        ("train/tokens_per_second", "tokens_per_second"),
                        ("train/mean_token_accuracy", "train_mean_token_accuracy"), ("valid/loss", "valid_loss")):
        assert written[tag] == as_written(history, metric), tag
    assert [step for step, _ in written["valid/loss"]] == [2, 4]  # at each epoch's end
    assert set(written) == {tag for m in history for tag in metric_scalars(m)}


def test_log_dir_moves_the_files_and_tensorboard_false_writes_none(tiny_model, tmp_path):
    run_sft(tiny_model, tmp_path / "moved", KILN_TRAIN_LOG_DIR=str(tmp_path / "logs"))
    [directory] = event_dirs(tmp_path)
    assert directory.parent == tmp_path / "logs" / "tb-run"
    assert len(scalars(directory)["train/loss"]) == 4

    history = run_sft(tiny_model, tmp_path / "off", KILN_TRAIN_TENSORBOARD="false",
                      KILN_TRAIN_LOG_DIR=str(tmp_path / "off-logs")).history
    assert len(history) == 4
    assert event_dirs(tmp_path) == [directory] and not (tmp_path / "off-logs").exists()
    assert not (tmp_path / "off" / "data" / "runs").exists()


def test_a_writer_that_fails_leaves_the_run_going(tiny_model, tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        history = run_sft(tiny_model, tmp_path, KILN_TRAIN_LOG_DIR=str(blocker)).history
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert any("TensorBoard logging to" in r.message and "stopped" in r.message for r in caplog.records)

    board = TensorBoard(tmp_path / "board")  # a write that raises: one warning, nothing more written
    board._writer.add_scalar = lambda *args, **kwargs: 1 / 0
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        board.step({"step": 1, "train_loss": 1.0})
        board.step({"step": 2, "train_loss": 0.5})
    assert not board.active
    assert sum("ZeroDivisionError" in r.message for r in caplog.records) == 1
    board.close()


def test_metric_and_gate_tags(tmp_path):
    grpo_step = {"step": 3, "loss": 0.1, "reward_mean": 0.5, "reward_std": 0.2, "kl": 0.01, "grad_norm": 2.0,
                 "learning_rate": 1e-4, "tokens_per_second": 100.0, "rollout_staleness": 1,
                 "valid_reward_mean": 0.75, "sub_rewards": {"exact": 1.0, "style": 0.25}, "note": "text"}
    assert metric_scalars(grpo_step) == {
        "train/loss": 0.1, "train/reward": 0.5, "train/reward_std": 0.2, "train/kl": 0.01, "train/grad_norm": 2.0,
        "train/learning_rate": 1e-4, "train/tokens_per_second": 100.0, "train/rollout_staleness": 1.0,
        "valid/reward": 0.75, "train/reward/exact": 1.0, "train/reward/style": 0.25}
    result = {"passed": True, "reasons": [], "baseline_run": "evalrun_a", "candidate_run": "evalrun_b",
              "criteria": [{"testing_criteria": "says_hi", "baseline_pass_rate": 0.0, "candidate_pass_rate": 0.75,
                            "pass_rate_difference": {"estimate": 0.75, "ci_low": 0.5, "ci_high": 1.0},
                            "mean_score_difference": {"estimate": None, "ci_low": None, "ci_high": None},
                            "paired_items": 4, "flipped": {"regressed": [], "improved": [0, 1, 3]}}]}
    expected = {"gate/passed": 1.0, "gate/says_hi/pass_rate": 0.75, "gate/says_hi/baseline_pass_rate": 0.0,
                "gate/says_hi/pass_rate_difference": 0.75, "gate/says_hi/pass_rate_difference_ci_low": 0.5,
                "gate/says_hi/pass_rate_difference_ci_high": 1.0, "gate/says_hi/paired_items": 4.0,
                "gate/says_hi/regressed": 0.0, "gate/says_hi/improved": 3.0}
    assert gate_scalars(result) == expected
    board = TensorBoard(tmp_path)
    board.gate(result, 12)
    board.close()
    assert scalars(tmp_path) == {tag: [(12, value)] for tag, value in expected.items()}


def test_a_resumed_run_hides_what_its_last_attempt_wrote_after_the_checkpoint(tmp_path):
    first = TensorBoard(tmp_path)
    for step in (1, 2, 3, 4):
        first.step({"step": step, "train_loss": float(step)})
    first.close()
    resumed = TensorBoard(tmp_path, purge_step=3)  # from the checkpoint at step 2, as a job resumes
    for step in (3, 4, 5):
        resumed.step({"step": step, "train_loss": 10.0 * step})
    resumed.close()
    assert scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


@pytest.fixture
def job_manager(tiny_model, tmp_path):
    """A JobManager in this process on the tiny model (the server's, without HTTP in between)."""
    from kiln.adapters.registry import AdapterRegistry
    from kiln.adapters.store import AdapterStore
    from kiln.engine.client import AsyncEngine
    from kiln.engine.config import EngineConfig
    from kiln.train.jobs import JobManager
    from kiln.train.store import TrainingStore

    settings = resolve_settings(None, env={"KILN_TRAIN_DATA_DIR": str(tmp_path / "data"),
                                           "KILN_ADAPTERS_STORE": str(tmp_path / "store")})
    engine = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=32, block_size=16, max_loras=1, max_lora_rank=8,
                                                  decode_row_buckets=(1, 2), prefill_token_buckets=(16, 32, 64),
                                                  max_num_seqs=2, max_num_batched_tokens=64))
    manager = JobManager(settings, engine, AdapterRegistry(engine, AdapterStore(tmp_path / "store")),
                         TrainingStore(settings.training_dir()))
    yield manager
    manager.shutdown()
    engine.shutdown()


def test_a_job_writes_its_metrics_events_to_tensorboard(job_manager):
    store = job_manager.store

    def upload(text: str) -> str:
        data = text.encode()
        return store.add_file(data, "data.jsonl", "fine-tune", "sha256:" + hashlib.sha256(data).hexdigest())["id"]

    job = job_manager.create({
        "model": "tiny-llama", "training_file": upload(TRAIN), "validation_file": upload(VALID),
        "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}},
        "kiln": {"lora": {"rank": 4, "alpha": 8}, "learning_rate": 1e-2, "max_seq_len": 64, "auto_load": False}})
    deadline = time.monotonic() + 300
    while (done := store.get_job(job["id"]))["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, done["status"]
        time.sleep(0.2)
    assert done["status"] == "succeeded", done["error"]

    events, _ = store.events(job["id"], limit=100)  # what GET /v1/fine_tuning/jobs/{id}/events pages
    metrics = [e["data"] for e in reversed(events) if e["type"] == "metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    job_dir = store.root / "jobs" / job["id"]
    assert event_dirs(store.root) == [job_dir / "tensorboard"]  # kept when the job ends, its checkpoints not
    assert not (job_dir / "checkpoints").exists()
    written = scalars(job_dir / "tensorboard")
    assert written["train/loss"] == as_written(metrics, "train_loss")
    assert written["valid/loss"] == as_written(metrics, "valid_loss")
    assert written["train/learning_rate"] == as_written(metrics, "learning_rate")
    assert set(written) == {tag for m in metrics for tag in metric_scalars(m)} - {"train/total_steps"}
