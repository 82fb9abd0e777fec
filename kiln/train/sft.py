"""Supervised fine-tuning of a LoRA adapter on the frozen base weights.

`SFTRun` is a training run (see kiln.train.run) that advances one micro-batch at a time, so
whoever drives it (the in-process `sft()` below, or a job between two serving steps) decides
when each step happens. `sft()` runs a whole job in-process with the shared driver and saves
the adapter to the store.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kiln.config import setting_default
from kiln.errors import ConfigError
from kiln.models.config import ModelConfig
from kiln.models.decoder import logits
from kiln.models.sharding import shard_params, training_mesh
from kiln.train import losses
from kiln.train.artifact import default_adapter_name
from kiln.train.data import (
    Batch,
    DataError,
    Example,
    batches_per_epoch,
    epoch_batches,
    length_buckets,
    load_examples,
    make_batch,
)
from kiln.train.forward import forward_hidden, init_lora, load_balancing_loss
from kiln.train.optim import adamw, apply_gradients, learning_rate_schedule
from kiln.train.placement import Placement
from kiln.train.run import LoraRun, adapter_store, drive
from kiln.train.slices import SlicedStep, StepAbandoned, Turns


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    lora_rank: int = setting_default("train.lora_rank")
    lora_alpha: float = setting_default("train.lora_alpha")
    target_modules: tuple[str, ...] = setting_default("train.target_modules")
    learning_rate: float = setting_default("train.learning_rate")
    n_epochs: int = setting_default("train.n_epochs")
    batch_size: int = setting_default("train.batch_size")
    gradient_accumulation: int = setting_default("train.gradient_accumulation")
    max_seq_len: int = setting_default("train.max_seq_len")
    warmup_ratio: float = setting_default("train.warmup_ratio")
    lr_schedule: str = setting_default("train.lr_schedule")
    weight_decay: float = setting_default("train.weight_decay")
    max_grad_norm: float = setting_default("train.max_grad_norm")
    remat: str = setting_default("train.remat")
    max_slice_ms: float = setting_default("train.max_slice_ms")
    seed: int = setting_default("train.seed")
    # a mixture of experts' load-balancing loss, times this, added to the loss (transformers'
    # router_aux_loss_coef; 0: off). Steps with it run fused, not in bounded slices.
    router_aux_loss_coef: float = 0.0

    @classmethod
    def from_settings(cls, settings, **overrides) -> SFTConfig:
        values = {f.name: getattr(settings.train, f.name) for f in dataclasses.fields(cls)
                  if hasattr(settings.train, f.name)}
        values["target_modules"] = tuple(values["target_modules"])
        return cls(**{**values, **overrides})

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}


def trained_logits(params, lora, batch: Batch, cfg: ModelConfig, scale: float, remat: bool = False) -> jax.Array:
    """Logits [K, vocab] at the batch's trained positions only: the LM head (a fifth of a small
    model's FLOPs) never runs for prompt and padding tokens."""
    hidden = forward_hidden(params, lora, batch.tokens, batch.valid, cfg, scale, remat)
    return logits(params, hidden[batch.loss_index], cfg, training=True)


def head_loss(params, hidden: jax.Array, batch: Batch, norm, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """The cross-entropy and accuracy of trained positions given their final hidden states, as sums
    scaled by `norm` (1 / the batch's trained tokens): the mean over the batch, in parts that add."""
    out = logits(params, hidden, cfg, training=True)
    nll = -losses.token_logprobs(out, batch.loss_targets)
    correct = (jnp.argmax(out, axis=-1) == batch.loss_targets).astype(jnp.float32)
    return jnp.sum(nll * batch.loss_mask) * norm, {"accuracy": jnp.sum(correct * batch.loss_mask) * norm}


def loss_norm(batch: Batch):
    return 1.0 / jnp.maximum(jnp.sum(batch.loss_mask), 1.0)


def make_train_step(cfg: ModelConfig, tx: optax.GradientTransformation, scale: float, remat: bool,
                    router_aux_loss_coef: float, placement: Placement):
    """One micro-batch in one executable: loss, gradients w.r.t. the LoRA params only, optimizer
    update. The LoRA params and optimizer state are donated (updated in place), and come back placed
    as `placement` holds them. A positive `router_aux_loss_coef` adds a mixture's load-balancing
    loss (reported as router_aux_loss)."""
    balance = router_aux_loss_coef > 0

    def loss_fn(lora, params, batch: Batch):
        out = forward_hidden(params, lora, batch.tokens, batch.valid, cfg, scale, remat, router_stats=balance)
        hidden, stats = out if balance else (out, None)
        loss, aux = head_loss(params, hidden[batch.loss_index], batch, loss_norm(batch), cfg)
        if balance:
            aux["router_aux_loss"] = load_balancing_loss(stats, jnp.sum(batch.valid), cfg)
            loss = loss + router_aux_loss_coef * aux["router_aux_loss"]
        return loss, aux

    def step(lora, opt_state, params, batch: Batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(lora, params, batch)
        updates, opt_state = tx.update(grads, opt_state, lora)
        metrics = {"loss": loss, **aux, "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(lora, updates), opt_state, metrics

    return placement.jit_update(step, donate_argnums=(0, 1))


def make_eval_step(cfg: ModelConfig, scale: float):
    """Token-summed loss, correct predictions and trained tokens of a batch."""

    def step(lora, params, batch: Batch):
        logits = trained_logits(params, lora, batch, cfg, scale)
        nll = -losses.token_logprobs(logits, batch.loss_targets)
        correct = (jnp.argmax(logits, axis=-1) == batch.loss_targets).astype(jnp.float32)
        return jnp.sum(nll * batch.loss_mask), jnp.sum(correct * batch.loss_mask), jnp.sum(batch.loss_mask)

    return jax.jit(step)


def _shape(batch: Batch) -> tuple[int, int, int]:
    return (*batch.tokens.shape, batch.loss_index.shape[0])


class SFTRun(LoraRun):
    """One SFT run over `params` (the serving arrays, never copied). name: what it holds
    accelerator ownership as. mesh: the one `params` are placed on (kiln.models.sharding; None: one
    device); the LoRA params and optimizer state are split like them, a batch's rows over its
    data-parallel axis."""

    kind = "sft"
    method = "supervised"
    counters = ("micro_step", "trained_tokens", "input_tokens")  # the data position is the micro-step
    progress_keys = {"train_loss": "loss"}

    def __init__(self, params: dict, cfg: ModelConfig, examples: list[Example], config: SFTConfig,
                 valid_examples: list[Example] | None = None, remat: bool = False, name: str = "sft",
                 mesh=None):
        self.params, self.cfg, self.config, self.name = params, cfg, config, name
        self.examples, self.valid_examples = examples, valid_examples or []
        self.buckets = length_buckets(config.max_seq_len)
        self.batches_per_epoch = batches_per_epoch(len(examples), config.batch_size)
        self.total_micro_steps = self.batches_per_epoch * config.n_epochs
        self.total_steps = math.ceil(self.total_micro_steps / config.gradient_accumulation)
        self.schedule = learning_rate_schedule(config.learning_rate, self.total_steps, config.warmup_ratio,
                                               config.lr_schedule)
        tx = adamw(self.schedule, config.weight_decay, config.max_grad_norm, config.gradient_accumulation)
        self.placement = Placement(mesh, cfg)
        self.lora, self.opt_state = self.placement.state(tx, init_lora(cfg, config.lora_rank, config.target_modules,
                                                                       config.seed))
        self.remat = remat
        if config.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef = {config.router_aux_loss_coef}: the weight of the "
                              "load-balancing loss is non-negative (0: off)")
        if config.router_aux_loss_coef and not cfg.num_experts:
            raise ConfigError(f"router_aux_loss_coef = {config.router_aux_loss_coef}: {cfg.architecture} has no "
                              "router (the load-balancing loss is a mixture of experts')")
        self._train_step = make_train_step(cfg, tx, config.scale, remat, config.router_aux_loss_coef, self.placement)
        # the optimizer update of a sliced step's gradients (params and state donated)
        self._update = self.placement.jit_update(apply_gradients(tx), donate_argnums=(0, 1))
        self._sliced = SlicedStep(cfg, config.scale, functools.partial(head_loss, cfg=cfg), config.max_slice_ms, remat)
        self._eval_step = make_eval_step(cfg, config.scale)
        self.micro_step = 0
        self.trained_tokens = 0  # tokens in the loss
        self.input_tokens = 0  # real (non-padding) tokens processed
        self._epoch_iter = None
        self._prepared: Batch | None = None
        self._executables: dict[tuple, Any] = {}  # batch shape (B, S, K) -> compiled train step
        self._pending: list[dict] = []  # micro-batch metrics of the optimizer step in progress
        self.last_metrics: dict = {}  # of the last optimizer step (validation included at epoch ends)
        self._step_started = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.micro_step >= self.total_micro_steps

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.micro_step // self.config.gradient_accumulation

    @property
    def epoch(self) -> int:
        return self.micro_step // self.batches_per_epoch

    def _next_batch(self) -> Batch:
        if self.micro_step % self.batches_per_epoch == 0 or self._epoch_iter is None:
            self._epoch_iter = epoch_batches(self.examples, self.config.batch_size, self.buckets,
                                             self.config.seed + self.epoch)
            for _ in range(self.micro_step % self.batches_per_epoch):  # resuming mid-epoch
                next(self._epoch_iter)
        return next(self._epoch_iter)

    @property
    def shapes(self) -> set[tuple]:
        """Distinct batch shapes (rows, length, trained positions) met so far: one compiled train
        step each."""
        return set(self._executables)

    def prepare(self, turns: Turns | None = None) -> None:
        """Fetches the next batch and compiles its step (fused, or its slices) when new. It touches no
        device state, so a job runs it outside accelerator ownership: compiling never blocks
        serving."""
        if self._prepared is None:
            self._prepared = self._next_batch()
        shape, plan = _shape(self._prepared), self._plan(turns)
        if plan is not None:
            self._sliced.prepare(self.params, self.lora, self._prepared, plan)
        elif shape not in self._executables:
            self._executables[shape] = self._train_step.lower(self.lora, self.opt_state, self.params,
                                                              self.placement.batch(self._prepared)).compile()

    def _plan(self, turns: Turns | None):
        """How the prepared batch runs: fused (None) alone in its process or with the router's
        auxiliary loss, else as `[train] max_slice_ms` and the measured costs allow (see
        kiln.train.slices)."""
        shared = turns is not None and turns.shared and not self.config.router_aux_loss_coef
        return self._sliced.plan(self._prepared) if shared else None

    def advance(self, ownership=None) -> dict | None:
        """Runs one micro-batch, taking turns with serving under `ownership` (compiling before,
        outside it); returns the optimizer step's metrics when it completes one, with the
        validation metrics when that step ends an epoch or the run. Stopped between two slices,
        it returns None with nothing applied, the batch kept for the next call."""
        if self.done:
            raise RuntimeError("the run is complete")
        turns = Turns.of(ownership)
        self.prepare(turns)
        batch, plan = self._prepared, self._plan(turns)
        try:
            if plan is None:
                with turns.write(f"training {self.name}"):
                    started = time.perf_counter()
                    self.lora, self.opt_state, metrics = self._executables[_shape(batch)](
                        self.lora, self.opt_state, self.params, self.placement.batch(batch))
                    jax.block_until_ready(metrics)
                    self._sliced.record_fused(batch, time.perf_counter() - started)
            else:
                norm = 1.0 / max(float(batch.loss_mask.sum()), 1.0)
                grads, loss, aux = self._sliced.grads(self.params, self.lora, batch, norm, plan, turns.write)
                with turns.write(f"training {self.name}: update"):
                    self.lora, self.opt_state, grad_norm = self._update(self.lora, self.opt_state, grads)
                    jax.block_until_ready(grad_norm)
                metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": grad_norm}
        except StepAbandoned:
            return None
        self._prepared = None
        return self._micro_step(batch, metrics)

    def _micro_step(self, batch: Batch, metrics: dict) -> dict | None:
        epoch = self.epoch
        self.micro_step += 1
        self.trained_tokens += int(batch.loss_mask.sum())
        self.input_tokens += int(batch.valid.sum())
        self._pending.append({**metrics, "tokens": int(batch.valid.sum())})
        if self.micro_step % self.config.gradient_accumulation and not self.done:
            return None
        pending, self._pending = self._pending, []
        now = time.perf_counter()
        elapsed, self._step_started = now - self._step_started, now
        metrics = {
            "step": self.step if not self.done else self.total_steps,
            "epoch": self.epoch,
            "train_loss": float(np.mean([float(m["loss"]) for m in pending])),
            "train_mean_token_accuracy": float(np.mean([float(m["accuracy"]) for m in pending])),
            "grad_norm": float(np.mean([float(m["grad_norm"]) for m in pending])),
            **({"router_aux_loss": float(np.mean([float(m["router_aux_loss"]) for m in pending]))}
               if "router_aux_loss" in pending[0] else {}),
            "learning_rate": float(self.schedule(max(0, self.step - 1))),
            "tokens_per_second": sum(m["tokens"] for m in pending) / max(elapsed, 1e-9),
        }
        if self.done or self.epoch != epoch:
            metrics.update(self.validate())
        self.last_metrics = {k: v for k, v in metrics.items() if k not in ("step", "epoch")}
        return metrics

    def summary(self, metrics: dict) -> str:
        return f"training loss={metrics['train_loss']:.4f}"

    def validate(self) -> dict:
        """valid_loss and valid_mean_token_accuracy over the validation set (token means)."""
        if not self.valid_examples:
            return {}
        loss = correct = count = 0.0
        rows = self.config.batch_size
        for start in range(0, len(self.valid_examples), rows):
            batch = make_batch(self.valid_examples[start:start + rows], rows, self.buckets)
            s, c, n = self._eval_step(self.lora, self.params, self.placement.batch(batch))
            loss, correct, count = loss + float(s), correct + float(c), count + float(n)
        count = max(count, 1.0)
        return {"valid_loss": loss / count, "valid_mean_token_accuracy": correct / count}

    def _restored(self) -> None:
        self.lora, self.opt_state = self.placement.restored(self.lora, self.opt_state)
        self._epoch_iter = self._prepared = None


@dataclasses.dataclass
class SFTResult:
    history: list[dict]
    artifact: Any  # kiln.adapters.store.Artifact, or None when not saved
    run: SFTRun

    @property
    def compiled_shapes(self) -> int:
        return len(self.run.shapes)


def file_digest(data: bytes | str | Path) -> str:
    raw = Path(data).read_bytes() if isinstance(data, Path) else data.encode() if isinstance(data, str) else data
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _as_source(data):
    """A Path, or a str naming a file, is read as a file; a str holding JSON lines is the data."""
    if isinstance(data, str) and "\n" not in data.strip() and not data.lstrip().startswith("{"):
        data = Path(data)  # one line that is not a JSON object: a path
    if isinstance(data, Path) and not data.is_file():
        raise DataError(f"no such file: {data}", code="file_not_found")
    return data


def sft(data, name: str | None = None, *, model=None, validation=None, config: SFTConfig | None = None,
        store=None, progress: bool = True, save: bool = True, settings=None, **overrides) -> SFTResult:
    """Trains a LoRA adapter with SFT in this process and saves it to the adapter store.

    data / validation: a JSONL path, or its text or bytes. model: a LoadedModel, a path, or None
    for the default model. config: an SFTConfig (default: the [train] settings); keyword
    overrides replace its fields (e.g. n_epochs=1). It runs on the mesh `[train] data_parallel` and
    `[engine] tensor_parallel` ask for (one device by default), which spans every process of a run
    that kiln.distributed joined. Returns the metrics history (one entry per optimizer step;
    validation metrics at each epoch's end) and the saved artifact (None but on process 0)."""
    from kiln.config import resolve_settings
    from kiln.engine.setup import resolve_model

    settings = settings or resolve_settings(None)
    config = dataclasses.replace(config, **overrides) if config else SFTConfig.from_settings(settings, **overrides)
    model = resolve_model(model, settings, progress)
    name = name or default_adapter_name("sft")
    data, validation = _as_source(data), _as_source(validation)
    examples = load_examples(data, model.tokenizer, config.max_seq_len)
    valid = (load_examples(validation, model.tokenizer, config.max_seq_len, "validation file")
             if validation is not None else None)
    mesh = training_mesh(settings.train.data_parallel, settings.engine.tensor_parallel)
    params = shard_params(model.params, model.config, mesh) if mesh is not None else model.params
    run = SFTRun(params, model.config, examples, config, valid, remat=config.remat == "on", mesh=mesh)
    inputs = [{"purpose": "training", "sha256": file_digest(data)}] if save else []
    if save and validation is not None:
        inputs.append({"purpose": "validation", "sha256": file_digest(validation)})
    history, artifact = drive(run, name=name, model=model, inputs=inputs,
                              store=adapter_store(store, settings) if save else None, progress=progress,
                              settings=settings)
    return SFTResult(history, artifact, run)
