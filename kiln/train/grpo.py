"""GRPO: group-relative policy optimisation of a LoRA adapter, with rollouts from the serving
engine in this process.

Each step samples G completions for each of a few prompts from the live engine (the policy is
an adapter in a LoRA slot; the G samples share the prompt's KV blocks), scores them with a
reward (an OpenAI-format grader, a Python callable, or scores supplied with the rollouts),
turns rewards into group-relative advantages and takes one optimizer step (or
`num_iterations`) on the clipped policy-gradient surrogate of the shared loss core. The new
LoRA weights then replace the policy's slot at an iteration boundary, as a new adapter
version: a rollout runs on one version from its first token to its last, and other requests
are served throughout.

Defaults follow TRL 1.16 where it has one, for these reasons:
- `loss_type="dapo"`: token-level normalisation over the whole generation batch, so long and
  short completions weigh the same per token (no length bias, unlike "grpo").
- `scale_rewards="group"`: advantages in units of each group's spread.
- `beta=0.0`: no KL to the reference. A LoRA policy stays near its base, DAPO and Dr. GRPO drop
  the term, and it would cost a second forward per step; set it (Tunix uses 0.04) to anchor
  the policy. The reference is the base model with the adapter off: no second model.
- `epsilon=0.2`, `epsilon_high=None` (= epsilon): PPO's symmetric clip.
- `num_iterations=1`: one optimizer step per generation batch, so the old-policy logprobs
  are the current ones and cost no extra forward.
- `importance_sampling_cap=2.0`: truncated importance sampling against the engine's own
  logprobs of the sampled tokens (the TIS default): a no-op when the engine and trainer agree,
  a bounded correction when they do not (lower precision serving, other kernels).
- `temperature=1.0`, `top_p=1.0`: rollouts sample the policy itself.
- `learning_rate=1e-5`: TRL's 1e-6 is for full fine-tuning; LoRA wants about ten times more.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kiln.config import setting_default
from kiln.engine.lora_slots import AdapterWeights
from kiln.engine.params import SamplingParams
from kiln.graders.engine_judge import base_model_judge
from kiln.models.config import ModelConfig
from kiln.models.decoder import logits as lm_logits
from kiln.models.lora import EXPERT_MODULES
from kiln.train import losses
from kiln.train.artifact import default_adapter_name
from kiln.train.data import bucket, length_buckets
from kiln.train.forward import forward_hidden, init_lora, lora_to_numpy
from kiln.train.optim import adamw, apply_gradients, learning_rate_schedule
from kiln.train.placement import Placement
from kiln.train.run import LoraRun, adapter_store, drive
from kiln.train.slices import SlicedStep, StepAbandoned, Turns

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SEQUENCE_BUCKETS = length_buckets(1 << 16)  # four per octave: a step pads by at most a quarter
SCALE_REWARDS = ("group", "batch", "none")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    # the LoRA shape, regularisation and seed default to the [train] settings' defaults; the
    # optimisation schedule has its own (see above)
    lora_rank: int = setting_default("train.lora_rank")
    lora_alpha: float = setting_default("train.lora_alpha")
    target_modules: tuple[str, ...] = setting_default("train.target_modules")
    learning_rate: float = 1e-5
    lr_schedule: str = "constant"
    warmup_ratio: float = 0.0
    weight_decay: float = setting_default("train.weight_decay")
    max_grad_norm: float = setting_default("train.max_grad_norm")
    n_epochs: int = 1
    max_steps: int = 0  # 0: n_epochs over the prompts
    prompts_per_step: int = 8
    num_generations: int = 8  # G
    max_completion_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    importance_sampling_cap: float = 2.0  # 0: off
    mask_truncated_completions: bool = False
    ignore_eos: bool = False  # benchmarks: every completion runs to max_completion_tokens
    micro_batch_rows: int = 16  # sequences per forward/backward; a step accumulates them all
    max_slice_ms: float = setting_default("train.max_slice_ms")  # see kiln.train.slices
    # sample step k+1's rollouts while step k trains: they come from a policy one version stale,
    # which truncated importance sampling corrects (see GRPORun.advance)
    overlap_rollouts: bool = False
    seed: int = setting_default("train.seed")

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be at least 2: advantages are relative to the group")
        if self.num_iterations < 1 or self.prompts_per_step < 1 or self.micro_batch_rows < 1:
            raise ValueError("num_iterations, prompts_per_step and micro_batch_rows must be positive")

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}


class RolloutBatch(NamedTuple):
    """Sequences (prompt + sampled completion) as right-padded rows [B, S], and per completion
    token (K of them, padded to a bucket): its flat position, the sampled token, its loss weight
    (0 for padding), advantage, the engine's logprob, and the old policy's and the reference's
    logprobs (zeros when unused)."""

    tokens: np.ndarray  # int32 [B, S]
    valid: np.ndarray  # bool [B, S]
    loss_index: np.ndarray  # int32 [K]
    loss_targets: np.ndarray  # int32 [K]
    loss_weight: np.ndarray  # float32 [K]
    advantages: np.ndarray  # float32 [K]
    sampler_logprobs: np.ndarray  # float32 [K]
    old_logprobs: np.ndarray  # float32 [K]
    ref_logprobs: np.ndarray  # float32 [K]


@dataclasses.dataclass
class Rollout:
    """One sampled completion of a prompt, with its reward."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None  # the engine's, of each sampled token
    truncated: bool
    reward: float
    text: str = ""
    loss_mask: np.ndarray | None = None  # per completion token: 1 where the policy sampled it (None: all)
    # the reward's parts, where it has them (a multi grader's); keyword-only, so subclasses' fields stay positional
    components: dict[str, float] | None = dataclasses.field(default=None, kw_only=True)


def _pad(parts: list[np.ndarray], K: int, dtype=np.float32) -> np.ndarray:
    flat = np.concatenate(parts).astype(dtype)
    return np.pad(flat, (0, K - len(flat)))


def rollout_batches(rollouts: Sequence[Rollout], advantages: np.ndarray, config: GRPOConfig) -> list[RolloutBatch]:
    """The generation batch as micro-batches of `micro_batch_rows` sequences, each padded to a
    length bucket; the loss weights are computed over the whole generation batch so that the
    micro-batches' losses add up to its loss."""
    n = len(rollouts)
    token_seq = np.concatenate([np.full(len(r.completion_ids), i, np.int32) for i, r in enumerate(rollouts)])
    token_mask = np.concatenate([np.full(len(r.completion_ids), 0.0 if (
        r.truncated and config.mask_truncated_completions) else 1.0, np.float32) *
        (1.0 if r.loss_mask is None else r.loss_mask) for r in rollouts])
    weights = losses.sequence_loss_weights(token_mask, token_seq, n, config.loss_type, config.max_completion_tokens)
    offsets = np.concatenate([[0], np.cumsum([len(r.completion_ids) for r in rollouts])])
    rows = config.micro_batch_rows
    out = []
    for start in range(0, n, rows):
        part = range(start, min(start + rows, n))
        longest = max(len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids) - 1 for i in part)
        S = bucket(longest, SEQUENCE_BUCKETS)
        tokens, valid = np.zeros((rows, S), np.int32), np.zeros((rows, S), bool)
        index, fields = [], {k: [] for k in ("targets", "weight", "adv", "sampler")}
        for row, i in enumerate(part):
            r = rollouts[i]
            seq = r.prompt_ids + r.completion_ids
            tokens[row, :len(seq) - 1], valid[row, :len(seq) - 1] = seq[:-1], True
            # the completion's tokens are predicted at the positions before them
            positions = np.arange(len(r.prompt_ids) - 1, len(seq) - 1)
            index.append(row * S + positions)
            fields["targets"].append(np.asarray(r.completion_ids, np.int32))
            fields["weight"].append(weights[offsets[i]:offsets[i + 1]])
            fields["adv"].append(np.full(len(r.completion_ids), advantages[i], np.float32))
            fields["sampler"].append(np.asarray(r.logprobs if r.logprobs is not None else
                                                np.zeros(len(r.completion_ids)), np.float32))
        flat = np.concatenate(index).astype(np.int32)
        K = bucket(max(len(flat), 1), length_buckets(rows * S))
        zeros = np.zeros(K, np.float32)
        out.append(RolloutBatch(tokens, valid, _pad([flat], K, np.int32), _pad(fields["targets"], K, np.int32),
                                _pad(fields["weight"], K), _pad(fields["adv"], K), _pad(fields["sampler"], K), zeros,
                                zeros))
    return out


def completion_logits(params, lora, batch: RolloutBatch, cfg: ModelConfig, scale: float) -> jax.Array:
    """Raw logits [K, vocab] at the completion positions (the LM head runs nowhere else)."""
    hidden = forward_hidden(params, lora, batch.tokens, batch.valid, cfg, scale)
    return lm_logits(params, hidden[batch.loss_index], cfg, training=True)


def completion_logprobs(params, lora, batch: RolloutBatch, cfg: ModelConfig, scale: float,
                        temperature: float) -> jax.Array:
    """log p of each completion token [K] under the model (params + LoRA) at `temperature`."""
    logits = completion_logits(params, lora, batch, cfg, scale) / temperature
    return losses.token_logprobs(logits, batch.loss_targets)


def make_policy_steps(cfg: ModelConfig, tx: optax.GradientTransformation, config: GRPOConfig,
                      teacher_cfg: ModelConfig | None = None, teacher_scale: float = 1.0,
                      placement: Placement | None = None):
    """The jitted pieces of a policy step: gradients of one micro-batch, the optimizer update, and
    token logprobs (old policy, reference, teacher) without gradients; and the loss after the
    decoder (`head_loss`, for sliced steps). With `config.jsd_beta` set (distillation), the loss
    adds the generalized JSD to the teacher's full distribution; the teacher (params, LoRA or
    None) is then the gradient function's fourth argument. The update returns the params and optimizer
    state placed as `placement` holds them (default: one device)."""
    scale, temperature = config.scale, config.temperature
    jsd_beta = getattr(config, "jsd_beta", None)

    def head_loss(params, hidden, batch: RolloutBatch, norm=1.0, teacher_logits=None):
        """The loss terms of completion tokens given their final hidden states, as sums (the loss
        weights already span the whole generation batch, so any split of the tokens adds up)."""
        raw = lm_logits(params, hidden, cfg, training=True)
        logits = raw / temperature
        logprobs = losses.token_logprobs(logits, batch.loss_targets)
        if config.num_iterations > 1:
            old, old_raw = batch.old_logprobs, batch.old_logprobs if temperature == 1.0 else None
        else:  # one step per generation batch: the old policy is the current one
            old = jax.lax.stop_gradient(logprobs)
            old_raw = jax.lax.stop_gradient(losses.token_logprobs(raw, batch.loss_targets))
        per_token, clipped = losses.clipped_surrogate(logprobs, old, batch.advantages, config.epsilon,
                                                      config.epsilon_high)
        if config.importance_sampling_cap and old_raw is not None:
            per_token = per_token * losses.truncated_importance_weights(old_raw, batch.sampler_logprobs,
                                                                        config.importance_sampling_cap)
        kl = losses.kl_estimate(logprobs, batch.ref_logprobs, "k3") if config.beta else jnp.zeros_like(logprobs)
        w = batch.loss_weight
        per_token = per_token + config.beta * kl
        jsd = jnp.zeros_like(logprobs)
        if teacher_logits is not None:
            jsd = losses.generalized_jsd(logits, teacher_logits / temperature, jsd_beta)
            per_token = per_token + config.jsd_coef * jsd
        loss = jnp.sum(per_token * w)
        aux = {"loss": loss, "clipped": jnp.sum(clipped * w), "kl": jnp.sum(kl * w), "jsd": jnp.sum(jsd * w),
               "entropy": jnp.sum(jax.lax.stop_gradient(losses.entropy(logits)) * w), "weight": jnp.sum(w)}
        return loss, aux

    def loss_fn(lora, params, batch: RolloutBatch, teacher=None):
        hidden = forward_hidden(params, lora, batch.tokens, batch.valid, cfg, scale)[batch.loss_index]
        teacher_logits = None
        if jsd_beta is not None:
            t_params, t_lora = teacher
            teacher_logits = completion_logits(t_params, t_lora, batch, teacher_cfg, teacher_scale)
        return head_loss(params, hidden, batch, 1.0, teacher_logits)

    def grads(lora, params, batch: RolloutBatch, teacher=None):
        return jax.grad(loss_fn, has_aux=True)(lora, params, batch, teacher)

    def logprobs(lora, params, batch: RolloutBatch):
        return completion_logprobs(params, lora, batch, cfg, scale, temperature)

    placed_update = (placement or Placement(None, cfg)).jit_update(apply_gradients(tx), donate_argnums=(0, 1))
    return jax.jit(grads), placed_update, jax.jit(logprobs), head_loss


Reward = Callable[[list[str | dict], list[Any]], list[float]]  # (output texts or sample namespaces, items)


class Scores(list):
    """A batch's rewards (floats), with each one's components where the reward has parts (a multi
    grader's `sub_rewards`): what a step reports as `reward_components`."""

    def __init__(self, rewards, components: list[dict[str, float]] | None = None):
        super().__init__(rewards)
        self.components = components


def as_reward(reward, judge=None) -> Reward:
    """A batch reward from grader JSON, a kiln Grader, or a `(sample, item) -> float` callable."""
    from kiln import graders

    grader = graders.build(reward)

    def score(samples: list[str | dict], items: list[Any]) -> Scores:
        results = graders.grade_many(grader, samples, items, judge)
        return Scores([r.reward for r in results], [dict(r.sub_rewards) for r in results])

    return score


class GRPORun(LoraRun):
    """One GRPO run (a training run, see kiln.train.run): the policy adapter's LoRA params and
    optimizer state, advanced one step at a time by whoever drives it (the in-process `grpo()`,
    or a job between serving steps).

    engine: the AsyncEngine serving the base model (its params are the frozen base; nothing is
    copied). prompts: token ids per prompt; items: what the reward sees with each prompt.
    start_lora: LoRA params to start from (an SFT run's `run.lora`); default a fresh adapter.
    validation: prompts (with items) the policy's mean reward is measured on every
    `eval_interval` steps and at the end, `eval_samples` completions each (none by default)."""

    kind = "grpo"  # the trainer, in logs and provenance
    method = "reinforcement"  # the OpenAI method type
    counters = ("step", "trained_tokens")  # a step's prompts are a function of the seed and the step
    progress_keys = {"reward_mean": "reward_mean", "reverse_kl": "reverse_kl"}
    validation = None  # kiln.train.data prompts
    eval_interval, eval_samples = 10, 1

    def __init__(self, engine, prompts: list[list[int]], items: list[Any], reward: Reward | None,
                 config: GRPOConfig, name: str = "grpo-policy", start_lora: dict | None = None):
        if not prompts or len(prompts) != len(items):
            raise ValueError("need one item per prompt, and at least one prompt")
        if config.lora_rank > engine.config.max_lora_rank or engine.config.max_loras < 1:
            raise ValueError(f"the engine's LoRA slots (max_lora_rank {engine.config.max_lora_rank}) cannot hold "
                             f"a rank-{config.lora_rank} policy")
        experts = [m for m in config.target_modules if m in EXPERT_MODULES]
        if experts and engine.model.config.num_experts and not engine.config.lora_experts:
            raise ValueError(f"the policy adapts the experts ({', '.join(experts)}), which the engine's LoRA slots do "
                             "not hold: set [adapters] lora_experts = true")
        self.engine, self.config, self.name = engine, config, name
        self.model = engine.model
        self.params, self.cfg = self.model.params, self.model.config
        self.prompts, self.items, self.reward = prompts, items, reward
        steps_per_epoch = math.ceil(len(prompts) / config.prompts_per_step)
        self.total_steps = config.max_steps or steps_per_epoch * config.n_epochs
        self.schedule = learning_rate_schedule(config.learning_rate, self.total_steps, config.warmup_ratio,
                                               config.lr_schedule)
        self.tx = adamw(self.schedule, config.weight_decay, config.max_grad_norm)
        lora = init_lora(self.cfg, config.lora_rank, config.target_modules, config.seed)
        if start_lora is not None:  # an SFT run's adapter (`run.lora`) as the policy's start
            if jax.tree.map(jnp.shape, start_lora) != jax.tree.map(jnp.shape, lora):
                raise ValueError("start_lora must have this config's rank and target modules")
            lora = jax.tree.map(jnp.asarray, start_lora)
        # on the engine's mesh, the LoRA params and optimizer state are split like the weights
        self.placement = Placement(engine.mesh, self.cfg)
        self.lora, self.opt_state = self.placement.state(self.tx, lora)
        self._set_steps(make_policy_steps(self.cfg, self.tx, config, placement=self.placement))
        self._executables: dict[tuple, Any] = {}
        self.trained_tokens = 0  # completion tokens in the loss
        self.step = 0
        self.adapter: AdapterWeights | None = None
        self.last_metrics: dict = {}
        self._sampler: concurrent.futures.ThreadPoolExecutor | None = None  # overlap_rollouts: samples ahead
        self._ahead: tuple[int, concurrent.futures.Future] | None = None  # (the step they are for, its rollouts)
        self._pin = threading.Lock()  # guards which versions are current and pinned
        self._pinned: AdapterWeights | None = None  # the version sampling ahead, until it is done
        self.publish()

    @property
    def micro_step(self) -> int:
        """Checkpoints are numbered in micro-steps; a policy step is one."""
        return self.step

    def _set_steps(self, steps) -> None:
        grads, self._update, logprobs, head_loss = steps
        self._jitted = {"grads": grads, "logprobs": logprobs}
        self._sliced = SlicedStep(self.cfg, self.config.scale, head_loss, self.config.max_slice_ms)

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def publish(self) -> AdapterWeights:
        """Hands the current LoRA weights to the engine as a new version of the policy adapter,
        loaded into a slot at the next iteration boundary; the previous version retires when its
        last request ends."""
        old = self.adapter
        new = AdapterWeights(self.name, f"step-{self.step}", lora_to_numpy(self.lora), self.config.scale,
                             self.config.lora_rank)
        self.engine.place_adapter(new).result()
        with self._pin:
            self.adapter = new
            retire = old is not None and old is not self._pinned  # a version sampling ahead retires when it ends
        if retire:
            self.engine.retire_adapter(old).result()
        return self.adapter

    def step_prompts(self, step: int | None = None) -> list[int]:
        """Indices of a step's prompts (default: this one's): epochs in a seeded order,
        `prompts_per_step` at a time."""
        n, per, step = len(self.prompts), self.config.prompts_per_step, self.step if step is None else step
        out = []
        for k in range(step * per, (step + 1) * per):
            epoch, pos = divmod(k, n)
            out.append(int(np.random.default_rng(self.config.seed + epoch).permutation(n)[pos]))
        return out

    def sample(self, indices: list[int], step: int | None = None,
               adapter: AdapterWeights | None = None) -> list[list[Rollout]]:
        """G completions per prompt from the engine, on the current policy version (or `adapter`);
        seeded for `step` (default: this one)."""
        c, step, adapter = self.config, self.step if step is None else step, adapter or self.adapter
        params = [SamplingParams(n=c.num_generations, temperature=c.temperature, top_p=c.top_p,
                                 max_tokens=c.max_completion_tokens, logprobs=0, ignore_eos=c.ignore_eos,
                                 seed=(c.seed * 1_000_003 + step * 1009 + j) % (1 << 31))
                  for j in range(len(indices))]
        prompts = [self.prompts[i] for i in indices]
        choices = self.engine.complete(prompts, params, adapter)
        return [[Rollout(list(prompt), list(ch.token_ids), ch.logprobs, ch.finish_reason == "length", 0.0, ch.text)
                 for ch in group] for prompt, group in zip(prompts, choices, strict=True)]

    def score(self, groups: list[list[Rollout]], indices: list[int]) -> None:
        """Sets each rollout's reward: the reward of its text, with its prompt's item."""
        flat = [r for g in groups for r in g]
        items = [self.items[i] for i, g in zip(indices, groups, strict=True) for _ in g]
        scores = self.reward([r.text for r in flat], items)
        components = getattr(scores, "components", None) or [None] * len(flat)
        for r, score, parts in zip(flat, scores, components, strict=True):
            r.reward, r.components = float(score), parts or None

    def train_step(self, groups: list[list[Rollout]], ownership=None) -> dict:
        """One optimizer step (or num_iterations) on scored rollouts, grouped by prompt (each
        group's rewards set); publishes the new weights to the engine."""
        c = self.config
        rollouts = [r for g in groups for r in g]
        rewards = np.array([[r.reward for r in g] for g in groups], np.float32)
        advantages = losses.group_advantages(rewards, c.scale_rewards).reshape(-1)
        turns = Turns.of(ownership)
        batches = self.micro_batches(rollouts, advantages, turns.shared)
        batches, extra = self._with_logprobs(batches, turns.write)
        teacher = self._teacher_arg()
        # a batch too long for one slice runs in slices (not with a teacher's full distribution in the loss)
        plans = [self._sliced.plan(b) if turns.shared and teacher is None else None for b in batches]
        steps = [self._compiled("grads", self.lora, b, teacher) if plan is None else None  # compiled outside ownership
                 for b, plan in zip(batches, plans, strict=True)]
        stats = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "jsd": 0.0, "entropy": 0.0, "weight": 0.0}
        grad_norm = 0.0
        for _ in range(c.num_iterations):
            total = None
            for i, (b, step, plan) in enumerate(zip(batches, steps, plans, strict=True)):
                if plan is None:
                    with turns.write(f"{self.kind} {self.name}: step {self.step + 1}, batch {i + 1}"):
                        started = time.perf_counter()
                        g, aux = step(self.lora, self.params, b, teacher)
                        jax.block_until_ready(g)
                        self._sliced.record_fused(b, time.perf_counter() - started)
                else:
                    g, _, aux = self._sliced.grads(self.params, self.lora, b, 1.0, plan, turns.write)
                total = g if total is None else jax.tree.map(jnp.add, total, g)
                for k in stats:
                    stats[k] += float(aux[k])
            with turns.write(f"{self.kind} {self.name}: step {self.step + 1}, update"):
                self.lora, self.opt_state, norm = self._update(self.lora, self.opt_state, total)
                grad_norm = float(norm)
        self.step += 1
        self.trained_tokens += int(sum(float((b.loss_weight > 0).sum()) for b in batches))
        self.publish()
        weight = max(stats["weight"], 1e-9)
        lengths = [len(r.completion_ids) for g in groups for r in g]
        self.last_metrics = {
            "loss": stats["loss"] / c.num_iterations,
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "kl": stats["kl"] / weight, "clip_fraction": stats["clipped"] / weight,
            "entropy": stats["entropy"] / weight, "completion_length": float(np.mean(lengths)),
            "truncated_fraction": float(np.mean([r.truncated for g in groups for r in g])),
            "grad_norm": grad_norm, "learning_rate": float(self.schedule(self.step - 1)), **extra,
        }
        if getattr(c, "jsd_beta", None) is not None:  # distillation's full-distribution term
            self.last_metrics["jsd"] = stats["jsd"] / weight
        parts = [r.components for r in rollouts if r.components]
        if parts:  # each component's mean over the rollouts that have it
            names = sorted({name for p in parts for name in p})
            self.last_metrics["reward_components"] = {
                name: float(np.mean([p[name] for p in parts if name in p])) for name in names}
        return self.last_metrics

    def micro_batches(self, rollouts: list[Rollout], advantages: np.ndarray, shared: bool) -> list[RolloutBatch]:
        """The generation batch as micro-batches of `micro_batch_rows` sequences; while the run shares
        the accelerator, of fewer (halved until they fit, or one) where one layer of a micro-batch
        is measured to take longer than `max_slice_ms`. The loss weights span the whole generation
        batch, so any split adds up to the same gradient."""
        rows = self.config.micro_batch_rows
        batches = rollout_batches(rollouts, advantages, self.config)
        while shared and rows > 1 and any(self._sliced.layer_too_long(b) for b in batches):
            rows //= 2
            batches = rollout_batches(rollouts, advantages, dataclasses.replace(self.config, micro_batch_rows=rows))
        return batches

    def _with_logprobs(self, batches: list[RolloutBatch], lock) -> tuple[list[RolloutBatch], dict]:
        """The batches with what the loss needs besides the rollouts: the old policy's logprobs
        (num_iterations > 1) and the reference's (beta > 0); and extra metrics."""
        c = self.config
        if c.num_iterations == 1 and not c.beta:
            return batches, {}
        old = [self._compiled("logprobs", self.lora, b) for b in batches] if c.num_iterations > 1 else None
        ref = [self._compiled("logprobs", None, b) for b in batches] if c.beta else None
        out = []
        for i, b in enumerate(batches):  # a write per micro-batch
            with lock(f"grpo {self.name}: logprobs, batch {i + 1}"):
                out.append(b._replace(
                    old_logprobs=np.asarray(old[i](self.lora, self.params, b)) if old else b.old_logprobs,
                    ref_logprobs=np.asarray(ref[i](None, self.params, b)) if ref else b.ref_logprobs))
        return out, {}

    def _teacher_arg(self):
        return None

    def advance(self, ownership=None) -> dict:
        """Sample, score, train: one GRPO step (with the validation reward when due). Returns its
        metrics, timings included.

        With `overlap_rollouts`, the next step's rollouts are sampled on a thread of the run's
        while this step scores and trains, by the policy version this step's rollouts came
        from: one version stale when trained on (`rollout_staleness` 1). `rollout_seconds` is
        then only the time this step waited for its rollouts."""
        if self.reward is None:
            raise ValueError("this run has no reward: train on scored rollouts with train_step")
        t0 = time.perf_counter()
        indices = self.step_prompts()
        ahead, self._ahead = self._ahead, None
        stale = ahead is not None and ahead[0] == self.step
        groups = ahead[1].result() if stale else self.sample(indices)
        t1 = time.perf_counter()
        if self.config.overlap_rollouts and self.step + 1 < self.total_steps:
            self._sample_ahead(self.step + 1)
        self.score(groups, indices)
        t2 = time.perf_counter()
        metrics = self._train_timed(groups, ownership, t0)
        if metrics is None:
            return None
        metrics.update(rollout_seconds=t1 - t0, reward_seconds=t2 - t1, rollout_staleness=int(stale))
        if self.validation and (self.step % self.eval_interval == 0 or self.done):
            metrics["valid_reward_mean"] = self.evaluate([p.ids for p in self.validation],
                                                         [p.item for p in self.validation], self.eval_samples)
        return metrics

    def _train_timed(self, groups: list[list[Rollout]], ownership, started: float) -> dict | None:
        """`train_step` with the step number, its seconds, and the step's tokens per second since
        `started`; None when it stopped between two slices (nothing applied)."""
        t0 = time.perf_counter()
        try:
            metrics = self.train_step(groups, ownership)
        except StepAbandoned:
            return None
        t1 = time.perf_counter()
        tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for g in groups for r in g)
        metrics.update(step=self.step, train_seconds=t1 - t0, tokens_per_second=tokens / (t1 - started))
        return metrics

    def _sample_ahead(self, step: int) -> None:
        """Starts sampling `step`'s rollouts on the current version, which stays placed (pinned)
        until they are done, though the run publishes newer ones meanwhile."""
        if self._sampler is None:
            self._sampler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-rollouts")
        with self._pin:
            self._pinned = adapter = self.adapter

        def sample() -> list[list[Rollout]]:
            try:
                return self.sample(self.step_prompts(step), step, adapter)
            finally:
                with self._pin:
                    self._pinned = None
                    retire = adapter is not self.adapter
                if retire:
                    self.engine.retire_adapter(adapter).result()

        self._ahead = (step, self._sampler.submit(sample))

    def summary(self, metrics: dict) -> str:
        return f"reward={metrics['reward_mean']:.4f}"

    def close(self) -> None:
        """Rollouts sampled ahead are dropped (once their requests end), and the policy's
        training versions leave their slot."""
        if self._sampler is not None:
            self._sampler.shutdown(wait=True)
            self._sampler, self._ahead = None, None
        self.engine.retire_adapter(self.adapter).result()

    def _compiled(self, kind: str, lora, batch: RolloutBatch, *extra, params=None):
        """The executable of `kind` (a key of `self._jitted`: "grads", "logprobs", ...; with or
        without the adapter) for the batch's shape, compiled on first need: a job compiles
        outside accelerator ownership, so serving never waits for a compile. `extra`: arguments
        after the batch; `params`: other than the served model's (a teacher's)."""
        key = (kind, lora is None, batch.tokens.shape, batch.loss_index.shape)
        if key not in self._executables:
            args = (lora, self.params if params is None else params, batch, *extra)
            self._executables[key] = self._jitted[kind].lower(*args).compile()
        return self._executables[key]

    @property
    def compiled_shapes(self) -> int:
        return len(self._executables)

    def evaluate(self, prompts: list[list[int]], items: list[Any], samples: int = 1) -> float:
        """The current policy's mean reward over `samples` completions of each prompt."""
        c = self.config
        params = SamplingParams(n=samples, temperature=c.temperature, top_p=c.top_p,
                                max_tokens=c.max_completion_tokens, seed=c.seed)
        choices = self.engine.complete(prompts, params, self.adapter)
        texts = [ch.text for group in choices for ch in group]
        scores = self.reward(texts, [item for item, group in zip(items, choices, strict=True) for _ in group])
        return float(np.mean(scores))

    def _restored(self) -> None:
        self.lora, self.opt_state = self.placement.restored(self.lora, self.opt_state)
        self.publish()


@dataclasses.dataclass
class GRPOResult:
    history: list[dict]
    artifact: Any  # kiln.adapters.store.Artifact, or None when not saved
    run: GRPORun


def grpo(data, reward, name: str | None = None, *, model=None, engine=None, config: GRPOConfig | None = None,
         store=None, progress: bool = True, save: bool = True, settings=None, judge=None,
         max_prompt_len: int = 1024, **overrides) -> GRPOResult:
    """Trains a LoRA policy with GRPO in this process and saves it to the adapter store.

    data: a JSONL path or its text/bytes; each line `{"messages": [...], ...}` (rendered with
    the chat template) or `{"prompt": "...", ...}`; the whole line is the grader's `item`.
    reward: OpenAI grader JSON, a kiln Grader, or a `(sample, item) -> float` callable. model:
    a LoadedModel, a path, or None for the default model; engine: an AsyncEngine to sample
    from (default: one started here, and stopped at the end). judge: for model graders
    (default: the engine's base model). Keyword
    overrides replace GRPOConfig fields. Returns the metrics history and the saved artifact."""
    config = dataclasses.replace(config or GRPOConfig(), **overrides)

    def make_run(engine, name, prompts):
        return GRPORun(engine, [p.ids for p in prompts], [p.item for p in prompts],
                       as_reward(reward, judge or base_model_judge(engine)), config, name=name)

    return train_policy(make_run, data, name or default_adapter_name("grpo"), config, model=model, engine=engine,
                        store=store, progress=progress, save=save, settings=settings, max_prompt_len=max_prompt_len)


def train_policy(make_run, data, name: str, config: GRPOConfig, *, model, engine, store, progress: bool, save: bool,
                 settings, max_prompt_len: int) -> GRPOResult:
    """Runs a policy trainer in this process to its end, sampling from `engine` (or one started
    here on `model` with a LoRA slot for the policy), and saves its adapter to the store.
    make_run(engine, name, prompts) builds the run (GRPO's, distillation's)."""
    from kiln.config import resolve_settings
    from kiln.engine.client import AsyncEngine
    from kiln.engine.config import EngineConfig
    from kiln.engine.setup import resolve_model
    from kiln.train.data import load_prompts
    from kiln.train.sft import _as_source, file_digest

    settings = settings or resolve_settings(None)
    own_engine = engine is None
    if engine is None:
        model = resolve_model(model, settings, progress)
        engine_config = EngineConfig.from_settings(settings)
        engine_config = dataclasses.replace(engine_config, max_loras=max(engine_config.max_loras, 1),
                                            max_lora_rank=max(engine_config.max_lora_rank, config.lora_rank),
                                            lora_experts=engine_config.lora_experts
                                            or any(m in EXPERT_MODULES for m in config.target_modules))
        engine = AsyncEngine(model, engine_config)
    try:
        data = _as_source(data)
        run = make_run(engine, name, load_prompts(data, engine.model.tokenizer, max_prompt_len))
        inputs = [{"purpose": "training", "sha256": file_digest(data)}] if save else []
        history, artifact = drive(run, name=name, model=engine.model, inputs=inputs, ownership=engine.ownership,
                                  store=adapter_store(store, settings) if save else None, progress=progress,
                                  settings=settings)
        return GRPOResult(history, artifact, run)
    finally:
        if own_engine:
            engine.shutdown()
