"""One generation path for chat and completions: submit, then build the response or the SSE stream.

Every prompt is submitted (and validated) before the response starts, so a bad request is
an error status, never a broken stream. Choices are numbered prompt-major
(prompt i, sample j -> index i * n + j). Usage and latency come from the engine's final
deltas only.

A whole (non-streamed) response is built `unless_disconnected`: when its client hangs up first,
the work is cancelled, and its streams' closing aborts what the engine still runs for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from kiln.engine.client import RequestStream
from kiln.engine.params import SamplingParams
from kiln.engine.request import Delta
from kiln.errors import KilnError
from kiln.server import openai_api as oa
from kiln.server.state import Lineage, ServerState

_encoder = msgspec.json.Encoder()
T = TypeVar("T")
CLIENT_CLOSED = 499  # the status of a response whose client left first (never sent: it is gone)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | Response:
    """`work`'s result, or, if the client disconnects first, `work` cancelled (its finally blocks
    abort its engine requests and stop its tools) and a 499 nobody receives."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response({"error": {"message": "the client disconnected", "type": "client_closed_request",
                                   "code": None, "param": None}}, status_code=CLIENT_CLOSED)
    return task.result()


def sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def usage(finals: list[Delta]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its first choice), as OpenAI and vLLM report them."""
    prompt = sum(d.usage["prompt_tokens"] for d in finals if d.index == 0)
    completion = sum(d.usage["completion_tokens"] for d in finals)
    cached = sum(d.usage["cached_tokens"] for d in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kiln_object(finals: list[Delta], lineage: Lineage) -> dict[str, Any]:
    return {"latency": [d.metrics for d in finals], "lineage": lineage}


def submit_all(st: ServerState, rid: str, prompts: list[list[int]], params: SamplingParams, adapter,
               cache_salt: str | None) -> list[RequestStream]:
    """Submits one request per prompt; if one is refused, the others are withdrawn."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid_i = rid if len(prompts) == 1 else f"{rid}-{i}"
            streams.append(st.engine.submit(rid_i, prompt, params, adapter=adapter, cache_salt=cache_salt))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def _choices(streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream; closing it aborts whatever has not finished."""
    if len(streams) == 1:
        try:
            async for d in streams[0]:
                yield d.index, d
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        async for d in stream:
            await queue.put((i * n + d.index, d))
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def respond(request: Request, fmt: oa.ChatFormat | oa.CompletionFormat, rid: str, model_name: str,
                  streams: list[RequestStream], n: int, stream: bool, include_usage: bool,
                  lineage: Lineage) -> Response | Stream:
    total = n * len(streams)
    base = {"id": rid, "object": fmt.chunk_object if stream else fmt.object, "created": oa.now(), "model": model_name}
    choices = _choices(streams, n)
    if stream:
        return Stream(_sse_events(fmt, base, choices, total, include_usage, lineage), media_type="text/event-stream")
    return await unless_disconnected(request, _whole(fmt, base, choices, total, lineage))


async def _whole(fmt, base: dict, choices: AsyncIterator[tuple[int, Delta]], total: int,
                 lineage: Lineage) -> Response:
    accs = [oa.ChoiceAccumulator() for _ in range(total)]
    try:
        async for index, d in choices:
            if d.error is not None:
                raise d.error
            accs[index].add(d)
    finally:
        await choices.aclose()
    finals = [a.final for a in accs]
    return Response({**base, "choices": [fmt.choice(i, a) for i, a in enumerate(accs)], "usage": usage(finals),
                     "kiln": kiln_object(finals, lineage)})


async def _sse_events(fmt, base: dict, choices: AsyncIterator[tuple[int, Delta]], total: int, include_usage: bool,
                      lineage: Lineage) -> AsyncIterator[bytes]:
    finals: list[Delta] = []
    try:
        for i in range(total):
            if (opening := fmt.opening(i)) is not None:
                yield sse({**base, "choices": [opening]})
        async for index, d in choices:
            if d.error is not None:
                raise d.error
            chunk = {**base, "choices": []}
            if (choice := fmt.chunk(index, d)) is not None:
                chunk["choices"].append(choice)
            if d.finished:
                finals.append(d)
                if len(finals) == total and not include_usage:
                    chunk["kiln"] = kiln_object(finals, lineage)
            if chunk["choices"]:
                yield sse(chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(finals), "kiln": kiln_object(finals, lineage)})
    except KilnError as exc:
        yield sse(exc.body())
    finally:
        await choices.aclose()
    yield b"data: [DONE]\n\n"
