"""Writes arithmetic_train.jsonl and arithmetic_test.jsonl: two-number additions for GRPO,
each a chat prompt and the `answer` a grader checks. Deterministic (seeded); no test sum's
pair of numbers appears in training.

    python notebooks/data/make_arithmetic.py
"""

import json
import random
from pathlib import Path

SYSTEM = "You are a calculator. Write the sum and its result, as <answer>a + b = N</answer>."
ASKS = ["What is {a} + {b}?", "{a} + {b} = ?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"]


def record(rng, a, b):
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": rng.choice(ASKS).format(a=a, b=b)}], "answer": a + b}


def main():
    rng = random.Random(7)
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    rng.shuffle(pairs)
    test, train = pairs[:64], pairs[64:]
    here = Path(__file__).parent
    for name, part in (("arithmetic_train.jsonl", train), ("arithmetic_test.jsonl", test)):
        (here / name).write_text("".join(json.dumps(record(rng, a, b)) + "\n" for a, b in part))


if __name__ == "__main__":
    main()
