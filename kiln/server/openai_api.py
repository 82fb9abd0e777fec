"""OpenAI semantics over the engine: request -> prompts + SamplingParams, deltas -> responses."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kiln.engine.output import Delta, TokenLogprob
from kiln.engine.sampling import SamplingError, SamplingParams
from kiln.errors import InvalidRequest, RequestFailed
from kiln.models.tokenizer import KilnTokenizer, TemplateError
from kiln.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    message_dicts,
)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    except ValueError as exc:
        raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from exc
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=bias or None,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        n=req.n,
    )


def render_chat(tok: KilnTokenizer, req, messages) -> list[int]:
    try:
        text = tok.apply_chat_template(message_dicts(messages), add_generation_prompt=req.add_generation_prompt,
                                       tools=req.tools, **(req.chat_template_kwargs or {}))
    except TemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    # the template already placed BOS and special tokens
    return tok.encode(text, add_special_tokens=False)


def completion_prompts(tok: KilnTokenizer, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    def ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if ids(prompt):
        return [list(prompt)]
    if all(isinstance(p, str) and p for p in prompt):
        return [tok.encode(p) for p in prompt]
    if all(ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequest("prompt must be a string, a list of strings, or token ids", param="prompt")


def check_sampling(engine, prompt_ids: list[int], params: SamplingParams) -> None:
    try:
        engine.validate(prompt_ids, params)
    except SamplingError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from exc


def _token_text(tok: KilnTokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok: KilnTokenizer, items: list[TokenLogprob]) -> dict:
    def entry(tid, lp):
        text = _token_text(tok, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in items]}


def completion_logprobs(tok: KilnTokenizer, items: list[TokenLogprob], offset0: int = 0) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = offset0
    for t in items:
        text = _token_text(tok, t.token_id)
        tokens.append(text)
        token_lps.append(t.logprob)
        tops.append({_token_text(tok, i): lp for i, lp in t.top} if t.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def usage(finals: list[Delta], prompt_lens: list[int]) -> dict:
    """Prompt tokens count once per prompt (not per choice), as OpenAI and vLLM report them."""
    prompt = sum(prompt_lens)
    completion = sum(d.usage["completion_tokens"] for d in finals if d.usage)
    cached = sum(d.usage["cached_tokens"] for d in finals if d.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def raise_if_failed(delta: Delta) -> None:
    if delta.finish_reason == "error":
        from kiln.engine.runner import GraphCaptureDisabled
        from kiln.errors import AdmissionRejected

        if isinstance(delta.error, GraphCaptureDisabled):
            raise AdmissionRejected(str(delta.error), "graph_capture_disabled")
        raise RequestFailed(str(delta.error or "request failed"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleaves several engine streams (one per prompt), tagging each delta with its prompt."""
    import asyncio

    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for d in s:
                await queue.put((i, d))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, d = await queue.get()
            if d is done:
                remaining -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


def now() -> int:
    return int(time.time())


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def chat_logprob_count(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        if req.top_logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
        return None
    return req.top_logprobs or 0


def completion_checks(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of is not supported (it must equal n)", param="best_of")
    if req.echo and req.stream:
        raise InvalidRequest("echo is not supported with stream", param="echo")


def sse(payload: Any) -> bytes:
    import msgspec

    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
