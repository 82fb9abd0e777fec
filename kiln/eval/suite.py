"""What an eval run evaluates: a suite.

A suite is the data (items, and for a grade-only run the samples that go with them), the
testing criteria (graders; a grader's `pass_threshold` decides pass or fail), how an item
becomes the model's input messages (a template over `{{ item.* }}` / `{{ sample.* }}`, or a
reference to a list of messages inside the item) and the sampling parameters.

Everything here is read from the JSON shapes of OpenAI's evals API, and every check raises
`InvalidRequest` naming the field at fault (`data_source.source.content[3].item`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jsonschema

from kiln import graders
from kiln.engine.params import SamplingParams
from kiln.errors import InvalidRequest
from kiln.graders import templates
from kiln.graders.base import is_finite_number

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
DEFAULT_SEED = 42  # runs are reproducible unless they ask otherwise


# ---- sampling --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each item's output is sampled: one completion (`completions`), or a Responses run
    (`responses`), which may call tools; Kiln runs its MCP and kiln_python tools turn by turn."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_completion_tokens: int | None = None  # None: up to the context
    seed: int | None = DEFAULT_SEED
    api: str = "completions"  # or "responses"
    responses: dict | None = None  # a responses run's other request fields (RESPONSE_FIELDS)

    @classmethod
    def from_json(cls, data: Any, param: str = "data_source.sampling_params", api: str = "completions",
                  mcp_commands: list[str] | None = None) -> Sampling:
        """mcp_commands: the stdio MCP commands a responses run's tools may start (None: any)."""
        if data is None:
            return cls(api=api)
        if not isinstance(data, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        for key in ("response_format", *RESPONSE_FIELDS):
            if data.get(key) is not None and (api == "completions" or key == "response_format"):
                raise InvalidRequest(f"{param}.{key} is not supported in {api} runs", param=f"{param}.{key}")
        temperature, top_p = data.get("temperature", 1.0), data.get("top_p", 1.0)
        if not is_finite_number(temperature) or not 0.0 <= temperature <= 2.0:
            raise InvalidRequest(f"{param}.temperature must be a number from 0 to 2", param=f"{param}.temperature")
        if not is_finite_number(top_p) or not 0.0 < top_p <= 1.0:
            raise InvalidRequest(f"{param}.top_p must be a number in (0, 1]", param=f"{param}.top_p")
        max_tokens, seed = data.get("max_completion_tokens"), data.get("seed", DEFAULT_SEED)
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise InvalidRequest(f"{param}.max_completion_tokens must be a positive integer",
                                 param=f"{param}.max_completion_tokens")
        if seed is not None and not _is_int(seed):
            raise InvalidRequest(f"{param}.seed must be an integer", param=f"{param}.seed")
        responses = {k: data[k] for k in RESPONSE_FIELDS if data.get(k) is not None} if api == "responses" else None
        if responses is not None:  # checked as a run takes them: MCP servers are reached now
            from kiln import agent  # the agent loop imports the server's request shapes; evals only need it here

            agent.check(responses, mcp_commands, at=param)
        return cls(float(temperature), float(top_p), max_tokens, seed, api, responses)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_completion_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed)

    def response_fields(self) -> dict[str, Any]:
        """A responses run's request fields (beside its input)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_output_tokens": self.max_completion_tokens,
                "seed": self.seed, **(self.responses or {})}


# A responses run's sampling params beside a completion's: OpenAI's tools and text, and Kiln's
# control of the agent loop (the Responses API's own fields of those names).
RESPONSE_FIELDS = ("tools", "text", "tool_choice", "parallel_tool_calls", "max_tool_calls", "max_turns")


def sampling_api(params: Any) -> str:
    """The run a suite's sampling params ask for: "responses" when they set a Responses field
    (tools, text, ...), else "completions"."""
    responses = isinstance(params, dict) and any(params.get(k) is not None for k in RESPONSE_FIELDS)
    return "responses" if responses else "completions"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- input messages --------------------------------------------------------------------------


def _content_text(content: Any, param: str) -> str:
    """A message's content (a string, a text part, or a list of them) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        kind = content.get("type")
        if kind not in TEXT_PARTS or not isinstance(content.get("text"), str):
            raise InvalidRequest(f"{param} must be text (a string or an input_text part); got {kind!r}", param=param)
        return content["text"]
    if isinstance(content, list) and content:
        return "".join(_content_text(part, f"{param}[{i}]") for i, part in enumerate(content))
    raise InvalidRequest(f"{param} must be a string, a text part or a non-empty list of them", param=param)


def _message(message: Any, param: str) -> dict[str, str]:
    """A chat message with text content, the `developer` role read as `system`."""
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be a message object", param=param)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{param}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{param}.role")
    if message.get("type", "message") != "message":
        raise InvalidRequest(f"{param}.type must be 'message'", param=f"{param}.type")
    return {"role": "system" if role == "developer" else role,
            "content": _content_text(message.get("content"), f"{param}.content")}


@dataclasses.dataclass(frozen=True)
class Template:
    """Input messages whose text is rendered with the item (and a given sample)."""

    messages: tuple[dict[str, str], ...]

    def render(self, item: dict, sample: dict | None = None) -> list[dict[str, str]]:
        return [{"role": m["role"], "content": templates.render(m["content"], sample or {}, item)}
                for m in self.messages]

    def to_json(self) -> dict[str, Any]:
        return {"type": "template", "template": [dict(m) for m in self.messages]}


@dataclasses.dataclass(frozen=True)
class ItemReference:
    """Input messages read from the item: `item.messages` names a list of messages (or a string,
    sent as one user message)."""

    reference: str

    def render(self, item: dict, sample: dict | None = None) -> list[dict[str, str]]:
        path = templates.parse_path(self.reference)
        value = templates.lookup({"item": item}, path) if path else None
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list) or not value:
            raise InvalidRequest(f"{self.reference} is not a list of messages in this item", param="item_reference")
        return [_message(m, f"{self.reference}[{i}]") for i, m in enumerate(value)]

    def to_json(self) -> dict[str, Any]:
        return {"type": "item_reference", "item_reference": self.reference}


InputMessages = Template | ItemReference


def input_messages(data: Any, param: str = "data_source.input_messages") -> InputMessages:
    """`{"type": "template", "template": [...]}` or `{"type": "item_reference", "item_reference": "item.x"}`;
    a plain list of messages is a template and a plain string an item reference (Python API)."""
    if isinstance(data, list):
        data = {"type": "template", "template": data}
    elif isinstance(data, str):
        data = {"type": "item_reference", "item_reference": data}
    if not isinstance(data, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    kind = data.get("type")
    if kind == "template":
        messages = data.get("template")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(f"{param}.template must be a non-empty list of messages", param=f"{param}.template")
        out = tuple(_message(m, f"{param}.template[{i}]") for i, m in enumerate(messages))
        for i, m in enumerate(out):
            templates.check(m["content"], f"{param}.template[{i}].content")
        return Template(out)
    if kind == "item_reference":
        reference = data.get("item_reference")
        path = templates.parse_path(reference) if isinstance(reference, str) else None
        if not path or path[0] != "item" or len(path) < 2:
            raise InvalidRequest(f"{param}.item_reference must name a field of the item, such as item.messages",
                                 param=f"{param}.item_reference")
        return ItemReference(reference)
    raise InvalidRequest(f"{param}.type must be template or item_reference; got {kind!r}", param=f"{param}.type")


# ---- criteria --------------------------------------------------------------------------------


def criteria(data: Any, param: str = "testing_criteria") -> list[graders.Grader]:
    """Testing criteria: grader JSON (or, from Python, graders and `(sample, item) -> float`
    functions), with distinct names (results are reported by name)."""
    if not isinstance(data, list | tuple) or not data:
        raise InvalidRequest(f"{param} must be a non-empty list of graders", param=param)
    out: list[graders.Grader] = []
    for i, c in enumerate(data):
        grader = graders.validate(c, param=f"{param}[{i}]") if isinstance(c, dict) else graders.build(c)
        if grader.name in {g.name for g in out}:
            raise InvalidRequest(f"{param}[{i}].name {grader.name!r} is used by another criterion; names must be "
                                 "distinct", param=f"{param}[{i}].name")
        out.append(grader)
    return out


# ---- items -----------------------------------------------------------------------------------


def schema_validator(schema: Any, param: str = "data_source_config.item_schema"):
    """A JSON Schema validator for items, or InvalidRequest if the schema is not one."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON Schema object", param=param)
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(f"{param} is not a valid JSON Schema: {exc.message}", param=param) from None
    return cls(schema)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a data source: the item and, for a grade-only run, its sample."""

    item: Any
    sample: Any = None
    where: str = ""  # the row's place in the request, for error messages
    param: str = ""  # the request field that holds it


def check_items(rows: Sequence[Row], schema: dict | None) -> None:
    """Every row's item is an object matching `schema` (InvalidRequest naming the item's index)."""
    validator = schema_validator(schema) if schema is not None else None
    for i, row in enumerate(rows):
        if not isinstance(row.item, dict):
            raise InvalidRequest(f"item {i} ({row.where}) must be an object", param=row.param)
        if validator is not None:
            error = jsonschema.exceptions.best_match(validator.iter_errors(row.item))
            if error is not None:
                at = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in error.absolute_path)
                raise InvalidRequest(f"item {i} ({row.where}) does not match the eval's item_schema: "
                                     f"{error.message}{' at ' + at if at else ''}", param=row.param)


def rows_from_content(content: Any, param: str) -> list[Row]:
    """`[{"item": {...}, "sample": {...}}, ...]` (the sample is optional)."""
    if not isinstance(content, list) or not content:
        raise InvalidRequest(f"{param} must be a non-empty list of {{\"item\": ...}} rows", param=param)
    rows = []
    for i, row in enumerate(content):
        if not isinstance(row, dict) or "item" not in row or set(row) - {"item", "sample"}:
            raise InvalidRequest(f"{param}[{i}] must be {{\"item\": {{...}}, \"sample\": {{...}}}} (sample optional)",
                                 param=f"{param}[{i}]")
        rows.append(Row(row["item"], row.get("sample"), f"{param}[{i}].item", f"{param}[{i}].item"))
    return rows


def rows_from_jsonl(content: bytes | str, what: str, param: str) -> list[Row]:
    """A JSONL file: each line `{"item": ..., "sample": ...}`, or a bare item object."""
    text = content.decode("utf-8", errors="replace") if isinstance(content, bytes) else content
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise InvalidRequest(f"line {number} of {what} is not JSON: {exc}", param=param) from None
        where = f"line {number} of {what}"
        if isinstance(value, dict) and "item" in value and not set(value) - {"item", "sample"}:
            rows.append(Row(value["item"], value.get("sample"), where, param))
        else:
            rows.append(Row(value, None, where, param))
    if not rows:
        raise InvalidRequest(f"{what} has no items", param=param)
    return rows


def as_sample(value: Any, where: str, param: str | None = None) -> dict:
    """A given sample as the graders' `sample` namespace: output text becomes the full namespace
    (output_json, choices), and the row's own keys are kept over it."""
    if isinstance(value, str):
        return templates.make_sample(value)
    if not isinstance(value, dict):
        raise InvalidRequest(f"the sample of {where} must be an object or a string", param=param or where)
    text = value.get("output_text")
    if not isinstance(text, str):
        choices = value.get("choices")
        message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(
            choices[0], dict) else None
        text = message.get("content") if isinstance(message, dict) else None
    return {**templates.make_sample(text), **value} if isinstance(text, str) else dict(value)


# ---- the suite -------------------------------------------------------------------------------


@dataclasses.dataclass
class Suite:
    """items[i] is graded by every criterion on its sample: samples[i] when given (a grade-only
    run), or a completion of `input` rendered with the item."""

    items: list[dict]
    criteria: list[graders.Grader]
    input: InputMessages | None = None
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    samples: list[dict | None] | None = None

    def __post_init__(self):
        if self.input is None and self.samples is None:
            raise InvalidRequest("a run either samples (input messages) or grades given samples", param="input")
        if self.samples is not None and len(self.samples) != len(self.items):
            raise ValueError(f"{len(self.items)} items but {len(self.samples)} samples")

    @property
    def samples_given(self) -> bool:
        return self.input is None

    def messages(self, index: int) -> list[dict[str, str]]:
        given = self.samples[index] if self.samples is not None else None
        return self.input.render(self.items[index], given) if self.input is not None else []
