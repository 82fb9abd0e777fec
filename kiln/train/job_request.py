"""A fine-tuning job request, checked: OpenAI's `fine_tuning.job` body (with Kiln's `kiln` object)
becomes the job to store, or a 400 naming the field at fault before anything is stored; the
typed `JobSpec` a job's worker reads back from a stored job; and the checks of the scored
rollouts a client submits to a reinforcement job. The worker that runs jobs is kiln.train.jobs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from typing import Any

from kiln import agent, graders
from kiln.adapters.manifest import validate_name
from kiln.errors import AdmissionRejected, DataError, InvalidRequest
from kiln.eval.gate import GateSpec, parse_gate
from kiln.models.lora import EXPERT_MODULES, TARGET_MODULES
from kiln.train import memory
from kiln.train.data import encode_prompt, load_examples, load_prompts
from kiln.train.grpo import GRPOConfig, Rollout
from kiln.train.opd import OPDConfig, Teacher
from kiln.train.sft import SFTConfig
from kiln.train.store import TrainingStore, new_id, now

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
    """A job request's options every method shares, checked (see JobRequests._shared_options)."""

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


class JobRequests:
    """Checks job requests against this server: its base model and engine, settings, loaded
    adapters (`registry`), stored files, evals (for a gate) and what serving holds (`share`)."""

    def __init__(self, settings, engine, registry, store: TrainingStore, share, evals=None):
        self.settings, self.engine, self.registry, self.store = settings, engine, registry, store
        self.share, self.evals = share, evals
        self.model = engine.model
        self._lock = threading.Lock()
        self._teacher_models: dict[str, object] = {}  # train.teachers loaded so far, by name

    def check(self, body: dict) -> dict:
        """The job a request describes, in OpenAI's shape with its `kiln` object, status queued:
        the options every method shares, then the method's own, then the memory plan."""
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
        examples = self.examples(training, config, "training_file")
        if validation:
            self.examples(validation, config, "validation_file")
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
            teacher = self.teacher(options.get("teacher"), f"method.{kind}.teacher")
            details, extra_bytes = {"teacher": teacher.name}, self._teacher_bytes(teacher)
        config = self._policy_config(GRPOConfig if kind == "reinforcement" else OPDConfig, section,
                                     kiln.get(section) or {}, shared.common, shared.batch_size,
                                     hyperparameters.get("compute_multiplier", 1.0))
        if rollouts == "external":  # no engine logprobs to correct against
            config = dataclasses.replace(config, importance_sampling_cap=0.0)
        agent_fields = self._agent_fields(kiln.get("agent"), kind, rollouts)
        prompts = self.prompts(training, shared.max_seq_len, "training_file")
        if validation:
            self.prompts(validation, shared.max_seq_len, "validation_file")
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

    def teacher(self, teacher, param: str) -> Teacher:
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
        with self._lock:
            loaded = self._teacher_models.get(name)
        if loaded is not None:
            return loaded
        from kiln.models.loader import load_model

        try:
            loaded = load_model(path, show_progress=False, model_id=name)
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"the teacher model {name!r} ({path}) cannot be loaded: {exc}",
                                 code="model_not_found", param=param) from None
        with self._lock:  # two jobs loading it at once keep the first
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

    def _input_file(self, file_id, param: str) -> dict:
        file = self.store.get_file(file_id) if isinstance(file_id, str) else None
        if file is None:
            raise InvalidRequest(f"no file {file_id!r}", code="file_not_found", param=param)
        if file["purpose"] != "fine-tune":
            raise InvalidRequest(f"file {file_id} has purpose {file['purpose']!r}, not 'fine-tune'", param=param)
        return file

    def prompts(self, file: dict, max_prompt_len: int, param: str):
        """A policy job's prompts from a stored file; a 400 names `param` (the file's field)."""
        return self._read(file, param, lambda content, what: load_prompts(content, self.model.tokenizer,
                                                                          max_prompt_len, what))

    def examples(self, file: dict, config: SFTConfig, param: str):
        """A supervised job's examples from a stored file; a 400 names `param` (the file's field)."""
        return self._read(file, param, lambda content, what: load_examples(content, self.model.tokenizer,
                                                                           config.max_seq_len, what))

    def _read(self, file: dict, param: str, load):
        """A stored input file through `load(content, what)`; a DataError names `param`."""
        what = "training file" if param == "training_file" else "validation file"
        try:
            return load(self.store.file_content(file["id"]), f"{what} {file['id']}")
        except DataError as exc:
            raise exc.with_param(param) from None

    def scored_group(self, group, at: str) -> list[Rollout]:
        """One group of a rollouts submission (`at` names it): a prompt and at least two scored
        completions, tokenized, each within the context."""
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
