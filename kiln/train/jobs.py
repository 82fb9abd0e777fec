"""Fine-tuning jobs in the serving process, in OpenAI's shapes (`fine_tuning.job`, its events
and checkpoints), durable across restarts.

One worker thread runs one job at a time; the others wait in the queue. Each training
micro-step is a writer under the engine's accelerator ownership, so it runs at an iteration
boundary and serving continues between steps; compiling a step happens outside ownership.
A job checkpoints (orbax) every `checkpoint_every` optimizer steps, on pause and on shutdown;
after a restart a job that was running resumes from its last checkpoint. A finished job
saves its adapter to the store and, unless `auto_load` is false, loads it for serving.

A job is three things: its `JobSpec` (validated once in `create`, read back from the stored
job), the worker here (queue, lifecycle, one cancel path), and its training run (see
kiln.train.run), which each method builds for itself (`_RUNS`). How a job shares the
accelerator with serving is kiln.train.serving_share.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jax
import msgspec

from kiln import agent, graders
from kiln.adapters.manifest import validate_name
from kiln.engine.faults import as_device_lost, is_device_loss
from kiln.engine.lora_slots import AdapterWeights
from kiln.errors import AdmissionRejected, DataError, InvalidRequest, KilnError, NotFound
from kiln.eval.gate import Gate, GateResult, GateSpec, GateStopped, parse_gate
from kiln.models.lora import EXPERT_MODULES, TARGET_MODULES
from kiln.train import memory
from kiln.train.agent_grpo import AgentGRPORun
from kiln.train.data import encode_prompt, load_examples, load_prompts
from kiln.train.grpo import GRPOConfig, GRPORun, Rollout, as_reward
from kiln.train.opd import OPDConfig, OPDRun, Teacher
from kiln.train.run import TrainingRun, advance_to_end
from kiln.train.serving_share import ServingShare
from kiln.train.sft import SFTConfig, SFTRun
from kiln.train.slices import StepAbandoned
from kiln.train.store import TrainingStore, new_id, now
from kiln.train.tensorboard import TensorBoard, job_log_dir

log = logging.getLogger("kiln.train")

ACTIVE = ("validating_files", "queued", "running")
FINAL = ("succeeded", "failed", "cancelled")
_SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")
METHODS = ("supervised", "reinforcement", "distillation")
# a reinforcement job's `kiln.agent`: its rollouts' Responses fields (they are then agent runs)
AGENT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "max_turns", "instructions")
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
GRPO_KNOBS = ("num_generations", "max_completion_tokens", "temperature", "top_p", "loss_type", "scale_rewards", "beta",
              "epsilon", "epsilon_high", "num_iterations", "importance_sampling_cap", "mask_truncated_completions",
              "micro_batch_rows", "lr_schedule", "warmup_ratio", "weight_decay", "max_grad_norm", "max_steps")


def _choose(value: Any, auto: Any, kind: type, lo: float, hi: float, param: str) -> Any:
    """A hyperparameter: "auto" (or absent) gives `auto`; a number must lie in [lo, hi]."""
    if value in (None, "auto"):
        return auto
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and (kind is float or float(value).is_integer())
    if not ok or not lo <= value <= hi:
        raise InvalidRequest(f"{param} must be \"auto\" or a{'n integer' if kind is int else ' number'} "
                             f"from {lo:g} to {hi:g}, got {value!r}", code="invalid_hyperparameter", param=param)
    return kind(value)


@dataclasses.dataclass(frozen=True)
class _SharedOptions:
    """A job request's options every method shares, checked (see JobManager._shared_options)."""

    job_id: str
    name: str
    suffix: str | None
    metadata: dict | None
    seed: int
    gate: GateSpec | None
    auto_load: bool
    checkpoint_every: int
    max_seq_len: int
    batch_size: int
    rank: int
    modules: list[str]
    sft_defaults: SFTConfig
    hyperparameters: dict  # OpenAI's object: n_epochs, batch_size, learning_rate_multiplier
    common: dict  # the config fields every method's config takes


@dataclasses.dataclass(frozen=True)
class _MethodChoice:
    """What a method makes of a request: its config, OpenAI's `method` object, and the memory plan's
    shape (rows, sequence length, accumulation, rematerialisation, a teacher's weights)."""

    config: SFTConfig | GRPOConfig | OPDConfig
    method: dict
    rows: int
    seq_len: int
    accumulation: int
    remat: str
    extra_bytes: int = 0
    rollouts: str | None = None  # policy jobs only
    agent: dict | None = None  # a reinforcement job whose rollouts are agent runs: their Responses fields


CONFIGS = {"supervised": SFTConfig, "reinforcement": GRPOConfig, "distillation": OPDConfig}


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the worker needs of a job, typed: read from the job `create` validated and stored
    (the stored job, in OpenAI's shape, is what persists across restarts)."""

    id: str
    method: str  # one of METHODS
    config: SFTConfig | GRPOConfig | OPDConfig
    training_file: str
    validation_file: str | None
    adapter_name: str
    auto_load: bool
    checkpoint_every: int
    max_seq_len: int
    remat: bool
    kv_resize_to: int | None  # the KV pool's size while the job trains (None: unchanged)
    gate: dict | None
    rollouts: str | None  # policy jobs: "engine" or "external" (scored rollouts submitted by a client)
    grader: dict | None  # reinforcement
    teacher: str | None  # distillation
    eval_interval: int = 10  # reinforcement: the validation reward every this many steps
    eval_samples: int = 1
    agent: dict | None = None  # reinforcement: rollouts are agent runs with these Responses fields (tools, ...)

    @classmethod
    def from_job(cls, job: dict) -> JobSpec:
        kiln, method = job["kiln"], job["method"]["type"]
        options = job["method"][method]
        config = CONFIGS[method](**{**kiln["config"], "target_modules": tuple(kiln["config"]["target_modules"])})
        hp = options["hyperparameters"]
        resize = kiln["plan"].get("kv_resize")
        return cls(job["id"], method, config, job["training_file"], job["validation_file"], kiln["adapter_name"],
                   kiln["auto_load"], kiln["checkpoint_every"], kiln["max_seq_len"], bool(kiln["plan"]["remat"]),
                   resize["to_blocks"] if resize else None, kiln["gate"], kiln.get("rollouts"),
                   options.get("grader"), options.get("teacher"), hp.get("eval_interval", 10),
                   hp.get("eval_samples", 1), kiln.get("agent"))

    @property
    def inputs(self) -> dict[str, str]:
        """purpose -> file id"""
        return {"training": self.training_file} | ({"validation": self.validation_file} if self.validation_file
                                                   else {})


class SubmittedRolloutsRun(GRPORun):
    """A reinforcement job's run on rollouts a client samples and scores (`kiln.rollouts =
    "external"`): each `advance` trains on the next submitted batch, or returns None after a
    short wait when none is waiting. take(): the next (groups, final, future), or None."""

    def __init__(self, *args, take, **kwargs):
        super().__init__(*args, **kwargs)
        self._take = take

    def advance(self, ownership=None) -> dict | None:
        submission = self._take()
        if submission is None:
            return None
        groups, final, future = submission
        try:
            started = time.perf_counter()
            metrics = self.train_step(groups, ownership)
            metrics.update(step=self.step, train_seconds=time.perf_counter() - started)
        except StepAbandoned as exc:  # the job stopped between two slices: the batch is not trained on
            future.set_exception(exc)
            return None
        except Exception as exc:
            future.set_exception(exc)
            raise
        if final:
            self.total_steps = self.step
        future.set_result({"object": "fine_tuning.job.rollouts", "step": self.step, "final": final or self.done,
                           "metrics": metrics})
        return metrics

    def summary(self, metrics: dict) -> str:
        return f"reward={metrics['reward_mean']:.4f} (submitted)"


class JobManager:
    def __init__(self, settings, engine, registry, store: TrainingStore, start: bool = True, evals=None):
        """evals: the EvalService that promotion gates run on (jobs without a gate need none)."""
        self.settings, self.engine, self.registry, self.store = settings, engine, registry, store
        self.evals = evals
        self.model = engine.model
        self._cv = threading.Condition()
        self._flags: dict[str, str] = {}  # job id -> "cancel" | "pause"
        self._submissions: dict[str, list] = {}  # job id -> scored rollouts waiting for a step
        self._stopping = False
        self.current: str | None = None
        self._teacher_models: dict[str, object] = {}  # train.teachers loaded so far, by name
        self.share = ServingShare(settings, engine)
        for job in store.list_jobs(ACTIVE):  # a restart: running jobs resume from their checkpoints
            if job["status"] == "running":
                store.add_event(job["id"], "Kiln restarted; the job resumes from its last checkpoint")
            self._set(job, status="queued")
        self._thread = threading.Thread(target=self._worker, name="kiln-train", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Starts the worker (for a manager made with start=False)."""
        self._thread.start()

    # ---- API -------------------------------------------------------------------------------

    def create(self, body: dict) -> dict:
        """Validates a job request (400 on any problem, nothing stored) and queues it: the options
        every method shares, then the method's own, then the memory plan."""
        base = body.get("model")
        if base != self.model.model_id:
            raise InvalidRequest(f"unknown base model {base!r}; this server fine-tunes {self.model.model_id!r}",
                                 code="model_not_found", param="model")
        training = self._input_file(body.get("training_file"), "training_file")
        validation = self._input_file(body["validation_file"], "validation_file") if body.get(
            "validation_file") else None
        method = body.get("method") or {"type": "supervised"}
        kind = method.get("type") if isinstance(method, dict) else None
        if kind not in METHODS:
            raise InvalidRequest(f"method {kind!r} is not supported; use one of {', '.join(METHODS)}",
                                 code="unsupported_method", param="method.type")
        options = method.get(kind) or {}
        hp = {**(body.get("hyperparameters") or {}), **(options.get("hyperparameters") or {})}
        kiln = body.get("kiln") or {}
        if not isinstance(kiln, dict):
            raise InvalidRequest("kiln must be an object", param="kiln")
        shared = self._shared_options(body, kind, hp, kiln)
        validate = self._supervised if kind == "supervised" else self._policy
        chosen = validate(kind, options, hp, kiln, shared, training, validation)
        serving = self.share.serving_bytes
        if chosen.extra_bytes:
            serving = {**serving, "teacher_weights": chosen.extra_bytes}
        plan = memory.plan(self.model.config, shared.rank, shared.modules, chosen.rows, chosen.seq_len,
                           chosen.accumulation, serving, self.settings.train.memory_budget_bytes)
        kv_pool = {"blocks": self.share.kv_blocks, "bytes_per_block": self.share.kv_block_bytes,
                   "min_blocks": self.engine.min_kv_blocks}
        plan.update(memory.admit(plan, chosen.remat,
                                 kv_pool if self.settings.serving_profile.policy.dynamic_kv_resize else None))
        s = shared
        job = {
            "object": "fine_tuning.job", "id": s.job_id, "model": base, "created_at": now(), "finished_at": None,
            "fine_tuned_model": None, "organization_id": "kiln", "result_files": [], "status": "queued",
            "training_file": training["id"], "validation_file": validation["id"] if validation else None,
            "hyperparameters": chosen.method[kind]["hyperparameters"], "trained_tokens": None, "error": None,
            "user_provided_suffix": s.suffix, "seed": s.seed, "estimated_finish": None, "integrations": [],
            "metadata": s.metadata, "method": chosen.method,
            "kiln": {"adapter_name": s.name, "auto_load": s.auto_load,
                     "checkpoint_every": s.checkpoint_every, "config": chosen.config.to_json(), "plan": plan,
                     "max_seq_len": s.max_seq_len, "gate": s.gate and s.gate.to_json(), "gate_result": None,
                     "step": 0, "total_steps": None, "rollouts": chosen.rollouts, "agent": chosen.agent},
        }
        JobSpec.from_job(job)  # what the worker reads back: it must, before the job is stored
        self.store.put_job(job)
        self.store.add_event(s.job_id, f"Validated training file: {training['id']}")
        self.store.add_event(s.job_id, "Fine-tuning job queued")
        with self._cv:
            self._cv.notify_all()
        return job

    def _shared_options(self, body: dict, kind: str, hp: dict, kiln: dict) -> _SharedOptions:
        """What every method's job request sets alike, checked in the order a client reads them."""
        sft_defaults = SFTConfig.from_settings(self.settings)
        defaults = sft_defaults if kind == "supervised" else GRPOConfig()
        lora = kiln.get("lora") or {}
        n_epochs = _choose(hp.get("n_epochs"), defaults.n_epochs, int, 1, 50, "hyperparameters.n_epochs")
        batch_default = defaults.batch_size if kind == "supervised" else defaults.prompts_per_step
        batch_size = _choose(hp.get("batch_size"), batch_default, int, 1, 256, "hyperparameters.batch_size")
        multiplier = _choose(hp.get("learning_rate_multiplier"), 1.0, float, 1e-6, 100,
                             "hyperparameters.learning_rate_multiplier")
        max_rank = self.engine.config.max_lora_rank
        rank = _choose(lora.get("rank"), min(sft_defaults.lora_rank, max_rank), int, 1, max_rank, "kiln.lora.rank")
        alpha = _choose(lora.get("alpha"), 2.0 * rank, float, 1e-6, 1e6, "kiln.lora.alpha")
        modules = lora.get("target_modules") or list(sft_defaults.target_modules)
        if not isinstance(modules, list) or not modules or any(m not in TARGET_MODULES for m in modules):
            raise InvalidRequest(f"kiln.lora.target_modules must be a non-empty list of {', '.join(TARGET_MODULES)}",
                                 code="invalid_hyperparameter", param="kiln.lora.target_modules")
        experts = [m for m in modules if m in EXPERT_MODULES]
        if experts and self.engine.model.config.num_experts and not self.engine.config.lora_experts:
            raise InvalidRequest(f"kiln.lora.target_modules adapts the experts ({', '.join(experts)}), which this "
                                 "server's adapter slots do not hold, so the result could not serve: set [adapters] "
                                 "lora_experts = true", code="invalid_hyperparameter", param="kiln.lora.target_modules")
        base_lr = _choose(kiln.get("learning_rate"), defaults.learning_rate, float, 1e-9, 1.0, "kiln.learning_rate")
        max_seq_len = _choose(kiln.get("max_seq_len"), sft_defaults.max_seq_len, int, 8, 1 << 20, "kiln.max_seq_len")
        checkpoint_every = _choose(kiln.get("checkpoint_every"), self.settings.train.checkpoint_every, int, 1, 1 << 30,
                                   "kiln.checkpoint_every")
        seed = body.get("seed")
        seed = sft_defaults.seed if seed is None else _choose(seed, 0, int, 0, 2**31 - 1, "seed")
        suffix = body.get("suffix")
        if suffix is not None and (not isinstance(suffix, str) or not _SUFFIX.fullmatch(suffix)):
            raise InvalidRequest("suffix must be 1-64 letters, digits, '-' or '_'", param="suffix")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise InvalidRequest("metadata must map strings to strings", param="metadata")
        job_id = new_id("ftjob")
        name = kiln.get("adapter_name") or f"{self.model.model_id}-{suffix or 'ft'}-{job_id[-8:]}"
        validate_name(name)
        gate = self._gate_spec(kiln["gate"]) if kiln.get("gate") is not None else None
        auto_load = kiln.get("auto_load", True)
        if not isinstance(auto_load, bool):
            raise InvalidRequest("kiln.auto_load must be true or false", param="kiln.auto_load")
        return _SharedOptions(
            job_id=job_id, name=name, suffix=suffix, metadata=metadata, seed=seed, gate=gate, auto_load=auto_load,
            checkpoint_every=checkpoint_every, max_seq_len=max_seq_len, batch_size=batch_size, rank=rank,
            modules=modules, sft_defaults=sft_defaults,
            hyperparameters={"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate_multiplier": multiplier},
            common=dict(lora_rank=rank, lora_alpha=alpha, target_modules=tuple(modules),
                        learning_rate=base_lr * multiplier, n_epochs=n_epochs, seed=seed,
                        max_slice_ms=self.settings.train.max_slice_ms))

    def _supervised(self, kind: str, options: dict, hp: dict, kiln: dict, shared: _SharedOptions, training: dict,
                    validation: dict | None) -> _MethodChoice:
        """SFT's config; its data must tokenize and train something."""
        d = shared.sft_defaults
        config = SFTConfig(**shared.common, batch_size=shared.batch_size, max_seq_len=shared.max_seq_len, **{
            k: getattr(d, k) for k in ("gradient_accumulation", "warmup_ratio", "lr_schedule", "weight_decay",
                                       "max_grad_norm", "remat")})
        examples = self._examples(training, config, "training_file")
        if validation:
            self._examples(validation, config, "validation_file")
        return _MethodChoice(config, {"type": kind, kind: {"hyperparameters": shared.hyperparameters}},
                             rows=shared.batch_size, seq_len=min(shared.max_seq_len, max(len(e.ids) for e in examples)),
                             accumulation=config.gradient_accumulation, remat=config.remat)

    def _policy(self, kind: str, options: dict, hp: dict, kiln: dict, shared: _SharedOptions, training: dict,
                validation: dict | None) -> _MethodChoice:
        """GRPO's or distillation's config: the grader or the teacher, the knobs, prompts that fit."""
        section = "grpo" if kind == "reinforcement" else "distillation"
        hyperparameters, extra_bytes = dict(shared.hyperparameters), 0
        rollouts = kiln.get("rollouts", "engine")
        if rollouts not in ("engine", "external") or (rollouts == "external" and kind != "reinforcement"):
            raise InvalidRequest("kiln.rollouts is \"engine\" or, for reinforcement, \"external\"",
                                 param="kiln.rollouts")
        if kind == "reinforcement":
            for key, default, lo, hi, kind_ in (("eval_interval", 10, 1, 1 << 20, int),
                                                ("eval_samples", 1, 1, 64, int),
                                                ("compute_multiplier", 1.0, 0.25, 16, float)):
                hyperparameters[key] = _choose(hp.get(key), default, kind_, lo, hi, f"hyperparameters.{key}")
            grader = options.get("grader")
            if grader is None and rollouts == "external":
                details = {"grader": None}  # the client scores its rollouts
            else:
                details = {"grader": graders.validate(grader, f"method.{kind}.grader").to_json()}
        else:
            teacher = self._teacher(options.get("teacher"), f"method.{kind}.teacher")
            details, extra_bytes = {"teacher": teacher.name}, self._teacher_bytes(teacher)
        config = self._policy_config(GRPOConfig if kind == "reinforcement" else OPDConfig, section,
                                     kiln.get(section) or {}, shared.common, shared.batch_size,
                                     hyperparameters.get("compute_multiplier", 1.0))
        if rollouts == "external":  # no engine logprobs to correct against
            config = dataclasses.replace(config, importance_sampling_cap=0.0)
        agent_fields = self._agent_fields(kiln.get("agent"), kind, rollouts)
        prompts = self._prompts(training, shared.max_seq_len, "training_file")
        if validation:
            self._prompts(validation, shared.max_seq_len, "validation_file")
        seq_len = max(len(p.ids) for p in prompts) + config.max_completion_tokens
        if agent_fields is not None:  # turns, tool results and template between them: up to max_seq_len
            seq_len = max(seq_len, min(shared.max_seq_len, self.engine.max_model_len))
        if seq_len > self.engine.max_model_len:
            raise InvalidRequest(f"the longest prompt ({seq_len - config.max_completion_tokens} tokens) and "
                                 f"max_completion_tokens ({config.max_completion_tokens}) exceed the "
                                 f"{self.engine.max_model_len}-token context", code="invalid_hyperparameter",
                                 param=f"kiln.{section}.max_completion_tokens")
        return _MethodChoice(config, {"type": kind, kind: {**details, "hyperparameters": hyperparameters}},
                             rows=config.micro_batch_rows, seq_len=seq_len, accumulation=1, remat="off",
                             extra_bytes=extra_bytes, rollouts=rollouts, agent=agent_fields)

    def _agent_fields(self, fields: Any, kind: str, rollouts: str) -> dict | None:
        """`kiln.agent`: the Responses fields of a reinforcement job's rollouts when they are
        agent runs (tools required), checked as a run takes them, MCP servers reached now."""
        at = "kiln.agent"
        if fields is None:
            return None
        if kind != "reinforcement" or rollouts != "engine":
            raise InvalidRequest(f"{at} is for reinforcement jobs whose rollouts the engine samples", param=at)
        if not isinstance(fields, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        unknown = sorted(set(fields) - set(AGENT_FIELDS))
        if unknown:
            raise InvalidRequest(f"unknown {at} field {unknown[0]!r}; known: {', '.join(AGENT_FIELDS)}",
                                 param=f"{at}.{unknown[0]}")
        if not isinstance(fields.get("tools"), list) or not fields["tools"]:
            raise InvalidRequest(f"{at}.tools must list the episodes' tools", param=f"{at}.tools")
        agent.check(fields, self.settings.server.mcp_commands, at=at)
        return dict(fields)

    def _policy_config(self, cls, section: str, knobs: dict, common: dict, prompts_per_step: int,
                       compute_multiplier: float) -> GRPOConfig:
        """GRPO's or distillation's own knobs (the `kiln.grpo` or `kiln.distillation` object) on
        top of the job's common settings; a 400 names the knob at fault."""
        at = f"kiln.{section}"
        if not isinstance(knobs, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        known = GRPO_KNOBS + (("jsd_beta", "jsd_coef") if cls is OPDConfig else ("overlap_rollouts",))
        unknown = sorted(set(knobs) - set(known))
        if unknown:
            raise InvalidRequest(f"unknown {at} setting {unknown[0]!r}; known: {', '.join(known)}",
                                 code="invalid_hyperparameter", param=f"{at}.{unknown[0]}")
        if "max_completion_tokens" not in knobs:  # the default, within what the engine's context allows
            knobs = {**knobs, "max_completion_tokens": min(cls.max_completion_tokens, self.engine.max_model_len // 2)}
        generations = knobs.get("num_generations", max(cls.num_generations // 4,
                                                       round(cls.num_generations * compute_multiplier)))
        for key, value in knobs.items():
            default = getattr(cls, key)
            expected = float if default is None else type(default)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = {float: number, int: number and float(value).is_integer(), bool: isinstance(value, bool),
                  str: isinstance(value, str)}[expected]
            if not ok:
                raise InvalidRequest(f"{at}.{key} must be {_KIND_NAMES[expected]}, got {value!r}",
                                     code="invalid_hyperparameter", param=f"{at}.{key}")
        try:
            config = cls(**common, prompts_per_step=prompts_per_step, **{
                **knobs, "num_generations": int(generations),
                **{k: int(v) for k, v in knobs.items() if type(getattr(cls, k)) is int}})
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"{at}: {exc}", code="invalid_hyperparameter", param=at) from None
        for key, lo, hi in (("max_completion_tokens", 1, self.engine.max_model_len - 1), ("num_generations", 1, 256),
                            ("epsilon", 0.0, 10.0), ("beta", 0.0, 100.0), ("num_iterations", 1, 16),
                            ("temperature", 1e-3, 10.0), ("top_p", 1e-3, 1.0), ("importance_sampling_cap", 0.0, 1e6),
                            ("micro_batch_rows", 1, 256)):
            if not lo <= getattr(config, key) <= hi:
                raise InvalidRequest(f"{at}.{key} must be from {lo:g} to {hi:g}", code="invalid_hyperparameter",
                                     param=f"{at}.{key}")
        return config

    def _teacher(self, teacher, param: str) -> Teacher:
        """The distillation teacher a job names: this server's base model, a loaded adapter, or a
        model of `train.teachers` (loaded into this process on first use, kept for later jobs;
        it must share the base model's tokenizer)."""
        if teacher in (None, "", self.model.model_id):
            return Teacher.base(self.model)
        models = self._teacher_paths()
        if isinstance(teacher, str) and teacher in models:
            loaded = self._teacher_model(teacher, models[teacher], param)
            try:
                return Teacher.model(self.model, loaded)
            except InvalidRequest as exc:
                raise InvalidRequest(str(exc), code=exc.code, param=param) from None
        adapter = self.registry.get(teacher) if isinstance(teacher, str) else None
        if adapter is None:
            choices = ", ".join(repr(m) for m in models) or "none configured"
            raise InvalidRequest(f"the teacher must be the base model {self.model.model_id!r}, a loaded adapter or a "
                                 f"teacher model of train.teachers ({choices}); got {teacher!r}",
                                 code="model_not_found", param=param)
        return Teacher.adapter(self.model, adapter.weights)

    def _teacher_model(self, name: str, path: str, param: str):
        """A `train.teachers` model, loaded into this process on first use and kept."""
        with self._cv:
            loaded = self._teacher_models.get(name)
        if loaded is not None:
            return loaded
        from kiln.models.loader import load_model

        try:
            loaded = load_model(path, show_progress=False, model_id=name)
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"the teacher model {name!r} ({path}) cannot be loaded: {exc}",
                                 code="model_not_found", param=param) from None
        with self._cv:  # two jobs loading it at once keep the first
            return self._teacher_models.setdefault(name, loaded)

    def _teacher_paths(self) -> dict[str, str]:
        name_path = (entry.partition("=") for entry in self.settings.train.teachers)
        return {name.strip(): path.strip() for name, _, path in name_path if name.strip() and path.strip()}

    def _teacher_bytes(self, teacher: Teacher) -> int:
        """Weights a teacher adds to what serving holds (none for the base model or an adapter)."""
        return memory.tree_bytes(teacher.params) if teacher.params is not self.model.params else 0

    def _gate_spec(self, gate):
        if self.evals is None:
            raise InvalidRequest("this Kiln runs no evals, so a job cannot have a gate", param="kiln.gate")
        if not self.settings.serving_profile.policy.inference_admission:
            raise AdmissionRejected("a gated job evaluates its adapter, and the maintenance serving profile admits no "
                                    "evaluation", code="inference_disabled_by_profile")
        return parse_gate(gate, self.evals, self.model.model_id, lambda name: self.registry.get(name) is not None)

    def get(self, job_id: str) -> dict:
        job = self.store.get_job(job_id)
        if job is None:
            raise NotFound(f"no fine-tuning job {job_id!r}", code="job_not_found", param="fine_tuning_job_id")
        return job

    def list(self, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        jobs = self.store.list_jobs()
        if after:
            ids = [j["id"] for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def cancel(self, job_id: str) -> dict:
        return self._control(job_id, "cancel")

    def pause(self, job_id: str) -> dict:
        return self._control(job_id, "pause")

    def resume(self, job_id: str) -> dict:
        with self._cv:
            job = self.get(job_id)
            if job["status"] != "paused":
                raise InvalidRequest(f"job {job_id} is {job['status']}, not paused", code="invalid_job_state")
            self._set(job, status="queued")
            self.store.add_event(job_id, "Fine-tuning job resumed")
            self._cv.notify_all()
        return self.get(job_id)

    def shutdown(self) -> None:
        """Stops the worker; a running job checkpoints and resumes when Kiln starts again."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=600)

    def snapshot(self) -> dict:
        """Jobs now: the running one (with its planned bytes) and the queue, oldest first."""
        queued = [j["id"] for j in reversed(self.store.list_jobs(("queued",)))]
        running = self.store.get_job(self.current) if self.current else None
        training_bytes = 0
        if running:
            plan = running["kiln"]["plan"]
            training_bytes = plan["required_bytes_remat" if plan["remat"] else "required_bytes"]
        return {"running": running["id"] if running else None, "queued": queued, "training_bytes": training_bytes}

    # ---- internals ---------------------------------------------------------------------------

    def _input_file(self, file_id, param: str) -> dict:
        file = self.store.get_file(file_id) if isinstance(file_id, str) else None
        if file is None:
            raise InvalidRequest(f"no file {file_id!r}", code="file_not_found", param=param)
        if file["purpose"] != "fine-tune":
            raise InvalidRequest(f"file {file_id} has purpose {file['purpose']!r}, not 'fine-tune'", param=param)
        return file

    def _prompts(self, file: dict, max_prompt_len: int, param: str):
        return self._read(file, param, lambda content, what: load_prompts(content, self.model.tokenizer,
                                                                          max_prompt_len, what))

    def _examples(self, file: dict, config: SFTConfig, param: str):
        return self._read(file, param, lambda content, what: load_examples(content, self.model.tokenizer,
                                                                           config.max_seq_len, what))

    def _read(self, file: dict, param: str, load):
        """A stored input file through `load(content, what)`; a DataError names `param`."""
        what = "training file" if param == "training_file" else "validation file"
        try:
            return load(self.store.file_content(file["id"]), f"{what} {file['id']}")
        except DataError as exc:
            raise exc.with_param(param) from None

    def _set(self, job: dict, **changes) -> dict:
        job.update(changes)
        self.store.put_job(job)
        return job

    def _control(self, job_id: str, action: str) -> dict:
        with self._cv:
            job = self.get(job_id)
            if job["status"] in FINAL:
                raise InvalidRequest(f"job {job_id} has already {job['status']}", code="invalid_job_state")
            if job["status"] == "running" or job_id == self.current:
                self._flags[job_id] = action  # the worker acts at the next step boundary
            elif action == "cancel":
                self._cancelled(job, "Fine-tuning job cancelled")  # a paused job's checkpoints go too
            elif job["status"] == "queued":
                self._set(job, status="paused")
                self.store.add_event(job_id, "Fine-tuning job paused")
        return self.get(job_id)

    def _cancelled(self, job: dict, message: str) -> None:
        """The one way a job ends cancelled: its status, the event, its checkpoints removed."""
        self._set(job, status="cancelled", finished_at=now())
        self.store.add_event(job["id"], message)
        self._remove_checkpoints(job["id"])

    def _interrupted(self, job_id: str, action: str | None = None) -> bool:
        """Whether a shutdown, or a control (`action`, or any), waits for the job."""
        with self._cv:
            return self._stopping or (job_id in self._flags if action is None else self._flags.get(job_id) == action)

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self.store.list_jobs(("queued",)):
                    self._cv.wait(timeout=5)
                if self._stopping:
                    return
                job = self.store.list_jobs(("queued",))[-1]  # oldest first
                self.current = job["id"]
            try:
                self._run(job)
            except KilnError as exc:
                self._fail(job, exc.code or "job_failed", exc.message)
            except Exception as exc:  # a bug or a device failure: the job fails, the worker lives
                log.exception("fine-tuning job %s failed", job["id"])
                if is_device_loss(exc):  # the process serves nothing more either
                    self.engine.report_device_loss(exc)
                    self._fail(job, "device_lost", as_device_lost(exc).message)
                else:
                    self._fail(job, "internal_error", f"{type(exc).__name__}: {exc}")
            finally:
                self.current = None
                self._reclaim()

    def _reclaim(self) -> None:
        """Allocator reclaim after a job: its params, optimizer state and compiled steps are
        dropped with the run; on the CPU, glibc then returns the freed heap to the system."""
        import ctypes
        import gc

        with self.engine.ownership.write("allocator reclaim"):
            gc.collect()
            if jax.default_backend() == "cpu":
                try:
                    ctypes.CDLL("libc.so.6").malloc_trim(0)
                except (OSError, AttributeError):  # not glibc
                    pass

    def _fail(self, job: dict, code: str, message: str) -> None:
        self._set(job, status="failed", finished_at=now(), error={"code": code, "message": message, "param": None})
        self.store.add_event(job["id"], f"Fine-tuning job failed: {message}", level="error")

    def _job_dir(self, job_id: str) -> Path:
        """A job's own directory: its checkpoints while it runs, its TensorBoard event files."""
        return self.store.root / "jobs" / job_id

    def _checkpoint_dir(self, job_id: str) -> Path:
        return self._job_dir(job_id) / "checkpoints"

    def _remove_checkpoints(self, job_id: str) -> None:
        """A job's checkpoints, and its directory when nothing else (event files) is left there."""
        shutil.rmtree(self._checkpoint_dir(job_id), ignore_errors=True)
        try:
            self._job_dir(job_id).rmdir()
        except OSError:  # not empty, or never made
            pass

    def _run(self, job: dict) -> None:
        import orbax.checkpoint as ocp

        job_id, spec = job["id"], JobSpec.from_job(job)
        event = functools.partial(self.store.add_event, job_id)
        run = self._make_run(spec)
        manager = ocp.CheckpointManager(self._checkpoint_dir(job_id).absolute(),
                                        options=ocp.CheckpointManagerOptions(max_to_keep=2))
        shrunk, board = False, TensorBoard(None)
        try:
            if spec.kv_resize_to:
                shrunk = self.share.shrink_kv(spec.kv_resize_to, lambda: self._interrupted(job_id), event)
            if manager.latest_step() is not None:
                run.restore(manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(run.state())))
                self.store.add_event(job_id, f"Resumed from the checkpoint at step {run.step}")
            # an earlier attempt's points after the checkpoint are hidden: its steps are taken again
            board = TensorBoard(job_log_dir(self.settings, self._job_dir(job_id), job_id), purge_step=run.step + 1)
            job["kiln"]["total_steps"] = run.total_steps
            self._set(job, status="running")
            self.store.add_event(job_id, "Fine-tuning job started")
            if not self._train(job, spec, run, manager, board):
                return
            if shrunk:  # before the job reads as finished
                self.share.grow_kv(event)
                shrunk = False
            if spec.gate and not self._finish_gated(job, run, manager, board):
                return
            if not spec.gate:
                self._finish(job, run, board)
        finally:
            board.close()
            manager.close()
            with self._cv:  # submitted rollouts the job will not take
                for _, _, future in self._submissions.pop(job_id, []):
                    future.set_exception(InvalidRequest(f"job {job_id} stopped before taking these rollouts",
                                                        code="job_not_active", param="fine_tuning_job_id"))
            run.close()
            if shrunk:
                self.share.grow_kv(event)

    def _train(self, job: dict, spec: JobSpec, run: TrainingRun, manager, board: TensorBoard) -> bool:
        """Advances the run to its end, a step at a time between serving steps, acting on a
        cancel, pause or shutdown at each boundary, each step's metrics an event and TensorBoard
        points; False if one stopped it."""
        job_id = job["id"]

        def stop() -> bool:
            with self._cv:
                action = self._flags.pop(job_id, None)
                stopping = self._stopping
            if action == "cancel":
                self._cancelled(job, "Fine-tuning job cancelled")
                return True
            if action == "pause" or stopping:
                self._save_checkpoint(manager, run, job, None)
                if action == "pause":
                    self._set(job, status="paused")
                    self.store.add_event(job_id, f"Fine-tuning job paused at step {run.step}")
                return True  # on shutdown the job stays running: it resumes at the next start
            return False

        def on_step(metrics: dict) -> None:
            job["kiln"]["step"] = metrics["step"]
            self._set(job, trained_tokens=run.trained_tokens)
            self.store.add_event(job_id, f"Step {metrics['step']}/{run.total_steps}: {run.summary(metrics)}",
                                 type_="metrics", data={**metrics, "total_steps": run.total_steps})
            board.step(metrics)
            if run.step % spec.checkpoint_every == 0 and not run.done:
                self._save_checkpoint(manager, run, job, metrics)

        # (advance compiles outside ownership, then takes it a slice at a time, taking turns with serving)
        return advance_to_end(run, self.engine.ownership, stop=stop, on_step=on_step,
                              share=self.settings.train.serving_share)

    def _make_run(self, spec: JobSpec) -> TrainingRun:
        """The job's run: each method builds its own (`_RUNS`)."""
        return _RUNS[spec.method](self, spec)

    def _input(self, spec: JobSpec, purpose: str, read):
        """A job's training or validation data through `read(file, param)`; None without it."""
        file_id = spec.inputs.get(purpose)
        return read(self.store.get_file(file_id), f"{purpose}_file") if file_id else None

    def _sft_run(self, spec: JobSpec) -> SFTRun:
        def read(file, param):
            return self._examples(file, spec.config, param)

        return SFTRun(self.model.params, self.model.config, self._input(spec, "training", read), spec.config,
                      self._input(spec, "validation", read), remat=spec.remat, name=spec.id)

    def _policy_run(self, spec: JobSpec, make) -> GRPORun:
        """A GRPO or distillation run: make(ids, items, name) on the job's prompts; the
        validation prompts are what a reinforcement run's reward is measured on."""
        def read(file, param):
            return self._prompts(file, spec.max_seq_len, param)

        prompts = self._input(spec, "training", read)
        run = make([p.ids for p in prompts], [p.item for p in prompts], f"{spec.adapter_name}:training")
        run.validation = self._input(spec, "validation", read)
        run.eval_interval, run.eval_samples = spec.eval_interval, spec.eval_samples
        return run

    def _grpo_run(self, spec: JobSpec) -> GRPORun:
        cls, extra = ((SubmittedRolloutsRun, {"take": lambda: self._take_submission(spec.id)})
                      if spec.rollouts == "external" else (GRPORun, {}))

        def make(ids, items, name):
            reward = as_reward(spec.grader, self.judge) if spec.grader is not None else None
            if spec.agent is not None:  # the grader sees each episode's answer, calls and output items
                fields = {k: v for k, v in spec.agent.items() if k != "tools"}
                return AgentGRPORun(self.engine, items, spec.agent["tools"], spec.config, reward=reward, name=name,
                                    fields={**fields, "mcp_commands": self.settings.server.mcp_commands})
            return cls(self.engine, ids, items, reward, spec.config, name=name, **extra)

        return self._policy_run(spec, make)

    def _opd_run(self, spec: JobSpec) -> OPDRun:
        def make(ids, items, name):
            teacher = self._teacher(spec.teacher, "method.distillation.teacher")
            return OPDRun(self.engine, ids, teacher, spec.config, name=name, items=items)

        return self._policy_run(spec, make)

    def submit_rollouts(self, job_id: str, body: dict, timeout: float = 600.0) -> dict:
        """Scored rollouts for a reinforcement job with `kiln.rollouts = "external"`: one training
        step on them, taken by the job at its next step; returns the step's metrics. `final`
        ends the job after this step (its adapter is saved as usual)."""
        job = self.get(job_id)
        if job["kiln"].get("rollouts") != "external":
            raise InvalidRequest(f"job {job_id} samples its own rollouts; scored rollouts go to a reinforcement job "
                                 "created with kiln.rollouts = \"external\"", param="fine_tuning_job_id")
        if job["status"] not in ("queued", "running"):
            raise InvalidRequest(f"job {job_id} is {job['status']}", code="job_not_active", param="fine_tuning_job_id")
        groups = body.get("groups")
        if not isinstance(groups, list) or not groups:
            raise InvalidRequest("groups must be a non-empty list", param="groups")
        parsed = [self._scored_group(g, f"groups[{i}]") for i, g in enumerate(groups)]
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._submissions.setdefault(job_id, []).append((parsed, bool(body.get("final")), future))
            self._cv.notify_all()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise InvalidRequest(f"job {job_id} did not take the rollouts within {timeout:.0f} s",
                                 code="job_busy", param="fine_tuning_job_id") from None

    def _scored_group(self, group, at: str) -> list[Rollout]:
        if not isinstance(group, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        try:
            prompt = encode_prompt({k: v for k, v in group.items() if k in ("prompt", "messages", "tools")},
                                   self.model.tokenizer, self.engine.max_model_len - 1, at)
        except DataError as exc:
            raise InvalidRequest(exc.message, param=at) from None
        completions = group.get("completions")
        if not isinstance(completions, list) or len(completions) < 2:
            raise InvalidRequest(f"{at}.completions must list at least two scored completions (advantages are "
                                 "relative to the group)", param=f"{at}.completions")
        out, eos = [], self.model.tokenizer.eos_token_id
        for j, c in enumerate(completions):
            where = f"{at}.completions[{j}]"
            reward = c.get("reward") if isinstance(c, dict) else None
            if not isinstance(c, dict) or not isinstance(c.get("text"), str) or not isinstance(
                    reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
                raise InvalidRequest(f"{where} must be {{\"text\": string, \"reward\": number}}", param=where)
            truncated = bool(c.get("truncated", False))
            ids = self.model.tokenizer.encode(c["text"], add_special_tokens=False)
            ids = ids + ([eos] if eos is not None and not truncated else [])
            if not ids or len(prompt.ids) + len(ids) > self.engine.max_model_len:
                raise InvalidRequest(f"{where}: empty, or longer than the context", param=where)
            out.append(Rollout(prompt.ids, ids, None, truncated, float(reward), c["text"]))
        return out

    def _take_submission(self, job_id: str):
        """The next submitted batch of scored rollouts (groups, final, future); None after a
        short wait while none waits."""
        with self._cv:
            waiting = self._submissions.get(job_id)
            if not waiting:
                self._cv.wait(timeout=0.5)
                return None
            return waiting.pop(0)

    def judge(self, model: str, messages: list[dict], params: dict):
        """Model graders' judge: a model this process serves, the base or a loaded adapter."""
        from kiln.graders.engine_judge import engine_judge

        def adapter_weights(name: str):
            if name in (None, "", self.model.model_id):
                return None
            adapter = self.registry.get(name)
            if adapter is None:
                raise NotFound(f"The model `{name}` does not exist.", code="model_not_found", param="model")
            return adapter.weights

        return engine_judge(self.engine, adapter_weights)(model, messages, params)

    def _save_checkpoint(self, manager, run, job: dict, metrics: dict | None) -> None:
        import orbax.checkpoint as ocp

        with self.engine.ownership.write(f"checkpoint {job['id']}"):
            manager.save(run.micro_step, args=ocp.args.StandardSave(run.state()), force=True)
            manager.wait_until_finished()
        if metrics is not None:
            name = job["kiln"]["adapter_name"]
            self.store.add_checkpoint(job["id"], {
                "id": new_id("ftckpt"), "object": "fine_tuning.job.checkpoint", "created_at": now(),
                "fine_tuned_model_checkpoint": f"{name}:step-{run.step}", "fine_tuning_job_id": job["id"],
                "step_number": run.step,
                "metrics": {k: float(metrics[k]) for k in ("train_loss", "train_mean_token_accuracy", "valid_loss",
                                                           "valid_mean_token_accuracy", "reward_mean",
                                                           "valid_reward_mean", "reverse_kl") if k in metrics}
                | {"step": float(run.step)}})
            self.store.add_event(job["id"], f"Checkpoint created at step {run.step}")

    def _finish_gated(self, job: dict, run, manager, board: TensorBoard) -> bool:
        """The gate, then the finish; False if a cancel or a shutdown stopped the gate. The final
        state is checkpointed first, so a restart resumes straight at the gate."""
        job_id = job["id"]
        if manager.latest_step() != run.micro_step:
            self._save_checkpoint(manager, run, job, None)

        try:
            self._finish(job, run, board, lambda: self._interrupted(job_id, "cancel"))
        except GateStopped:
            with self._cv:
                cancelled = self._flags.pop(job_id, None) == "cancel"
            if cancelled:
                self._cancelled(job, "Fine-tuning job cancelled during its gate")
            return False
        return True

    def _run_gate(self, job: dict, manifest, weights, stopped) -> GateResult:
        spec = job["kiln"]
        if not self.settings.serving_profile.policy.inference_admission:  # resumed into maintenance
            return GateResult(False, ["the maintenance serving profile admits no evaluation"], None, None, [])
        candidate = AdapterWeights(spec["adapter_name"], f"gate-{job['id']}", weights, manifest.scale, manifest.rank)
        gate = Gate(GateSpec.from_json(spec["gate"]), self.evals, self.model.model_id, job["id"])
        try:
            return gate.evaluate(spec["adapter_name"], candidate, stopped,
                                 lambda message: self.store.add_event(job["id"], message))
        finally:
            self.engine.retire_adapter(candidate).result()  # its slot frees once its requests end

    def _finish(self, job: dict, run, board: TensorBoard, stopped=lambda: False) -> None:
        """Saves the adapter (after the gate, if any: its numbers go to `board` too), loads it unless
        the gate failed or auto_load is off, and ends the job succeeded, its event files closed."""
        spec = job["kiln"]
        inputs = [{"purpose": purpose, "file_id": job[f"{purpose}_file"],
                   "sha256": self.store.get_file(job[f"{purpose}_file"])["sha256"]}  # digested at upload
                  for purpose in ("training", "validation") if job[f"{purpose}_file"]]
        manifest = run.manifest(spec["adapter_name"], self.model, inputs,
                                {"job_id": job["id"], "started_at": job["created_at"], "finished_at": now()})
        weights = run.weights()
        gate = None
        if spec["gate"]:
            gate = self._run_gate(job, manifest, weights, stopped)
            spec["gate_result"] = gate.to_json()
            board.gate(spec["gate_result"], run.step)
            manifest = msgspec.structs.replace(manifest, eval_results={
                **(manifest.eval_results or {}), "gate": {**spec["gate"], **gate.to_json()}})
        artifact = self.registry.store.save(manifest, weights)
        self.store.add_event(job["id"], f"New fine-tuned model created: {artifact.name} (version {artifact.version})")
        if gate is not None and gate.passed:
            self.store.add_event(job["id"], f"Gate passed on eval {spec['gate']['eval_id']}")
        elif gate is not None:
            self.store.add_event(job["id"], f"Gate failed: {'; '.join(gate.reasons)}. The adapter {artifact.name} "
                                            "stays in the store and is not loaded", level="warn")
        if spec["auto_load"] and (gate is None or gate.passed):
            self.registry.load(artifact.name, replace=self.registry.get(artifact.name) is not None)
            self.store.add_event(job["id"], f"Adapter {artifact.name} loaded for serving")
        self._remove_checkpoints(job["id"])
        board.close()  # every point is on disk once the job reads as succeeded
        with self._cv:
            self._flags.pop(job["id"], None)  # a pause asked for during the gate comes too late
        self._set(job, status="succeeded", finished_at=now(), fine_tuned_model=artifact.name,
                  trained_tokens=run.trained_tokens)
        self.store.add_event(job["id"], "The job has successfully completed")


_RUNS = {"supervised": JobManager._sft_run, "reinforcement": JobManager._grpo_run,
         "distillation": JobManager._opd_run}
