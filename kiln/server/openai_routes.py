"""The OpenAI-compatible routes: chat and text completions, models, and the tokenizer routes."""

from __future__ import annotations

import datetime
from typing import Any

from litestar import Request, Response, get, post
from litestar.response import Stream

from kiln.errors import InvalidRequest
from kiln.server import openai_api as oa
from kiln.server import structured
from kiln.server.generation import respond, submit_all
from kiln.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RenderRequest,
    TokenizeRequest,
)
from kiln.server.state import ServerState, server_state


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, data: ChatCompletionRequest) -> Response | Stream:
    st = server_state(request)
    adapter = await st.admit(data.model)
    prompt, params, reader = await st.chat_path.prepare(data)
    fmt = oa.ChatFormat(st.tokenizer, params.logprobs is not None, reader)
    return await _generate(request, st, fmt, data, [prompt], params, adapter)


@post("/v1/completions", status_code=200)
async def completions(request: Request, data: CompletionRequest) -> Response | Stream:
    st = server_state(request)
    adapter = await st.admit(data.model)
    oa.completion_checks(data)
    prompts = oa.completion_prompts(st.tokenizer, data.prompt)
    params = oa.sampling_params(data, data.max_tokens, data.logprobs)
    if data.echo and data.logprobs is not None and params.prompt_logprobs is None:
        params.prompt_logprobs = data.logprobs  # echo + logprobs returns the prompt's logprobs too
    if (constraint := structured.output_constraint(data)) is not None:
        params.grammar = await st.grammars.compile_async(constraint)
    fmt = oa.CompletionFormat(st.tokenizer, data.logprobs is not None, prompts if data.echo else None, params.n)
    return await _generate(request, st, fmt, data, prompts, params, adapter)


async def _generate(request: Request, st: ServerState, fmt, data, prompts, params, adapter) -> Response | Stream:
    rid = oa.new_id(fmt.id_prefix)
    try:
        streams = submit_all(st, rid, prompts, params, adapter and adapter.weights, data.cache_salt)
    except InvalidRequest as exc:  # the engine names the prompt "prompt"; a chat request calls it "messages"
        raise exc.with_param(fmt.prompt_param) if exc.param == "prompt" else exc from None
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    return await respond(request, fmt, rid, adapter.name if adapter else st.model_id, streams, params.n, data.stream,
                         include_usage, st.lineage(adapter))


@get("/v1/models", sync_to_thread=True)
def models(request: Request) -> dict[str, Any]:
    st = server_state(request)
    card = {"id": st.model_id, "object": "model", "created": 0, "owned_by": "kiln", "root": st.model_id,
            "parent": None, "max_model_len": st.engine.max_model_len}
    adapters = [{"id": a.name, "object": "model", "created": int(a.loaded_at), "owned_by": "kiln", "root": a.source,
                 "parent": st.model_id, "max_model_len": st.engine.max_model_len, "loaded": True}
                for a in st.adapters.loaded()]
    # what the store holds for this base model also serves by name: its first request loads it
    stored = [{"id": a.name, "object": "model", "created": _epoch(a.manifest.provenance.created_at), "owned_by": "kiln",
               "root": str(a.path), "parent": st.model_id, "max_model_len": st.engine.max_model_len, "loaded": False}
              for a in st.adapters.loadable()]
    return {"object": "list", "data": [{**card, "loaded": True}, *adapters, *stored]}


def _epoch(iso: str) -> int:
    try:
        return int(datetime.datetime.fromisoformat(iso).timestamp())
    except ValueError:
        return 0


def _prompt_ids(st: ServerState, body) -> list[int]:
    if body.messages is not None:
        return oa.render_chat(st.tokenizer, body, body.messages)
    if isinstance(body.prompt, list):
        return list(body.prompt)
    if body.prompt is not None:
        return st.tokenizer.encode(body.prompt, add_special_tokens=getattr(body, "add_special_tokens", True))
    raise InvalidRequest("either messages or prompt is required", param="prompt")


@post("/tokenize", status_code=200, sync_to_thread=False)
def tokenize(request: Request, data: TokenizeRequest) -> dict[str, Any]:
    st = server_state(request)
    st.check_model(data.model)
    ids = _prompt_ids(st, data)
    return {"tokens": ids, "count": len(ids), "max_model_len": st.engine.max_model_len}


@post("/detokenize", status_code=200, sync_to_thread=False)
def detokenize(request: Request, data: DetokenizeRequest) -> dict[str, Any]:
    st = server_state(request)
    st.check_model(data.model)
    if any(not 0 <= t < st.tokenizer.vocab_size for t in data.tokens):
        raise InvalidRequest("token ids must be within the vocabulary", param="tokens")
    return {"prompt": st.tokenizer.decode(data.tokens)}


@post("/render", status_code=200, sync_to_thread=False)
def render(request: Request, data: RenderRequest) -> dict[str, Any]:
    """The exact prompt token ids Kiln would compute for a chat or completion body."""
    st = server_state(request)
    st.check_model(data.model)
    ids = _prompt_ids(st, data)
    return {"model": st.model_id, "prompt_token_ids": ids, "count": len(ids)}


ROUTES = [chat_completions, completions, models, tokenize, detokenize, render]
