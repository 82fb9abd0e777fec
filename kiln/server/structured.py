"""What a request body constrains its output to: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, and the tool-call schemas of
`tool_choice` "required" or a named function."""

from __future__ import annotations

from typing import Any

from kiln.engine.grammar import GrammarSpec
from kiln.errors import InvalidRequest

ANY_OBJECT = {"type": "object"}


def _response_format(rf: dict[str, Any]) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json", ANY_OBJECT, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest("response_format of type json_schema needs a json_schema object",
                                 param="response_format.json_schema")
        return GrammarSpec("json", js.get("schema") or ANY_OBJECT, "response_format.json_schema.schema")
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                         param="response_format.type")


def output_constraint(req) -> GrammarSpec | None:
    """The one output constraint a body gives (at most one may be given)."""
    found: list[GrammarSpec] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        found += [spec] if spec else []
    so = req.structured_outputs or {}
    for key in ("json", "regex", "choice", "grammar"):
        if so.get(key) is not None:
            found.append(GrammarSpec(key, so[key], f"structured_outputs.{key}"))
    if so.get("json_object"):
        found.append(GrammarSpec("json", ANY_OBJECT, "structured_outputs.json_object"))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            found.append(GrammarSpec(kind, getattr(req, field), field))
    if len(found) > 1:
        raise InvalidRequest(f"give one output constraint, not {found[0].param} and {found[1].param}",
                             param=found[1].param)
    return found[0] if found else None


# ---- tools ------------------------------------------------------------------------------------


def tool_parameters(tools: list[dict[str, Any]] | None) -> dict[str, dict]:
    """Each function tool's name -> its parameters' JSON Schema; 400 naming a malformed tool."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequest("each tool must be {\"type\": \"function\", \"function\": {...}}", param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].function.name")
        parameters = function.get("parameters") or ANY_OBJECT
        if not isinstance(parameters, dict):
            raise InvalidRequest("function parameters must be a JSON Schema object",
                                 param=f"tools[{i}].function.parameters")
        out[name] = parameters
    return out


def tool_choice(req, tools: dict[str, dict]) -> tuple[str, str | None]:
    """(mode, function name): mode none | auto | required | named."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be none, auto, required or a named function", param="tool_choice")
        if choice != "none" and not tools:
            raise InvalidRequest(f"tool_choice {choice} needs tools", param="tool_choice")
        return choice, None
    function = choice.get("function") if choice.get("type", "function") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                             param="tool_choice")
    if name not in tools:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "named", name


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties
    and says nothing of others: a constrained call then ends when its arguments do, instead of
    inventing keys (what it produces still validates against the original schema)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in ("items", "not", "if", "then", "else"):
        if key in out:
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_call_constraint(mode: str, name: str | None, tools: dict[str, dict], parallel: bool) -> GrammarSpec | None:
    """Required: a JSON array of {"name", "parameters"} calls of the given tools (one call unless
    parallel_tool_calls); named: that function's arguments."""
    if mode == "named":
        return GrammarSpec("json", closed(tools[name]), "tools")
    if mode != "required":
        return None
    call = [{"type": "object", "properties": {"name": {"const": n}, "parameters": closed(p)},
             "required": ["name", "parameters"], "additionalProperties": False} for n, p in tools.items()]
    schema = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json", schema, "tools")
