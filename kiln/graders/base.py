"""The grader interface, the registry of grader types, and the JSON field checks they share.

Every grader is a dataclass built from OpenAI's grader JSON by `parse`, which names the
offending field (`grader.graders.correct.operation`) in the `InvalidRequest` it raises, so
a bad config fails once, up front, and not at every sample of a training run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

from kiln.errors import InvalidRequest
from kiln.graders import templates
from kiln.graders.result import GradeResult

log = logging.getLogger("kiln.graders")

TYPES: dict[str, type[Grader]] = {}  # grader JSON "type" -> class, filled as the modules load
_MISSING = object()

# A judge: (model, messages, sampling_params) -> the reply text (or a model.JudgeReply with token counts)
Judge = Callable[[str, list[dict], dict], Any]


def is_finite_number(value: Any) -> bool:
    """A JSON number that is a finite float (not a bool, not an integer too big for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class Fields:
    """A grader JSON object and its path in the request, for checks that name the field."""

    def __init__(self, data: Any, param: str):
        if not isinstance(data, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        self.data, self.param = data, param

    def at(self, key: str | int) -> str:
        return f"{self.param}[{key}]" if isinstance(key, int) else f"{self.param}.{key}"

    def bad(self, key: str, message: str) -> InvalidRequest:
        return InvalidRequest(f"{self.at(key)} {message}", param=self.at(key))

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def text(self, key: str, default: Any = _MISSING, template: bool = False) -> str:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise self.bad(key, "is required")
        if not isinstance(value, str):
            raise self.bad(key, f"must be a string, got {type(value).__name__}")
        if template:
            templates.check(value, self.at(key))
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self.data.get(key)
        if value not in options:
            raise self.bad(key, f"must be one of {', '.join(options)}; got {value!r}")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if not is_finite_number(value):
            raise self.bad(key, f"must be a finite number, got {type(value).__name__}")
        return float(value)

    def strings(self, key: str) -> list[str]:
        value = self.data.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise self.bad(key, "must be a non-empty list of non-empty strings")
        return list(value)


@dataclasses.dataclass(kw_only=True)
class Grader:
    """Grades one sample against one dataset item. Subclasses set `type` and implement
    `from_json` and `_grade`; `grade` adds the timing, the name, and turns any unexpected
    exception into `other_error` so one bad sample never stops a run."""

    type: ClassVar[str] = ""
    name: str
    pass_threshold: float | None = None  # evals' testing criteria carry one; run ignores it

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.type and "from_json" in cls.__dict__:
            TYPES[cls.type] = cls

    @classmethod
    def from_json(cls, f: Fields) -> Grader:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """The normalised grader JSON: every field, defaults filled in, None dropped."""
        out: dict[str, Any] = {"type": self.type}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.metadata.get("json", True) and value is not None:
                out[field.name] = value
        return out

    def grade(self, sample: dict | str, item: Any = None, judge: Judge | None = None) -> GradeResult:
        """Grades `sample` (OpenAI's sample dict, or a model's output text) against `item`."""
        start = time.perf_counter()
        if isinstance(sample, str):
            sample = templates.make_sample(sample)
        if not isinstance(sample, dict):
            result = GradeResult.failed(sample_parse_error=True)
        else:
            try:
                result = self._grade(sample, {} if item is None else item, judge)
            except Exception:  # a bug here must cost one sample, not the run
                log.exception("grader %r failed", self.name)
                result = GradeResult.failed(other_error=True)
        result.name, result.type = self.name, self.type
        result.execution_time = time.perf_counter() - start
        return result

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        raise NotImplementedError

    def passed(self, result: GradeResult) -> bool:
        """Evals' pass rule: no error and reward >= pass_threshold (full marks when unset)."""
        threshold = 1.0 if self.pass_threshold is None else self.pass_threshold
        return not result.errors.any and result.reward >= threshold

    def judge_models(self) -> set[str]:
        """The judge models this grader (and its parts) call; the server checks them up front."""
        return set()


def parse(data: Any, param: str = "grader", allowed: tuple[str, ...] | None = None) -> Grader:
    """Grader JSON -> grader object, or InvalidRequest naming the field at fault."""
    f = Fields(data, param)
    kind = f.get("type")
    names = allowed or tuple(TYPES)
    if not isinstance(kind, str) or kind not in names:
        raise f.bad("type", f"must be one of {', '.join(names)}; got {kind!r}")
    grader = TYPES[kind].from_json(f)
    grader.pass_threshold = f.number("pass_threshold")
    return grader


def runtime_error_details(exc: BaseException, limit: int = 4000) -> str:
    """The last lines of a traceback: what a grader's author needs, bounded in size."""
    text = "".join(traceback.format_exception(exc))
    return text[-limit:]


def as_reward(value: Any) -> tuple[float | None, str | None]:
    """A grader function's return value as a reward, or why it is not one."""
    if not isinstance(value, int | float):  # bools count: True is 1.0
        return None, f"grade() must return a number, got {type(value).__name__}"
    if not math.isfinite(value):
        return None, f"grade() must return a finite number, got {value}"
    return float(value), None


@dataclasses.dataclass(kw_only=True)
class FunctionGrader(Grader):
    """A plain Python callable `(sample, item) -> float` used as a reward. It is the caller's
    own code, so it runs in this process, unsandboxed; its failures score 0 and raise
    `python_grader_runtime_error` like a sandboxed Python grader's."""

    type: ClassVar[str] = "function"
    fn: Callable[[dict, Any], float] = dataclasses.field(metadata={"json": False})

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        try:
            value = self.fn(sample, item)
        except Exception as exc:  # user code: its error is the sample's runtime error, not ours
            return GradeResult.failed({"python_grader_runtime_error_details": runtime_error_details(exc)},
                                      python_grader_runtime_error=True)
        reward, problem = as_reward(value)
        if problem:
            return GradeResult.failed({"python_grader_runtime_error_details": problem},
                                      python_grader_runtime_error=True)
        return GradeResult(reward)


def as_grader(grader: Any, param: str = "grader") -> Grader:
    """A grader from grader JSON, a grader object, or a plain `(sample, item) -> float`."""
    if isinstance(grader, Grader):
        return grader
    if isinstance(grader, dict):
        return parse(grader, param)
    if callable(grader):
        return FunctionGrader(name=getattr(grader, "__name__", "function"), fn=grader)
    raise TypeError(f"a grader is grader JSON (a dict), a Grader or a callable, not {type(grader).__name__}")
