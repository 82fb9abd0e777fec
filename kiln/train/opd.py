"""On-policy distillation: a student LoRA adapter learns from a teacher on its own samples.

The student samples completions through the serving engine (like GRPO's policy). The teacher
scores each sampled token; the per-token reverse KL, log p_student - log p_teacher, negated and
held constant, is that token's advantage in the shared clipped policy-gradient loss, so the
student moves towards the teacher exactly where its own samples disagree with it. Optionally
(`jsd_beta`), the loss adds the generalized JSD between the two full next-token distributions
at every sampled position (GKD's; `jsd_beta` 0 is forward KL, 1 reverse KL).

The teacher is the base model (the student's adapter off), another adapter of the same base,
or another model loaded in this process that shares the student's tokenizer; any other
teacher is refused, since its logprobs would be of other tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from kiln.errors import InvalidRequest
from kiln.models.config import ModelConfig
from kiln.train import losses
from kiln.train.grpo import GRPOConfig, GRPORun, RolloutBatch, completion_logprobs, make_policy_steps


@dataclasses.dataclass(frozen=True)
class OPDConfig(GRPOConfig):
    num_generations: int = 4  # samples per prompt; advantages are per token, so 1 works too
    jsd_beta: float | None = None  # None: the reverse-KL advantage alone
    jsd_coef: float = 1.0
    baseline: bool = True  # subtract the batch's mean reverse KL from the per-token advantages

    def __post_init__(self):
        if self.num_generations < 1:
            raise ValueError("num_generations must be at least 1")
        if self.jsd_beta is not None and not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError("jsd_beta must be from 0 to 1")
        if self.loss_type not in ("grpo", "dr_grpo", "dapo", "bnpo"):
            raise ValueError("loss_type must be one of grpo, dr_grpo, dapo, bnpo")


@dataclasses.dataclass
class Teacher:
    """Whose logprobs the student learns: params and config of a model, with an optional LoRA."""

    name: str
    params: dict
    cfg: ModelConfig
    lora: dict | None = None
    scale: float = 1.0

    @classmethod
    def base(cls, model) -> Teacher:
        """The student's own base model, adapter off."""
        return cls(model.model_id, model.params, model.config)

    @classmethod
    def adapter(cls, model, weights) -> Teacher:
        """An adapter of the student's base model (`AdapterWeights`)."""
        lora = jax.tree.map(lambda x: jax.numpy.asarray(x, jax.numpy.float32), weights.weights)
        return cls(weights.name, model.params, model.config, lora, weights.scale)

    @classmethod
    def model(cls, student_model, teacher_model) -> Teacher:
        """Another model in this process; it must share the student's tokenizer."""
        check_same_tokenizer(student_model, teacher_model)
        return cls(teacher_model.model_id, teacher_model.params, teacher_model.config)


def check_same_tokenizer(student_model, teacher_model) -> None:
    a, b = student_model.tokenizer.tokenizer, teacher_model.tokenizer.tokenizer
    if a.get_vocab(with_added_tokens=True) != b.get_vocab(with_added_tokens=True):
        raise InvalidRequest(f"the teacher {teacher_model.model_id!r} does not share the student's tokenizer "
                             f"({student_model.model_id!r}): distillation compares logprobs of the same tokens",
                             code="teacher_tokenizer_mismatch", param="teacher")


class OPDRun(GRPORun):
    """One on-policy distillation run: GRPO's machinery (rollouts from the engine on the student
    adapter, micro-batches, the loss core, publishing each step's weights), with advantages
    from the teacher instead of a reward."""

    kind = "opd"
    method = "distillation"

    def __init__(self, engine, prompts: list[list[int]], teacher: Teacher, config: OPDConfig,
                 name: str = "opd-student", items: list[Any] | None = None):
        if teacher.cfg.vocab_size != engine.model.config.vocab_size:
            raise InvalidRequest("the teacher's vocabulary differs from the student's", param="teacher",
                                 code="teacher_tokenizer_mismatch")
        super().__init__(engine, prompts, items or [None] * len(prompts), None, config, name)
        self.teacher = teacher
        self._set_steps(make_policy_steps(self.cfg, self.tx, config, teacher.cfg, teacher.scale, self.placement))
        self._jitted["teacher"] = jax.jit(lambda lora, params, batch: completion_logprobs(
            params, lora, batch, teacher.cfg, teacher.scale, config.temperature))

    def _teacher_arg(self):
        return (self.teacher.params, self.teacher.lora) if self.config.jsd_beta is not None else None

    def _with_logprobs(self, batches: list[RolloutBatch], lock) -> tuple[list[RolloutBatch], dict]:
        """Per-token advantages teacher - student logprob (the student's: the engine's, of the
        tokens it sampled); metric `reverse_kl`, their negated weighted mean."""
        t = self.teacher
        steps = [self._compiled("teacher", t.lora, b, params=t.params) for b in batches]
        teacher = []
        for i, (step, b) in enumerate(zip(steps, batches, strict=True)):  # a write per micro-batch
            with lock(f"opd {self.name}: teacher logprobs, batch {i + 1}"):
                teacher.append(np.asarray(step(t.lora, t.params, b)))
        gaps = [np.where(b.loss_weight > 0, losses.reverse_kl(b.sampler_logprobs, lp), 0.0)
                for b, lp in zip(batches, teacher, strict=True)]
        weight = max(sum(float(np.sum(b.loss_weight)) for b in batches), 1e-9)
        reverse_kl = sum(float(np.sum(g * b.loss_weight)) for g, b in zip(gaps, batches, strict=True)) / weight
        # the batch's mean gap is subtracted as a baseline: unbiased (it does not depend on which
        # token was sampled), and without it every sampled token is pushed down at once
        baseline = reverse_kl if self.config.baseline else 0.0
        out = [b._replace(advantages=np.where(b.loss_weight > 0, baseline - g, 0.0).astype(np.float32))
               for g, b in zip(gaps, batches, strict=True)]
        return out, {"reverse_kl": reverse_kl}

    def advance(self, ownership=None) -> dict:
        """Sample from the student, score with the teacher, train: one distillation step."""
        t0 = time.perf_counter()
        groups = self.sample(self.step_prompts())
        t1 = time.perf_counter()
        metrics = self._train_timed(groups, ownership, t0)
        if metrics is None:
            return None
        metrics["rollout_seconds"] = t1 - t0
        for key in ("reward_mean", "reward_std"):
            metrics.pop(key, None)
        return metrics

    def summary(self, metrics: dict) -> str:
        return f"reverse KL to the teacher={metrics['reverse_kl']:.4f}"

    def _manifest_config(self) -> dict:
        return {**self.config.to_json(), "teacher": self.teacher.name}


def resolve_teacher(teacher, model) -> Teacher:
    """The teacher `distill` is given: None or "base" (the base model), a Teacher, adapter
    weights (`AdapterWeights`), a store artifact or adapter directory (an adapter of the
    student's base model), or another LoadedModel sharing the student's tokenizer."""
    from kiln.adapters.registry import artifact_weights, check_fits
    from kiln.adapters.store import Artifact, read_artifact
    from kiln.engine.lora_slots import AdapterWeights
    from kiln.models.loader import LoadedModel

    if teacher is None or teacher == "base":
        return Teacher.base(model)
    if isinstance(teacher, Teacher):
        return teacher
    if isinstance(teacher, AdapterWeights):
        return Teacher.adapter(model, teacher)
    if isinstance(teacher, LoadedModel):
        return Teacher.model(model, teacher)
    artifact = teacher if isinstance(teacher, Artifact) else read_artifact(teacher)
    check_fits(artifact.manifest, model, artifact.manifest.rank)
    return Teacher.adapter(model, artifact_weights(artifact))


def distill(data, teacher=None, name: str | None = None, *, model=None, engine=None, config: OPDConfig | None = None,
            store=None, progress: bool = True, save: bool = True, settings=None, max_prompt_len: int = 1024,
            **overrides):
    """Trains a student LoRA adapter by on-policy distillation in this process and saves it.

    data: prompts, as for `grpo` (JSONL of `{"messages": [...]}` or `{"prompt": "..."}`).
    teacher: see `resolve_teacher` (default: the base model). Keyword overrides replace
    OPDConfig fields. Returns a GRPOResult (metrics history with `reverse_kl`, the artifact,
    the run)."""
    from kiln.train.artifact import default_adapter_name
    from kiln.train.grpo import train_policy

    config = dataclasses.replace(config or OPDConfig(), **overrides)

    def make_run(engine, name, prompts):
        return OPDRun(engine, [p.ids for p in prompts], resolve_teacher(teacher, engine.model), config, name=name,
                      items=[p.item for p in prompts])

    return train_policy(make_run, data, name or default_adapter_name("opd"), config, model=model, engine=engine,
                        store=store, progress=progress, save=save, settings=settings, max_prompt_len=max_prompt_len)
