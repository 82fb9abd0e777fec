"""The training-run protocol that SFT, GRPO and on-policy distillation share, and the one loop that
runs a run to its end (`advance_to_end`): under `drive` for the Python API and `kiln train`, and
under a fine-tuning job's worker between two serving steps (kiln.train.jobs).

A run holds its state (LoRA params, optimizer state, counters) and moves forward one `advance`
at a time, so whoever drives it decides when each step happens.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kiln.config import resolve_settings, setting_default
from kiln.train.artifact import adapter_manifest
from kiln.train.forward import lora_to_numpy
from kiln.train.slices import Turns
from kiln.train.tensorboard import TensorBoard, run_log_dir


class TrainingRun(Protocol):
    kind: str  # the trainer ("sft", "grpo", "opd"): logs, progress and provenance
    total_steps: int  # optimizer steps in the whole run
    step: int  # optimizer steps taken
    micro_step: int  # what checkpoints are numbered by
    trained_tokens: int
    progress_keys: dict[str, str]  # metric -> label shown on the progress bar

    @property
    def done(self) -> bool: ...

    def prepare(self) -> None:
        """Work that needs no accelerator ownership (a compile), done before `advance`."""

    def advance(self, ownership: Turns | None = None) -> dict | None:
        """Moves the run on, holding the accelerator through `ownership` (see slices.Turns) only
        while it touches device state, in slices where a step is long; returns the metrics of an
        optimizer step it completed, or None when this call completed none (or was stopped
        between two slices, its step unapplied)."""

    def summary(self, metrics: dict) -> str:
        """A step's metrics in a few words, for a job's events."""

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def manifest(self, name: str, model, inputs: list[dict], training: dict): ...

    def weights(self) -> dict[str, dict[str, np.ndarray]]: ...

    def close(self) -> None:
        """Releases what the run holds in the engine (a policy's adapter slot)."""


class LoraRun:
    """What every run keeps alike: the LoRA params `lora`, the optimizer state `opt_state`, the
    integer `counters` a checkpoint keeps (the data position among them) and the seed. A
    subclass sets `kind`, `method`, `counters`, `config`, `total_steps` and `last_metrics`."""

    kind: str
    method: str  # the OpenAI method type of the manifest
    counters: tuple[str, ...]

    def prepare(self) -> None:
        pass

    def close(self) -> None:
        pass

    def weights(self) -> dict[str, dict[str, np.ndarray]]:
        return lora_to_numpy(self.lora)

    def _manifest_config(self) -> dict:
        return self.config.to_json()

    def manifest(self, name: str, model, inputs: list[dict], training: dict):
        """The adapter manifest of this run's result (see `artifact.adapter_manifest`)."""
        c = self.config
        return adapter_manifest(name, model, method=self.method, source=self.kind, config=self._manifest_config(),
                                rank=c.lora_rank, alpha=c.lora_alpha, modules=c.target_modules, inputs=inputs,
                                training=training, steps=self.total_steps, trained_tokens=self.trained_tokens,
                                final_metrics=self.last_metrics)

    def state(self) -> dict:
        """What a checkpoint keeps: params, optimizer state, counters and the seed (a run's data
        order is a function of the seed, so the counters place it)."""
        count = lambda n: np.asarray(n, np.int64)  # noqa: E731
        return {"lora": self.lora, "opt_state": self.opt_state,
                **{name: count(getattr(self, name)) for name in self.counters}, "seed": count(self.config.seed)}

    def restore(self, state: dict) -> None:
        if int(state["seed"]) != self.config.seed:
            raise ValueError("the checkpoint belongs to a run with another seed")
        self.lora, self.opt_state = state["lora"], state["opt_state"]
        for name in self.counters:
            setattr(self, name, int(state[name]))
        self._restored()

    def _restored(self) -> None:
        """After `restore`: what depends on the restored state."""


def adapter_store(store, settings):
    """`store` as an AdapterStore: one, a path, or None for the settings' store."""
    from kiln.adapters.store import AdapterStore

    return store if isinstance(store, AdapterStore) else AdapterStore(store or settings.adapter_store())


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def advance_to_end(run: TrainingRun, ownership=None, *, on_step: Callable[[dict], None] = lambda metrics: None,
                   stop: Callable[[], bool] = lambda: False,
                   share: float = setting_default("train.serving_share")) -> bool:
    """Advances `run` until it is done: `stop()` is asked before each advance and before each slice
    of a step (True ends the run there, the step in progress unapplied, and this returns False),
    and `on_step(metrics)` runs after each optimizer step. Under an engine's `ownership` every
    write of the run takes turns with serving, leaving it `share` of the accelerator's time."""
    turns = Turns.of(ownership, share=share, stop=stop)
    while not run.done:
        if turns.stop():
            return False
        metrics = run.advance(turns)
        if metrics is not None:
            on_step(metrics)
    return True


def drive(run: TrainingRun, *, name: str, model, inputs: list[dict], store=None, ownership=None,
          progress: bool = True, settings=None) -> tuple[list[dict], Any]:
    """Runs `run` to its end in this process with a progress bar and TensorBoard event files (as
    `settings`' `[train] tensorboard` and `log_dir` say; None: the resolved settings), then
    releases what it holds in the engine and, given an AdapterStore, saves its adapter there with
    its manifest. Of a run that spans processes, only process 0 shows progress, writes event files
    and saves. Returns the metrics history (one entry per optimizer step) and the artifact (None when
    not saved)."""
    import jax
    from tqdm.auto import tqdm

    started = _timestamp()
    history: list[dict] = []
    leader = jax.process_index() == 0  # of a run that spans processes, process 0 reports and saves
    bar = tqdm(total=run.total_steps, desc=f"{run.kind} {name}", unit="step", disable=not (progress and leader))
    board = TensorBoard(run_log_dir(settings or resolve_settings(None), name) if leader else None)

    def on_step(metrics: dict) -> None:
        history.append(metrics)
        board.step(metrics)
        bar.update(1)
        bar.set_postfix({label: f"{metrics[key]:.3f}" for key, label in run.progress_keys.items() if key in metrics})

    try:
        advance_to_end(run, ownership, on_step=on_step)
    finally:
        board.close()
    bar.close()
    run.close()
    # gathering weights split over processes is a collective: every process takes part
    weights = run.weights() if store is not None or jax.process_count() > 1 else None
    if store is None or not leader:
        return history, None
    manifest = run.manifest(name, model, inputs, {"started_at": started, "finished_at": _timestamp()})
    return history, store.save(manifest, weights)
