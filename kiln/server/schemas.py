"""Request bodies of the OpenAI-compatible API (msgspec structs: validation + OpenAPI schema).

Fields follow OpenAI's API plus vLLM's sampling extras; unknown fields are ignored as
OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from msgspec import Struct


class StreamOptions(Struct):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """Shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning, for templates that show it


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    thinking_token_budget: int | None = None  # vLLM's: at most this many tokens of <think> reasoning
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ResponsesRequest(Struct, kw_only=True):
    """POST /v1/responses: OpenAI's Responses API (input items, stored responses, function tools)."""

    model: str | None = None
    input: str | list[Any] | None = None  # text, or input items
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    max_turns: int | None = None  # Kiln: an agent run's model turns at most (default 16)
    seed: int | None = None  # Kiln, as in chat completions: reproducible sampling
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    background: bool = False
    conversation: str | dict[str, Any] | None = None  # refused: conversations are not kept yet


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class RenderRequest(Struct, kw_only=True):
    """A chat (messages) or completion (prompt) body; everything else in it is ignored."""

    model: str | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect: text parts joined, and tool calls'
    arguments as objects (clients send them as JSON text; templates write them with tojson)."""
    out = []
    for m in messages:
        d = {k: v for k, v in msgspec.structs.asdict(m).items() if v is not None}
        if isinstance(m.content, list):
            d["content"] = "".join(p.text or "" for p in m.content if p.type == "text")
        elif m.content is None:
            d["content"] = ""
        if m.tool_calls:
            d["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
        out.append(d)
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class AdapterLoadRequest(Struct, kw_only=True):
    """POST /v1/adapters: `path` is a server-side Kiln artifact or PEFT directory; without it
    the adapter is loaded from the store. `replace` swaps a loaded adapter's weights."""

    name: str
    path: str | None = None
    replace: bool = False


class LoadLoraAdapterRequest(Struct, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoraAdapterRequest(Struct, kw_only=True):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None
