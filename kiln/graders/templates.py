"""OpenAI's grader templates: `{{ item.answer }}`, `{{ sample.output_text }}` and deeper paths.

A placeholder is `{{ path }}` (spaces inside the braces are optional). The path starts with a
namespace, `item` (the dataset row) or `sample` (the model's output, see `make_sample`), then
walks keys and list indices: `.key`, `.0`, `[0]`, `['key']` or `["key"]`, as in
`{{ sample.choices[0].message.content }}` or `{{ item.refs.0 }}`.

Rendering rules (ours where OpenAI's docs are silent):
- a string value is inserted as is; any other value (number, list, object, null) as JSON;
- a path that does not resolve renders as the empty string: `output_json` is `{}` for a
  sample that is not JSON, and a grader over such a sample should simply score low, not fail;
- text that is not a path (`{{"score": 1}}` in a judge prompt) is left untouched;
- a path under any namespace other than `item` or `sample` is refused when the grader is
  validated, since it is almost always a typo (`{{ items.answer }}`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kiln.errors import InvalidRequest

NAMESPACES = ("item", "sample")
_PLACEHOLDER = re.compile(r"\{\{\s*(.*?)\s*\}\}", re.S)
_ROOT = re.compile(r"[A-Za-z_]\w*")
_SEGMENT = re.compile(r"\.(\w+)|\[\s*(-?\d+)\s*\]|\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]")
_INDEX = re.compile(r"-?\d+")
_MISSING = object()


def parse_path(text: str) -> list[str | int] | None:
    """`sample.choices[0].message` -> ["sample", "choices", 0, "message"]; None if not a path."""
    m = _ROOT.match(text)
    if m is None:
        return None
    parts: list[str | int] = [m.group()]
    pos = m.end()
    while pos < len(text):
        m = _SEGMENT.match(text, pos)
        if m is None:
            return None
        dotted, index, single, double = m.groups()
        parts.append(int(index) if index is not None else next(v for v in (dotted, single, double) if v is not None))
        pos = m.end()
    return parts


def lookup(value: Any, parts: list[str | int]) -> Any:
    """Walks `parts` down dicts and lists; `_MISSING` where a step does not exist."""
    for part in parts:
        if isinstance(value, dict):
            key = str(part)
            if key not in value:
                return _MISSING
            value = value[key]
        elif isinstance(value, list | tuple) and (isinstance(part, int) or _INDEX.fullmatch(part)):
            index = int(part)
            if not -len(value) <= index < len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


def render(template: str, sample: dict, item: Any) -> str:
    """The template with every `item`/`sample` placeholder replaced."""
    scope = {"sample": sample, "item": item}

    def substitute(m: re.Match) -> str:
        path = parse_path(m.group(1))
        if path is None or path[0] not in scope:
            return m.group(0)
        value = lookup(scope[path[0]], path[1:])
        if value is _MISSING:
            return ""
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _PLACEHOLDER.sub(substitute, template)


def check(template: str, param: str) -> None:
    """Refuses placeholders under an unknown namespace, naming the field."""
    for m in _PLACEHOLDER.finditer(template):
        path = parse_path(m.group(1))
        if path is not None and path[0] not in NAMESPACES:
            raise InvalidRequest(f"{param} uses the unknown template variable {m.group(0)!r}: "
                                 f"templates read only the item and sample namespaces", param=param)


def make_sample(output_text: str) -> dict[str, Any]:
    """OpenAI's `sample` namespace for a model output given as text (the API's
    `model_sample`): `output_json` is the parsed output when the text is a JSON object or
    array, `{}` otherwise; `choices` holds the one assistant message."""
    try:
        parsed = json.loads(output_text)
    except ValueError:
        parsed = None
    return {"output_text": output_text,
            "output_json": parsed if isinstance(parsed, dict | list) else {},
            "output_tools": [],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": output_text},
                         "finish_reason": "stop"}]}
