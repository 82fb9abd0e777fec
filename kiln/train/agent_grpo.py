"""Multi-turn GRPO on tool episodes: each rollout is an agent run (kiln.agent) on the live engine,
its tools included, and the policy learns from the whole episode.

- An episode is one token sequence (AgentResult.episode): the first prompt, then each model turn's
  sampled tokens with the chat template's and the tools' tokens between them. The loss covers
  only the model's own tokens; tool output and template tokens have loss weight 0.
- Truncated importance sampling against the engine's logprobs of the sampled tokens
  (`importance_sampling_cap`, on by default as in single-turn GRPO), so an episode sampled by a
  policy one version stale is still a bounded, correct estimate.
- Rewards: `episode_reward(result, item) -> float` sees the whole run (its calls, their outputs,
  its answer); or `reward` (grader JSON, a Grader, a `(sample, item)` callable) grades the run's
  sample namespace (`AgentResult.grader_sample`: the answer as `output_text`, every call in
  `output_tools`, the output items), as an agent eval's criteria do.
- G episodes per prompt run concurrently; their turns share the engine's steps with whatever
  else it serves, and each turn reuses the episode's prefix blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln import agent
from kiln.train.artifact import default_adapter_name
from kiln.train.grpo import GRPOConfig, GRPOResult, GRPORun, Rollout, as_reward, train_policy

EpisodeReward = Callable[[agent.AgentResult, Any], float]


@dataclasses.dataclass
class EpisodeRollout(Rollout):
    result: agent.AgentResult | None = None


def episode_input(item: Any) -> str | list:
    """What an item asks the agent: its `messages`, or its `prompt`."""
    if isinstance(item, dict) and isinstance(item.get("messages"), list):
        return item["messages"]
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"]
    raise ValueError("an agent GRPO item needs messages or a prompt")


class AgentGRPORun(GRPORun):
    """GRPO whose rollouts are agent runs with `tools` (Responses tool definitions: kiln_python,
    mcp, function). `fields`: the runs' other Responses fields (tool_choice, max_turns,
    max_tool_calls, instructions, ...); sampling comes from the config."""

    kind = "agent_grpo"

    def __init__(self, engine, items: list[Any], tools: list[dict], config: GRPOConfig, *,
                 reward=None, episode_reward: EpisodeReward | None = None, fields: dict | None = None,
                 name: str = "agent-policy", start_lora: dict | None = None):
        if (reward is None) == (episode_reward is None):
            raise ValueError("give one of reward (on the final answer) and episode_reward (on the whole run)")
        self.inputs = [episode_input(item) for item in items]
        super().__init__(engine, [[] for _ in items], items, reward or (lambda texts, items: []), config, name=name,
                         start_lora=start_lora)
        self.tools, self.fields, self.episode_reward = tools, dict(fields or {}), episode_reward

    def episodes(self, inputs: list, seeds: list[int], adapter=None) -> list[agent.AgentResult]:
        c = self.config
        return agent.run_many(inputs, [{"seed": s} for s in seeds], engine=self.engine, tools=self.tools,
                              adapter=adapter or self.adapter, sample_logprobs=True, temperature=c.temperature,
                              top_p=c.top_p, max_output_tokens=c.max_completion_tokens, **self.fields)

    def sample(self, indices: list[int], step: int | None = None, adapter=None) -> list[list[Rollout]]:
        """G episodes per prompt, on the current policy version (or `adapter`), seeded for `step`."""
        c, G, step = self.config, self.config.num_generations, self.step if step is None else step
        seeds = [(c.seed * 1_000_003 + step * 1009 + j * 31 + g) % (1 << 31)
                 for j in range(len(indices)) for g in range(G)]
        results = self.episodes([self.inputs[i] for i in indices for _ in range(G)], seeds, adapter)
        rollouts = []
        for result in results:
            prompt, completion, mask, logprobs = result.episode()
            rollouts.append(EpisodeRollout(prompt, completion, list(map(float, logprobs)),
                                           result.incomplete in ("max_output_tokens", "context_length"), 0.0,
                                           result.output_text, mask, result))
        return [rollouts[k * G:(k + 1) * G] for k in range(len(indices))]

    def rewards(self, results: list[agent.AgentResult], items: list[Any]) -> list[float]:
        if self.episode_reward is not None:
            return [float(self.episode_reward(r, item)) for r, item in zip(results, items, strict=True)]
        return [float(x) for x in self.reward([r.grader_sample(self.name) for r in results], items)]

    def score(self, groups: list[list[Rollout]], indices: list[int]) -> None:
        flat = [r for g in groups for r in g]
        items = [self.items[i] for i, g in zip(indices, groups, strict=True) for _ in g]
        for r, reward in zip(flat, self.rewards([r.result for r in flat], items), strict=True):
            r.reward = reward

    def evaluate(self, prompts: list, items: list[Any], samples: int = 1) -> float:
        """The current policy's mean reward over `samples` episodes of each item."""
        inputs = [episode_input(item) for item in items for _ in range(samples)]
        results = self.episodes(inputs, [self.config.seed + k for k in range(len(inputs))])
        return float(np.mean(self.rewards(results, [item for item in items for _ in range(samples)])))


def agent_grpo(data, tools: list[dict], reward=None, name: str | None = None, *, episode_reward=None,
               fields: dict | None = None, start_lora: dict | None = None, model=None, engine=None,
               config: GRPOConfig | None = None, store=None,
               progress: bool = True, save: bool = True, settings=None, judge=None, max_prompt_len: int = 1024,
               **overrides) -> GRPOResult:
    """Trains a LoRA policy with multi-turn GRPO on tool episodes in this process and saves it.

    data: JSONL (a path or its text); each line `{"messages": [...], ...}` or `{"prompt": ...}`, the
    whole line the reward's item. tools: the episodes' tool definitions. reward / episode_reward:
    see the module. fields: the runs' Responses fields (tool_choice, max_turns, ...). start_lora: LoRA
    params to start from (an SFT run's `run.lora`, same rank). The rest as kiln.train.grpo.grpo."""
    from kiln.graders.engine_judge import base_model_judge

    config = dataclasses.replace(config or GRPOConfig(), **overrides)

    def make_run(engine, name, prompts):
        text_reward = as_reward(reward, judge or base_model_judge(engine)) if reward is not None else None
        return AgentGRPORun(engine, [p.item for p in prompts], tools, config, reward=text_reward,
                            episode_reward=episode_reward, fields=fields, name=name, start_lora=start_lora)

    return train_policy(make_run, data, name or default_adapter_name("agent-grpo"), config, model=model,
                        engine=engine, store=store, progress=progress, save=save, settings=settings,
                        max_prompt_len=max_prompt_len)
