"""OpenAI's Responses API in terms of the chat path: input items -> chat messages, Responses tools
and `text.format` -> their chat forms, and a choice's text -> output items and stream events.

A Responses request becomes a chat completion request and is templated, constrained and parsed
exactly as one (openai_routes.prepare_chat, chat_output.OutputReader); only the shapes differ.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from kiln.engine.request import TokenLogprob
from kiln.errors import InvalidRequest
from kiln.models.tokenizer import KilnTokenizer
from kiln.server.chat_output import OutputReader, Parsed
from kiln.server.schemas import ChatCompletionRequest, ChatMessage, ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for logprobs


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input ------------------------------------------------------------------------------------


def _text(content: Any, param: str) -> str:
    """A content field's text: a string, or text parts joined (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of content parts", param=param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"only text content parts are supported, not {kind!r}", param=f"{param}[{j}].type")
        out.append(part["text"])
    return "".join(out)


def _require_str(item: dict, key: str, param: str) -> str:
    if not isinstance(item.get(key), str):
        raise InvalidRequest(f"{key} must be a string", param=f"{param}.{key}")
    return item[key]


def input_items(raw: str | list | None) -> list[dict[str, Any]]:
    """A request's `input` as stored items, each with an id: messages (text parts), function calls
    and their outputs. Reasoning items are kept (the chat template decides what to show of them)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    items = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = _require_str(item, "role", param)
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"role must be user, assistant, system or developer, not {role!r}",
                                     param=f"{param}.role")
            text = _text(item.get("content"), f"{param}.content")
            part = "output_text" if role == "assistant" else "input_text"
            content = [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]
            items.append({"type": "message", "id": item.get("id") or new_item_id("msg"), "role": role,
                          "content": content, "status": "completed"})
        elif kind == "function_call":
            items.append({"type": "function_call", "id": item.get("id") or new_item_id("fc"),
                          "call_id": _require_str(item, "call_id", param), "name": _require_str(item, "name", param),
                          "arguments": _require_str(item, "arguments", param), "status": "completed"})
        elif kind == "function_call_output":
            items.append({"type": "function_call_output", "id": item.get("id") or new_item_id("fco"),
                          "call_id": _require_str(item, "call_id", param),
                          "output": _text(item.get("output"), f"{param}.output"), "status": "completed"})
        elif kind == "reasoning":
            items.append({"type": "reasoning", "id": item.get("id") or new_item_id("rs"),
                          "summary": item.get("summary") or [], "content": item.get("content") or []})
        elif kind == "mcp_call":
            items.append({**item, "id": _require_str(item, "id", param), "name": _require_str(item, "name", param),
                          "arguments": _require_str(item, "arguments", param)})
        elif kind == "mcp_list_tools":
            items.append({**item, "id": item.get("id") or new_item_id("mcpl")})
        else:
            raise InvalidRequest(f"input item type {kind!r} is not supported (message, function_call, "
                                 "function_call_output, reasoning, mcp_call, mcp_list_tools)", param=f"{param}.type")
    return items


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[ChatMessage]:
    """A conversation's items as chat messages: a function call joins the assistant turn before it,
    its output is a tool message, and reasoning is the following assistant turn's reasoning."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    reasoning = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append(ChatMessage(role=role, content=_text(item["content"], "input")))
        elif kind in ("function_call", "mcp_call"):
            call_id = item["call_id"] if kind == "function_call" else item["id"]
            call = {"id": call_id, "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            if kind == "mcp_call":  # its output travels in the same item
                output = item.get("output") if item.get("error") is None else f"error: {_error_text(item['error'])}"
                messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=output or ""))
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=item["output"]))
        assistant_side = kind in ("function_call", "mcp_call") or (kind == "message" and item["role"] == "assistant")
        if assistant_side and reasoning is not None:  # the turn the reasoning led to
            turn = next(m for m in reversed(messages) if m.role == "assistant")
            turn.reasoning_content, reasoning = reasoning, None
    return messages


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        parts = error.get("content")
        if isinstance(parts, list):
            return "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        return str(error.get("message", error))
    return str(error)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in Responses' form ({"type": "function", "name", "parameters", ...}, as
    kiln.agent.tools.AgentTools checked and lists them) in chat's form."""
    if not tools:
        return None
    out = []
    for tool in tools:
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") not in ("function", "mcp") or not isinstance(choice.get("name"), str):
        raise InvalidRequest("tool_choice must be none, auto, required, {\"type\": \"function\", \"name\": ...} "
                             "or {\"type\": \"mcp\", \"server_label\": ..., \"name\": ...}", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("text.format.type must be text, json_object or json_schema", param="text.format.type")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("a json_schema format needs a schema object", param="text.format.schema")
    return fmt


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                   "strict": fmt.get("strict")}}


def logprob_count(req: ResponsesRequest) -> int | None:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    if OUTPUT_LOGPROBS in (req.include or []):
        return req.top_logprobs or 0
    return None


def check_request(req: ResponsesRequest) -> None:
    """What a Responses request must satisfy before anything runs (beyond its chat request's checks)."""
    for field in ("background", "conversation"):
        if getattr(req, field):
            raise InvalidRequest(f"{field} is not supported", param=field)
    if req.truncation not in (None, "disabled"):
        raise InvalidRequest("truncation must be disabled", param="truncation")
    for field, least in (("max_output_tokens", 1), ("max_tool_calls", 0), ("max_turns", 1)):
        if getattr(req, field) is not None and getattr(req, field) < least:
            raise InvalidRequest(f"{field} must be at least {least}", param=field)
    text_format(req.text)
    logprob_count(req)


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]], tools: list[dict[str, Any]],
                 max_tokens: int | None) -> ChatCompletionRequest:
    """The chat completion request that generates one turn of this response: the conversation so
    far, every tool the model may call (Responses function tools), at most `max_tokens`."""
    messages = chat_messages(req.instructions, conversation)
    if not messages:
        raise InvalidRequest("input must not be empty", param="input")
    logprobs = logprob_count(req)
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=max_tokens, seed=req.seed,
        temperature=req.temperature, top_p=req.top_p, tools=chat_tools(tools),
        tool_choice=chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(text_format(req.text)), logprobs=logprobs is not None,
        top_logprobs=logprobs or None)


# ---- output -----------------------------------------------------------------------------------


def logprob_entries(tok: KilnTokenizer, items: list[TokenLogprob]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tok.decode([token_id], skip_special_tokens=False)
        return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in items]


class OutputItems:
    """One choice's output items, built as its text grows: reasoning, then a message, then function
    calls, each opened when its first text arrives and done when the next one opens or the choice
    ends. `feed` returns the stream events (without sequence numbers) and `items` holds the output
    items in order, so a whole response and a streamed one are the same items."""

    def __init__(self, reader: OutputReader, tok: KilnTokenizer, logprobs: bool, first_index: int = 0,
                 server_label=lambda name: None):
        self.reader, self.tok, self.with_logprobs = reader, tok, logprobs
        self.first_index = first_index  # output items of earlier turns come before these
        self.server_label = server_label  # a call's MCP server (it is an mcp_call item), or None
        self.text = ""
        self.sent = Parsed()
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still growing (also the last of `items`)
        self.logprobs: list[dict[str, Any]] = []

    def _index(self, item: dict[str, Any] | None = None) -> int:
        return self.first_index + (len(self.items) - 1 if item is None else self.items.index(item))

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._finish("completed")
        self.items.append(item)
        self.open = item
        index = self._index()
        events.append({"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)})
        part = {"message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(item["type"])
        if part is not None:
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(part)})
        return events

    def _finish(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self._index(item)}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            if self.with_logprobs:
                part["logprobs"] = self.logprobs
            events += [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                        "logprobs": part["logprobs"]},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        elif item["type"] == "mcp_call":
            events.append({"type": "response.mcp_call_arguments.done", **where, "arguments": item["arguments"]})
            if status == "completed":  # done once it ran (see `call_done`)
                item["status"] = "calling"
                return events
            # (cut off by max_output_tokens: never run, it ends here)
        else:
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": item})
        return events

    def calls(self) -> list[dict[str, Any]]:
        return [it for it in self.items if it["type"] in ("function_call", "mcp_call")]

    def feed(self, text: str, logprobs: list[TokenLogprob] | None, final: bool,
             status: str = "completed") -> list[dict[str, Any]]:
        """The events for `text` more of the choice (and, if final, its end with `status`)."""
        self.text += text
        new_logprobs = logprob_entries(self.tok, logprobs) if self.with_logprobs and logprobs else []
        self.logprobs += new_logprobs
        now = self.reader.parse(self.text, final)
        events: list[dict[str, Any]] = []
        if len(now.reasoning) > len(self.sent.reasoning):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [],
                                       "status": "in_progress"})
            delta = now.reasoning[len(self.sent.reasoning):]
            self.open["content"][0]["text"] += delta
            events.append({"type": "response.reasoning_text.delta", "item_id": self.open["id"],
                           "output_index": self._index(), "content_index": 0, "delta": delta})
        # a message opens for content, and for an empty answer (no content, no call) when it ends
        empty_end = (final and not now.calls and not any(i["type"] == "message" for i in self.items)
                     and not (now.reasoning and status != "completed"))
        if len(now.content) > len(self.sent.content) or empty_end:
            if self.open is None or self.open["type"] != "message":
                events += self._start({"type": "message", "id": new_item_id("msg"), "role": "assistant",
                                       "content": [], "status": "in_progress"})
            delta = now.content[len(self.sent.content):]
            self.open["content"][0]["text"] += delta
            if delta:
                events.append({"type": "response.output_text.delta", "item_id": self.open["id"],
                               "output_index": self._index(), "content_index": 0, "delta": delta,
                               "logprobs": new_logprobs})
        for i, call in enumerate(now.calls):
            sent = self.sent.calls[i].arguments if i < len(self.sent.calls) else None
            if sent is None:
                label = self.server_label(call.name)
                if label is None:
                    events += self._start({"type": "function_call", "id": new_item_id("fc"),
                                           "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": call.name,
                                           "arguments": "", "status": "in_progress"})
                else:
                    events += self._start({"type": "mcp_call", "id": new_item_id("mcp"), "server_label": label,
                                           "name": call.name, "arguments": "", "output": None, "error": None,
                                           "status": "in_progress"})
                sent = ""
            if len(call.arguments) > len(sent):
                delta = call.arguments[len(sent):]
                item = self.calls()[i]
                item["arguments"] += delta
                kind = "mcp_call" if item["type"] == "mcp_call" else "function_call"
                events.append({"type": f"response.{kind}_arguments.delta", "item_id": item["id"],
                               "output_index": self._index(item), "delta": delta})
        self.sent = now
        if final:
            events += self._finish(status)
        return events


def usage(turns: list[dict[str, int]], reasoning_tokens: int) -> dict[str, Any]:
    """A response's usage: every turn's tokens (an agent run's turns each read their whole conversation)."""
    prompt, completion = (sum(t[k] for t in turns) for k in ("prompt_tokens", "completion_tokens"))
    cached = sum(t["cached_tokens"] for t in turns)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


def response_object(rid: str, req: ResponsesRequest, model: str, created_at: int, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
    """The response object; a request's settings are echoed as OpenAI echoes them. `incomplete`: why
    an incomplete response stopped (max_output_tokens, max_tool_calls, max_turns, context_length)."""
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "error": error,
        "incomplete_details": {"reason": incomplete} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": (req.reasoning or {}).get("summary")},
        "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format(req.text)}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage_,
        "user": req.user, "metadata": req.metadata or {}, "background": False,
    }
