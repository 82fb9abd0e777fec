"""Evals: run a suite of items through a served model, grade every sample with OpenAI-format
graders, keep the outcomes, and compare runs.

    result = kiln.eval.run(items, [grader_json], [{"role": "user", "content": "{{ item.question }}"}],
                           engine=engine, temperature=0, max_completion_tokens=64)
    result.result_counts, result.outcomes[0]["results"]
    kiln.eval.compare(base_result, adapter_result)   # per criterion: paired differences, CIs, flips

The server runs the same thing behind OpenAI's evals API (/v1/evals), durably (see service.py).

Modules: suite (what a run evaluates), executor (sampling and grading), outcome (one item's
result, a run's totals), store (SQLite), comparison (paired bootstrap), service (the server's
evals and runs), api (the Python functions above).
"""

from importlib import import_module

__all__ = ["RunResult", "Sampling", "Suite", "compare", "run"]
_HOMES = {"RunResult": "api", "compare": "api", "run": "api", "Sampling": "suite", "Suite": "suite"}


def __getattr__(name: str):
    """The names above, imported on first use: `kiln eval`'s parser imports this package, and
    the CLI (`kiln router` included) must not pull in JAX to build it."""
    if name not in _HOMES:
        raise AttributeError(f"module 'kiln.eval' has no attribute {name!r}")
    return getattr(import_module(f"kiln.eval.{_HOMES[name]}"), name)
