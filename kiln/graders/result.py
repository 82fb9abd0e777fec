"""What grading one sample yields, in the shape of OpenAI's `GraderRunResponse`.

A grader never raises for a bad sample: whatever goes wrong (a formula dividing by zero, a
Python grader that crashes, a judge whose reply has no number) scores 0 and raises one of
the error flags below, so a training step or an eval keeps going and the caller can count
what failed. The flag names are OpenAI's, so tooling written against its API reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
         "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
         "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error")
DETAILS = ("model_grader_server_error_details", "python_grader_runtime_error_details",
           "python_grader_server_error_type")


@dataclasses.dataclass
class Errors:
    """OpenAI's error flags, plus their three detail strings."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False

    @property
    def any(self) -> bool:
        return any(getattr(self, f) for f in FLAGS)

    def raised(self) -> list[str]:
        """The names of the flags that are set."""
        return [f for f in FLAGS if getattr(self, f)]

    def merge(self, other: Errors) -> None:
        """ORs another result's flags into these (a multi grader reports its parts' failures)."""
        for f in FLAGS:
            setattr(self, f, getattr(self, f) or getattr(other, f))
        for d in DETAILS:
            if getattr(self, d) is None:
                setattr(self, d, getattr(other, d))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GradeResult:
    """One sample's grade. `reward` is what training and evals use; the rest explains it."""

    reward: float
    name: str = ""
    type: str = ""
    sub_rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)
    errors: Errors = dataclasses.field(default_factory=Errors)
    execution_time: float = 0.0
    sampled_model_name: str | None = None
    token_usage: int | None = None
    token_usage_per_model: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def failed(cls, details: dict[str, Any] | None = None, **flags: bool) -> GradeResult:
        """Reward 0 with the given flags (and detail strings) raised."""
        return cls(0.0, errors=Errors(**flags, **(details or {})))

    def to_openai(self) -> dict[str, Any]:
        """The body of POST /v1/fine_tuning/alpha/graders/run."""
        return {"reward": self.reward, "sub_rewards": dict(self.sub_rewards),
                "model_grader_token_usage_per_model": dict(self.token_usage_per_model),
                "metadata": {"name": self.name, "type": self.type, "errors": self.errors.to_json(),
                             "execution_time": self.execution_time, "scores": dict(self.scores),
                             "token_usage": self.token_usage, "sampled_model_name": self.sampled_model_name}}
