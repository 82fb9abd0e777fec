"""Writes the calculator files for agent_grpo.ipynb: three-digit multiplications, which a 135M
model gets wrong on its own, asked of an agent with a `multiply` tool.

- calculator_sft.jsonl: worked tool episodes for a short SFT warm start (the question, the model's
  tool call in Hermes format, the tool's result, the answer);
- calculator_train.jsonl: questions with their `answer`, the prompts of multi-turn GRPO;
- calculator_test.jsonl: held-out questions.

Deterministic (seeded); no held-out pair appears in the other files.

    python notebooks/data/make_calculator.py
"""

import json
import random
from pathlib import Path

ASKS = ["What is {a} * {b}?", "Multiply {a} by {b}.", "{a} times {b} is?", "Compute {a} x {b}."]


def question(rng, a, b):
    return {"role": "user", "content": rng.choice(ASKS).format(a=a, b=b)}


def episode(rng, a, b):
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    return {"messages": [question(rng, a, b),
                         {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "content": str(a * b)},
                         {"role": "assistant", "content": f"{a} * {b} = {a * b}"}]}


def main():
    rng = random.Random(11)
    pairs = list({(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(600)})
    rng.shuffle(pairs)
    test, sft, train = pairs[:64], pairs[64:112], pairs[112:368]
    here = Path(__file__).parent
    files = {"calculator_test.jsonl": [{"messages": [question(rng, a, b)], "answer": a * b} for a, b in test],
             "calculator_sft.jsonl": [episode(rng, a, b) for a, b in sft],
             "calculator_train.jsonl": [{"messages": [question(rng, a, b)], "answer": a * b} for a, b in train]}
    for name, records in files.items():
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
