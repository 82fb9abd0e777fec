"""Agent runs in this process (kiln.agent) and multi-turn GRPO on their episodes: the episode is
one token sequence whose loss mask covers the model's own tokens only, and a reward on the
tool calls rises on a tiny model."""

import numpy as np

from kiln import agent
from kiln.train.agent_grpo import AgentGRPORun
from kiln.train.grpo import GRPOConfig, rollout_batches

LOOKUP = {"type": "kiln_python", "name": "lookup", "description": "Looks a key up",
          "parameters": {"type": "object", "properties": {"key": {"enum": ["a", "b"]}}, "required": ["key"]},
          "source": "def lookup(key):\n    return {'a': 'found it', 'b': 'nothing here'}[key]\n"}
NAMED = {"tool_choice": {"type": "function", "name": "lookup"}, "max_tool_calls": 1}


def test_an_agent_run_in_python_is_one_sequence_masked_to_the_models_tokens(policy_engine):
    result = agent.run("Find the key.", engine=policy_engine, tools=[LOOKUP], sample_logprobs=True, temperature=0,
                       **NAMED)
    call, output, again = result.output
    assert (call["type"], output["type"], again["type"]) == ("function_call", "function_call_output", "function_call")
    assert result.status == "incomplete" and result.incomplete == "max_tool_calls" and len(result.turns) == 2
    prompt, completion, mask, logprobs = result.episode()
    tok = policy_engine.model.tokenizer
    assert prompt == result.turns[0].prompt_ids and result.turns[1].continued
    assert prompt + completion == result.turns[1].prompt_ids + result.turns[1].token_ids
    # token by token: the masked-in tokens are exactly what the model sampled, turn after turn;
    # the tool's output is among the masked-out ones, with the template's tokens
    sampled = [t for turn in result.turns for t in turn.token_ids]
    assert [t for t, m in zip(completion, mask, strict=True) if m == 1] == sampled
    first = len(result.turns[0].token_ids)
    assert mask[:first].all() and not mask[first:len(completion) - len(result.turns[1].token_ids)].any()
    between = tok.decode([t for t, m in zip(completion, mask, strict=True) if m == 0], skip_special_tokens=False)
    assert output["output"] in between and output["output"] in ("found it", "nothing here")
    assert tok.decode(result.turns[0].token_ids) == call["arguments"]
    # the engine's logprobs are where the model sampled, and nowhere else
    assert (logprobs[mask == 0] == 0).all() and (logprobs[mask == 1] <= 0).all()
    batch, = rollout_batches([_rollout(prompt, completion, mask, logprobs)], np.zeros(1, np.float32),
                             GRPOConfig(micro_batch_rows=2))
    assert int((batch.loss_weight > 0).sum()) == int(mask.sum())


def _rollout(prompt, completion, mask, logprobs):
    from kiln.train.grpo import Rollout

    return Rollout(prompt, completion, list(logprobs), False, 0.0, "", mask)


def test_multi_turn_grpo_learns_which_tool_call_pays(policy_engine):
    """Reward: 1 when the episode's first call looks key "a" up. The episodes have two model turns
    around the tool's output; a fixed, seeded run raises the reward."""
    items = [{"prompt": p} for p in ("Find the key.", "Which key?", "Look it up.", "Go.")]

    def first_call_finds(result, item):
        call = next(i for i in result.output if i["type"] == "function_call")
        return float('"a"' in call["arguments"])

    config = GRPOConfig(lora_rank=8, lora_alpha=16, num_generations=8, prompts_per_step=4, max_completion_tokens=64,
                        learning_rate=2e-2, max_steps=4, micro_batch_rows=32, seed=5)
    run = AgentGRPORun(policy_engine, items, [LOOKUP], config, episode_reward=first_call_finds, fields=NAMED,
                       name="agent-policy-learns")
    history = []
    while not run.done:
        metrics = run.advance(policy_engine.ownership)
        history.append(metrics["reward_mean"])
    first, last = np.mean(history[:2]), np.mean(history[-2:])
    assert last > first + 0.2 and last >= 0.75, history
    policy_engine.retire_adapter(run.adapter).result()


def test_overlapped_rollouts_are_one_version_stale_and_the_reward_still_rises(policy_engine):
    """Step k+1's episodes run while step k trains, on the version step k's came from: every step
    after the first trains on rollouts one version stale (truncated importance sampling corrects
    them), and the version they pinned leaves its slot once they are done."""
    items = [{"prompt": p} for p in ("Find the key.", "Which key?", "Look it up.", "Go.")]

    def first_call_finds(result, item):
        call = next(i for i in result.output if i["type"] == "function_call")
        return float('"a"' in call["arguments"])

    config = GRPOConfig(lora_rank=8, lora_alpha=16, num_generations=8, prompts_per_step=4, max_completion_tokens=64,
                        learning_rate=2e-2, max_steps=5, micro_batch_rows=32, seed=5, overlap_rollouts=True)
    run = AgentGRPORun(policy_engine, items, [LOOKUP], config, episode_reward=first_call_finds, fields=NAMED,
                       name="agent-policy-overlap")
    history = []
    while not run.done:
        history.append(run.advance(policy_engine.ownership))
    assert [m["rollout_staleness"] for m in history] == [0, 1, 1, 1, 1]
    rewards = [m["reward_mean"] for m in history]
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.2, rewards
    run.close()
    assert not [s for s in policy_engine._core.lora_slots.resident() if s["adapter"] == run.name]
