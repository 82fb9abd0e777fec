"""OpenAI-format graders, run locally: rewards for GRPO and scores for evals.

Grader configs are OpenAI's grader JSON, unchanged: `string_check`, `text_similarity`,
`python`, `score_model`, `label_model` and `multi` (see docs/graders.md).

    grader = kiln.graders.build({"type": "string_check", "name": "exact", "operation": "eq",
                                 "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"})
    grader.grade("Paris", {"answer": "Paris"}).reward              # 1.0
    kiln.graders.grade_many(grader, outputs, items)                # many samples, concurrently

`build` also takes a plain `(sample, item) -> float` callable; `validate` checks JSON and
raises `kiln.errors.InvalidRequest` naming the offending field. Model graders call the
`judge` given to `grade` (see kiln.graders.model); the server passes its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kiln.graders.base import FunctionGrader, Grader, Judge, as_grader, parse
from kiln.graders.basic import StringCheckGrader, TextSimilarityGrader
from kiln.graders.model import JudgeReply, LabelModelGrader, ScoreModelGrader
from kiln.graders.multi import MultiGrader
from kiln.graders.python_sandbox import PythonGrader, SandboxLimits, SandboxPool, default_pool
from kiln.graders.result import Errors, GradeResult
from kiln.graders.templates import make_sample, render

__all__ = ["Errors", "FunctionGrader", "GradeResult", "Grader", "Judge", "JudgeReply", "LabelModelGrader",
           "MultiGrader", "PythonGrader", "SandboxLimits", "SandboxPool", "ScoreModelGrader", "StringCheckGrader",
           "TextSimilarityGrader", "build", "default_pool", "grade_many", "make_sample", "render", "validate"]


def validate(grader: Any, param: str = "grader") -> Grader:
    """OpenAI grader JSON -> a grader object, or InvalidRequest whose `param` names the field
    at fault (`grader.operation`, `grader.graders.correct.evaluation_metric`, ...)."""
    return parse(grader, param)


def build(grader: Any, *, pool: SandboxPool | None = None) -> Grader:
    """A grader from grader JSON (validated), a Grader, or a `(sample, item) -> float`
    callable. With `pool`, its Python graders (and a multi's) run there instead of in the
    process-wide default pool."""
    built = as_grader(grader)
    if pool is not None:
        for part in _parts(built):
            if isinstance(part, PythonGrader):
                part.pool = pool
    return built


def grade_many(grader: Any, samples: Sequence[dict | str], items: Sequence[Any] | None = None,
               judge: Judge | None = None, *, pool: SandboxPool | None = None,
               max_workers: int | None = None) -> list[GradeResult]:
    """Grades samples[i] against items[i] for every i, in order. Python graders run on all
    the pool's workers at once and model graders send their judge calls concurrently (the
    engine batches them); in-process graders run one after another."""
    built = build(grader, pool=pool)
    items = [None] * len(samples) if items is None else list(items)
    if len(items) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(items)} items")
    parts = _parts(built)
    if max_workers is None:
        python = [p.pool or default_pool() for p in parts if isinstance(p, PythonGrader)]
        judged = any(p.judge_models() for p in parts)
        max_workers = max([p.size for p in python] + [8 if judged else 1])
    if max_workers <= 1 or len(samples) <= 1:
        return [built.grade(s, i, judge) for s, i in zip(samples, items, strict=True)]
    with ThreadPoolExecutor(max_workers, thread_name_prefix="kiln-grader") as executor:
        return list(executor.map(lambda pair: built.grade(pair[0], pair[1], judge), zip(samples, items, strict=True)))


def _parts(grader: Grader) -> list[Grader]:
    """The grader and, for a multi grader, its parts."""
    if isinstance(grader, MultiGrader):
        return [grader, *grader.graders.values()]
    return [grader]
