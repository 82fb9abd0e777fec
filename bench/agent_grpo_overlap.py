"""Multi-turn GRPO step time with and without overlapped rollouts, side by side in one run.

The default model runs the calculator task of notebooks/agent_grpo.ipynb as agent episodes: a
three-digit multiplication, a `multiply` tool (kiln_python, in the sandbox) that the model must
call once, then its answer (two model turns around the tool's output). Each side trains the
same fresh LoRA policy from the same seed for --warmup untimed steps (compiles) and --steps
timed ones. "sequential" samples a step's episodes, then trains on them; "overlapped"
(`overlap_rollouts`) samples step k+1's episodes while step k trains, one policy version stale.
A step's wall time, how long it waited for its episodes, and its training time are averaged;
the speed-up is sequential over overlapped. --tool-latency adds a sleep to every tool call (a
remote tool, an MCP server across a network), which overlapping can hide.

    python bench/agent_grpo_overlap.py [--steps 3] [--warmup 1] [--tool-latency 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.models.loader import load_model
from kiln.train.agent_grpo import AgentGRPORun
from kiln.train.grpo import GRPOConfig

DATA = Path(__file__).parent.parent / "notebooks" / "data" / "calculator_train.jsonl"
PROMPTS, G, RANK = 4, 4, 8


def multiply_tool(latency: float) -> dict:
    nap = f"    time.sleep({latency})\n" if latency else ""
    return {"type": "kiln_python", "name": "multiply", "description": "Multiplies two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]},
            "source": f"import time\ndef multiply(a, b):\n{nap}    return a * b\n"}


def correct(result, item) -> float:
    return float(str(item["answer"]) in result.output_text)


def run_side(model, items, args, overlap: bool) -> dict:
    engine = AsyncEngine(model, EngineConfig(num_kv_blocks=1024, max_loras=3, max_lora_rank=RANK,
                                             max_num_seqs=PROMPTS * G))
    config = GRPOConfig(lora_rank=RANK, lora_alpha=2 * RANK, num_generations=G, prompts_per_step=PROMPTS,
                        max_completion_tokens=args.new_tokens, micro_batch_rows=PROMPTS * G, learning_rate=1e-5,
                        max_steps=args.warmup + args.steps, seed=3, overlap_rollouts=overlap)
    fields = {"tool_choice": "required", "max_tool_calls": 1, "max_turns": 2}
    try:
        run = AgentGRPORun(engine, items, [multiply_tool(args.tool_latency)], config, episode_reward=correct,
                           fields=fields, name="overlap" if overlap else "sequential")
        timed = []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            m = run.advance(engine.ownership)
            if i >= args.warmup:
                timed.append((time.perf_counter() - t0, m["rollout_seconds"], m["train_seconds"],
                              m["rollout_staleness"]))
        run.close()
        n = len(timed)
        return {"step": sum(t[0] for t in timed) / n, "wait": sum(t[1] for t in timed) / n,
                "train": sum(t[2] for t in timed) / n, "stale": [t[3] for t in timed],
                "length": m["completion_length"]}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=48, help="a run's sampled tokens over both turns")
    ap.add_argument("--tool-latency", type=float, default=0.0, help="seconds each tool call sleeps")
    args = ap.parse_args()
    model = load_model(None, show_progress=False)
    items = [json.loads(line) for line in DATA.read_text().splitlines()][:PROMPTS * (args.warmup + args.steps)]
    sides = {"sequential": run_side(model, items, args, False), "overlapped": run_side(model, items, args, True)}
    print(f"agent GRPO on {model.model_id}: {PROMPTS} prompts x {G} episodes per step, {args.steps} timed steps, "
          f"tool latency {args.tool_latency:g} s")
    print(f"{'':12} {'step s':>8} {'waited s':>9} {'train s':>8} {'tokens':>7}  staleness")
    for name, r in sides.items():
        print(f"{name:12} {r['step']:8.2f} {r['wait']:9.2f} {r['train']:8.2f} {r['length']:7.1f}  {r['stale']}")
    print(f"overlapped speed-up: {sides['sequential']['step'] / sides['overlapped']['step']:.2f}x")


if __name__ == "__main__":
    main()
