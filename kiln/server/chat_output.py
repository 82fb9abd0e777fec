"""A chat choice's text, read as an assistant message: reasoning, content and tool calls.

Reasoning is the `<think>…</think>` span some templates emit. Tool calls are read in the
model family's own format under `tool_choice: "auto"` (Hermes/Qwen `<tool_call>` tags, a
Llama 3 JSON call, Mistral's `[TOOL_CALLS]`), or from the constrained JSON that "required"
and named choices produce. Parsing the text so far is prefix-stable (anything that could
still turn into a marker is held back), so a stream sends the difference between successive
parses, and a whole response is the final parse.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("hermes", "llama3_json", "mistral")


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclasses.dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(obj: Any, args_key: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_key if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in text, one after another (separated by whitespace or ';'); None if
    anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


# ---- "required": the constrained array of calls, read while it is written ------------------------


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value that starts at text[i] ends; None if the text ends first."""
    n = len(text)
    if i >= n:
        return None
    if text[i] == '"':
        j = i + 1
        while j < n:
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "[{":
        depth, j = 0, i
        while j < n:
            if text[j] == '"':
                end = _value_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if text[j] in "[{":
                depth += 1
            elif text[j] in "]}":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: up to what follows it
    while j < n and text[j] not in ",]} \t\r\n":
        j += 1
    return j if j < n else None


def required_calls(text: str) -> list[ToolCall]:
    """The calls of `[{"name": ..., "parameters": {...}}, ...]` written so far, each once its name is
    read, with its arguments as the raw text written so far (a prefix of what they will be).
    Arguments are the model's own text, so a stream's pieces join into exactly the whole response's
    arguments, and a call cut off by max_tokens keeps what it had."""
    calls: list[ToolCall] = []
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return calls
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text) or text[i] not in "{,":  # (the end of the text, or of the array)
            return calls
        if text[i] == ",":
            i += 1
            continue
        i, name, arguments, whole = _read_call(text, i + 1)
        if isinstance(name, str):
            calls.append(ToolCall(name, arguments))
        if not whole:
            return calls


def _read_call(text: str, i: int) -> tuple[int, Any, str, bool]:
    """One call object's members from text[i] (after its `{`): (end, name, arguments, whether it closed)."""
    name, arguments = None, ""
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return i, name, arguments, False
        if text[i] == "}":
            return i + 1, name, arguments, True
        if text[i] == ",":
            i += 1
            continue
        end = _value_end(text, i)
        if end is None or text[i] != '"':
            return i, name, arguments, False
        key = json.loads(text[i:end])
        i = _skip_space(text, end)
        if not text.startswith(":", i):
            return i, name, arguments, False
        i = _skip_space(text, i + 1)
        end = _value_end(text, i)
        if key in ("parameters", "arguments"):
            arguments = text[i:] if end is None else text[i:end]
        elif key == "name" and end is not None:
            name = json.loads(text[i:end])
        if end is None:
            return len(text), name, arguments, False
        i = end


# ---- tool-call formats: (content, calls, rest) where rest is text not read yet ----------------


def hermes(text: str, final: bool) -> tuple[str, list[ToolCall]] | None:
    start = text.find("<tool_call>")
    if start < 0:
        return text[: len(text) - (0 if final else _held(text, "<tool_call>"))], []
    calls = []
    for block in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text[start:], re.S):
        closed = bool(block.group(2))
        if not closed and not final:
            break
        values = _json_values(block.group(1).strip())
        call = _call(values[0]) if values and len(values) == 1 else None
        if call is None:
            return None if final else (text[:start], calls)
        calls.append(call)
    return text[:start], calls


def llama3_json(text: str, final: bool) -> tuple[str, list[ToolCall]] | None:
    body = text.lstrip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    elif not body.startswith("{"):
        held = not final and (not body or "<|python_tag|>".startswith(body))
        return ("" if held else text), []
    if not final:
        return "", []
    values = _json_values(body)
    calls = [_call(v) for v in values or []]
    return ("", calls) if values and all(calls) else None


def mistral(text: str, final: bool) -> tuple[str, list[ToolCall]] | None:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text[: len(text) - (0 if final else _held(text, "[TOOL_CALLS]"))], []
    if not final:
        return text[:start], []
    body = text[start + len("[TOOL_CALLS]"):].strip()
    if body.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        values = _json_values(body)
        calls = [_call(v) for v in (values[0] if values and isinstance(values[0], list) else [])]
    else:  # newer templates: [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        calls = []
        for part in body.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            values = _json_values(args) if sep else None
            calls.append(ToolCall(name.strip(), json.dumps(values[0])) if values and len(values) == 1 else None)
    return (text[:start], calls) if calls and all(calls) else None


FORMATS = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}


def choose_parser(setting: str, chat_template: str | None) -> str:
    """The tool-call format: the configured one, or the one the chat template writes."""
    if setting != "auto":
        return setting
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "<|start_header_id|>" in template):
        return "llama3_json"
    return "hermes"


def thinks(setting: str, chat_template: str | None) -> bool:
    return setting == "think" or (setting == "auto" and THINK_START in (chat_template or ""))


@dataclasses.dataclass
class OutputReader:
    """How one request's choices are read: reasoning (and whether the prompt opened it), and the
    tool mode (none | auto | required | named) with its format or function name."""

    reasoning: bool = False
    opens_in_reasoning: bool = False
    tool_mode: str = "none"
    tool_format: str = "hermes"
    function: str | None = None

    def parse(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        rest = text
        if self.reasoning:
            body = text[len(text) - len(text.lstrip()):] if not self.opens_in_reasoning else text
            in_think = self.opens_in_reasoning or body.startswith(THINK_START)
            if in_think:
                body = body[len(THINK_START):] if body.startswith(THINK_START) else body
                reasoning, closed, rest = body.partition(THINK_END)
                if not closed:
                    out.reasoning = reasoning[: len(reasoning) - (0 if final else _held(reasoning, THINK_END))]
                    return out
                out.reasoning, rest = reasoning, rest.lstrip()
            elif not final and THINK_START.startswith(body):
                return out  # may still open a think block
        if self.tool_mode == "auto":
            split = FORMATS[self.tool_format](rest, final)
            if split is None:  # not a well-formed call after all: it is content
                out.content = rest
            else:
                out.content, out.calls = split
        elif self.tool_mode == "named":
            out.calls = [ToolCall(self.function, rest)]
        elif self.tool_mode == "required":
            out.calls = required_calls(rest)
            if final and not out.calls:  # (not one call's name came out: the text is all there is)
                out.content = rest
        else:
            out.content = rest
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole assistant message of a finished choice."""
        parsed = self.parse(text, final=True)
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.reasoning:
            msg["reasoning_content"] = parsed.reasoning or None
        if parsed.calls:
            msg["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
            msg["content"] = parsed.content or None
        return msg


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class StreamedChoice:
    """One streamed choice: each delta carries what the latest parse added."""

    def __init__(self, reader: OutputReader):
        self.reader = reader
        self.text = ""
        self.sent = Parsed()
        self.call_ids: list[str] = []

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        self.text += text
        now = self.reader.parse(self.text, final)
        delta: dict[str, Any] = {}
        if len(now.reasoning) > len(self.sent.reasoning):
            delta["reasoning_content"] = now.reasoning[len(self.sent.reasoning):]
        if len(now.content) > len(self.sent.content):
            delta["content"] = now.content[len(self.sent.content):]
        calls = []
        for i, call in enumerate(now.calls):
            if i == len(self.call_ids):
                self.call_ids.append(new_call_id())
                calls.append({"index": i, "id": self.call_ids[i], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > (sent := len(self.sent.calls[i].arguments)):
                calls.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
        if calls:
            delta["tool_calls"] = calls
        self.sent = now
        return delta

    @property
    def called(self) -> bool:
        return bool(self.call_ids)
