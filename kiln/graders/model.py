"""`score_model` and `label_model`: a judge model reads templated messages and answers.

The graders do not know the engine: they call a `Judge`, `(model, messages,
sampling_params) -> str` (or a `JudgeReply` with token counts). The server passes one that
renders the messages with the served model's chat template and generates on its engine;
Python callers pass their own (any function, another server's client, ...).

What the judge is asked (OpenAI's model graders ask for structured output, which a local
model cannot be forced to give, so Kiln asks in words and parses leniently). An instruction
is added to the first system message (or as one, in front):
- score_model: reply with a JSON object `{"result": <number from lo to hi>}`. The reply's
  score is the `result` (or `score`) of the first JSON object in it, else the first number in
  the text; it is clamped to `range` (default [0, 1]).
- label_model: reply with exactly one of the labels. The reply's label is a JSON object's
  `label` (or `result`), else the whole reply if it is a label, else the label that occurs
  first in the text as a whole word (case-insensitive). Reward 1 when it is a passing label.
A reply that yields no score or label scores 0 with `model_grader_parse_error`; a judge that
raises scores 0 with `model_grader_server_error` and the exception in its details.
The judge's sampling defaults to temperature 0 (a reward should not be a coin toss).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, ClassVar

from kiln.graders import templates
from kiln.graders.base import Fields, Grader, Judge, is_finite_number
from kiln.graders.result import GradeResult

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclasses.dataclass
class JudgeReply:
    """A judge's answer with its token counts (for the response's token usage)."""

    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclasses.dataclass(kw_only=True)
class _ModelGrader(Grader):
    input: list[dict[str, Any]]
    model: str

    def judge_models(self) -> set[str]:
        return {self.model}

    def messages(self, sample: dict, item: Any, instruction: str) -> list[dict[str, str]]:
        """The input rendered to plain chat messages, with the answer instruction added."""
        out = [{"role": "system" if m["role"] == "developer" else m["role"],
                "content": templates.render(_text(m["content"]), sample, item)} for m in self.input]
        if out and out[0]["role"] == "system":
            return [{"role": "system", "content": f"{out[0]['content']}\n\n{instruction}"}, *out[1:]]
        return [{"role": "system", "content": instruction}, *out]

    def ask(self, judge: Judge | None, messages: list[dict], params: dict) -> tuple[JudgeReply | None, GradeResult]:
        """The judge's reply, or None and the failed result to return."""
        if judge is None:
            return None, GradeResult.failed({"model_grader_server_error_details": "no judge was given to the grader"},
                                            model_grader_server_error=True)
        try:
            reply = judge(self.model, messages, params)
        except Exception as exc:  # a judge is caller code: its failure is this sample's grade, per OpenAI
            return None, GradeResult.failed({"model_grader_server_error_details": f"{type(exc).__name__}: {exc}"},
                                            model_grader_server_error=True)
        return (reply if isinstance(reply, JudgeReply) else JudgeReply(str(reply))), GradeResult(0.0)

    def finish(self, result: GradeResult, reply: JudgeReply) -> GradeResult:
        """Adds the judge's name and token usage to a result."""
        result.sampled_model_name = self.model
        if reply.prompt_tokens is not None and reply.completion_tokens is not None:
            total = reply.prompt_tokens + reply.completion_tokens
            result.token_usage = total
            result.token_usage_per_model = {self.model: {"prompt_tokens": reply.prompt_tokens,
                                                         "completion_tokens": reply.completion_tokens,
                                                         "total_tokens": total}}
        return result


@dataclasses.dataclass(kw_only=True)
class ScoreModelGrader(_ModelGrader):
    type: ClassVar[str] = "score_model"
    range: list[float] = dataclasses.field(default_factory=lambda: [0.0, 1.0])
    sampling_params: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, f: Fields) -> ScoreModelGrader:
        bounds = f.get("range", [0.0, 1.0])
        if (not isinstance(bounds, list) or len(bounds) != 2
                or not all(is_finite_number(b) for b in bounds)
                or bounds[0] >= bounds[1]):
            raise f.bad("range", "must be two finite numbers [low, high] with low < high")
        return cls(name=f.text("name"), model=f.text("model"), input=_input(f), range=[float(b) for b in bounds],
                   sampling_params=_sampling_params(f))

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        low, high = self.range
        instruction = (f'Reply with only a JSON object {{"result": <score>}}, where <score> is a number from {low:g} '
                       f"to {high:g}.")
        reply, result = self.ask(judge, self.messages(sample, item, instruction), dict(self.sampling_params or {}))
        if reply is None:
            return result
        score = parse_score(reply.text)
        if score is None:
            result = GradeResult.failed(model_grader_parse_error=True)
        else:
            result = GradeResult(min(max(score, low), high))
        result.scores = {"result": score, "judge_output": reply.text}
        return self.finish(result, reply)


@dataclasses.dataclass(kw_only=True)
class LabelModelGrader(_ModelGrader):
    type: ClassVar[str] = "label_model"
    labels: list[str]
    passing_labels: list[str]

    @classmethod
    def from_json(cls, f: Fields) -> LabelModelGrader:
        labels, passing = f.strings("labels"), f.strings("passing_labels")
        if len(set(labels)) != len(labels):
            raise f.bad("labels", "must not repeat a label")
        unknown = [p for p in passing if p not in labels]
        if unknown:
            raise f.bad("passing_labels", f"must be a subset of labels; {unknown[0]!r} is not a label")
        return cls(name=f.text("name"), model=f.text("model"), input=_input(f), labels=labels, passing_labels=passing)

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        instruction = "Reply with exactly one of these labels and nothing else: " + ", ".join(self.labels) + "."
        reply, result = self.ask(judge, self.messages(sample, item, instruction), {})
        if reply is None:
            return result
        label = parse_label(reply.text, self.labels)
        if label is None:
            result = GradeResult.failed(model_grader_parse_error=True)
        else:
            result = GradeResult(1.0 if label in self.passing_labels else 0.0)
        result.scores = {"label": label, "judge_output": reply.text}
        return self.finish(result, reply)


def parse_score(text: str) -> float | None:
    """A judge's score: `result` or `score` of the first JSON object in the reply, else
    the first number in it; None when there is neither."""
    obj = _first_json_object(text)
    for key in ("result", "score"):
        value = obj.get(key) if obj else None
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)
        if is_finite_number(value):
            return float(value)
    m = _NUMBER.search(text)
    if m is not None and math.isfinite(float(m.group())):
        return float(m.group())
    return None


def parse_label(text: str, labels: list[str]) -> str | None:
    """A judge's label (see the module docstring for the order of the rules)."""
    by_fold = {label.casefold(): label for label in labels}
    obj = _first_json_object(text)
    for key in ("label", "result"):
        value = obj.get(key) if obj else None
        if isinstance(value, str) and value.strip().casefold() in by_fold:
            return by_fold[value.strip().casefold()]
    whole = text.strip().strip("\"'`*.").strip().casefold()
    if whole in by_fold:
        return by_fold[whole]
    found = []
    for label in labels:
        m = re.search(rf"(?<!\w){re.escape(label)}(?!\w)", text, re.IGNORECASE)
        if m is not None:
            found.append((m.start(), -len(label), label))
    return min(found)[2] if found else None


def _first_json_object(text: str) -> dict | None:
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
        except ValueError:
            pass
        start = text.find("{", start + 1)
    return None


def _text(content: Any) -> str:
    """A message's content (a string, a text part, or a list of both) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text", "")
    return "".join(_text(c) for c in content)


def _input(f: Fields) -> list[dict[str, Any]]:
    """Checks the input messages: roles, and text-only content (a local judge reads text)."""
    messages = f.get("input")
    if not isinstance(messages, list) or not messages:
        raise f.bad("input", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        m = Fields(message, f.at("input") + f"[{i}]")
        m.choice("role", ROLES)
        if m.get("type", "message") != "message":
            raise m.bad("type", f"must be 'message'; got {m.get('type')!r}")
        content = m.get("content")
        if isinstance(content, str):
            m.text("content", template=True)
        elif isinstance(content, dict):
            _part(Fields(content, m.at("content")))
        elif isinstance(content, list) and content:
            for j, part in enumerate(content):
                if isinstance(part, str):
                    templates.check(part, f"{m.at('content')}[{j}]")
                else:
                    _part(Fields(part, f"{m.at('content')}[{j}]"))
        else:
            raise m.bad("content", "must be a string, a content part or a non-empty list of them")
    return messages


def _part(f: Fields) -> None:
    kind = f.get("type")
    if kind in ("input_image", "input_audio"):
        raise f.bad("type", f"{kind!r} is not supported locally: Kiln's judge reads text only")
    f.choice("type", TEXT_PARTS)
    f.text("text", template=True)


def _sampling_params(f: Fields) -> dict[str, Any] | None:
    if f.get("sampling_params") is None:
        return None
    p = Fields(f.get("sampling_params"), f.at("sampling_params"))
    max_tokens = p.get("max_completions_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise p.bad("max_completions_tokens", "must be a positive integer")
    seed = p.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise p.bad("seed", "must be an integer")
    temperature, top_p = p.number("temperature"), p.number("top_p")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise p.bad("temperature", "must be between 0 and 2")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise p.bad("top_p", "must be in (0, 1]")
    effort = p.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise p.bad("reasoning_effort", "must be a string")
    return {k: v for k, v in p.data.items() if k in ("max_completions_tokens", "seed", "temperature", "top_p",
                                                     "reasoning_effort") and v is not None}
