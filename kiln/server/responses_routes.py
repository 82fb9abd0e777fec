"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as semantic events) and the stored
responses behind `previous_response_id`: retrieve, delete, input items.

A response is one chat request through the chat path (prepare_chat, the engine, OutputReader);
responses_api.py translates the shapes. A response is stored (`store`, default true) when it
ends; a stream cut off by its client is not.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from kiln.agent.tools import AgentTools
from kiln.engine.client import RequestStream
from kiln.engine.request import Delta
from kiln.errors import InvalidRequest, KilnError, NotFound
from kiln.server import responses_api as ra
from kiln.server.generation import submit_all
from kiln.server.openai_api import now
from kiln.server.openai_routes import prepare_chat
from kiln.server.pagination import page, page_limit
from kiln.server.schemas import ResponsesRequest
from kiln.server.state import ServerState, server_state

_encoder = msgspec.json.Encoder()
MAX_TURNS = 16  # an agent run's turns (model generations) unless it sets max_turns; then it is incomplete

# what the chat path calls a field -> what a Responses request calls it
_PARAMS = (("messages", "input"), ("prompt", "input"), ("response_format.json_schema.schema", "text.format.schema"),
           ("response_format", "text.format"))


def _renamed(exc: KilnError) -> KilnError:
    param = exc.param or ""
    for chat, responses in _PARAMS:
        if param == chat or param.startswith(chat + "."):
            return exc.with_param(responses + param[len(chat):])
    if param.startswith("tools[") and ".function." in param:
        return exc.with_param(param.replace(".function.", "."))
    return exc


@post("/v1/responses", status_code=200)
async def create_response(request: Request, data: ResponsesRequest) -> Response | Stream:
    st = server_state(request)
    st.admit_inference()
    adapter = await st.select_model_async(data.model)
    ra.check_request(data)
    tools = AgentTools(data.tools)
    new_items = ra.input_items(data.input)
    context: list[dict[str, Any]] = []
    if data.previous_response_id is not None:
        context = st.responses.conversation(data.previous_response_id)
        if context is None:
            raise InvalidRequest(f"Previous response with id '{data.previous_response_id}' not found.",
                                 code="previous_response_not_found", param="previous_response_id")
    if not new_items and data.previous_response_id is None:
        raise InvalidRequest("input must not be empty", param="input")
    await tools.open()
    run = ResponseRun(st, data, adapter, tools, new_items, context)
    try:
        await run.begin()  # the first turn is submitted before the response starts: its errors are a status
    except BaseException:
        await tools.close()
        raise
    if data.stream:
        return Stream(run.events(), media_type="text/event-stream")
    return Response(await run.whole())


class ResponseRun:
    """One response: turns of the chat path, each one engine request over the conversation so far.
    A turn whose calls are all to tools Kiln runs is followed by their outputs and another turn,
    until the model answers without such a call, calls a tool its client runs, or a limit is met."""

    def __init__(self, st: ServerState, req: ResponsesRequest, adapter, tools: AgentTools,
                 new_items: list[dict], context: list[dict]):
        self.st, self.req, self.adapter, self.tools = st, req, adapter, tools
        self.new_items, self.context = new_items, context
        self.conversation = context + new_items
        self.rid = ra.new_item_id("resp")
        self.model = adapter.name if adapter else st.model_id
        self.created_at = now()
        self.items: list[dict[str, Any]] = []  # output items of every turn
        self.finals: list[Delta] = []  # each turn's last delta
        self.incomplete: str | None = None
        self.tool_calls = 0
        self._turn: tuple[RequestStream, ra.OutputItems] | None = None
        self._context_bound = False  # the turn in flight may generate until the context is full

    async def begin(self) -> None:
        self.items += [server.list_item(ra.new_item_id("mcpl")) for server in self.tools.servers]
        self._turn = await self._submit()

    async def _submit(self) -> tuple[RequestStream, ra.OutputItems] | None:
        """The next turn, submitted; None if the conversation has outgrown the context."""
        used = sum(d.usage["completion_tokens"] for d in self.finals)
        budget = None if self.req.max_output_tokens is None else self.req.max_output_tokens - used
        turn = len(self.finals)
        try:
            prompt, params, reader = await prepare_chat(
                self.st, ra.chat_request(self.req, self.conversation, self.tools.model_tools(), budget))
            room = self.st.engine.max_model_len - len(prompt)  # max_output_tokens bounds, the context decides
            if turn and room < 1:
                return None
            # a turn that ends at its length limit ran out of context unless max_output_tokens set that limit
            self._context_bound = budget is None or room < budget
            if params.max_tokens is not None and room >= 1:
                params.max_tokens = min(params.max_tokens, room)
            [stream] = submit_all(self.st, f"{self.rid}-{turn}" if turn else self.rid, [prompt], params,
                                  self.adapter and self.adapter.weights, None)
        except KilnError as exc:
            raise _renamed(exc) from None
        output = ra.OutputItems(reader, self.st.tokenizer, params.logprobs is not None, len(self.items),
                                self.tools.server_label)
        return stream, output

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        """Every turn's output events, and the tool outputs between turns (without sequence numbers)."""
        for index, listing in enumerate(self.items):  # the MCP servers' tools, listed before the first turn
            yield {"type": "response.output_item.added", "output_index": index, "item": listing}
            yield {"type": "response.output_item.done", "output_index": index, "item": listing}
        while self._turn is not None:
            stream, output = self._turn
            self._turn = None
            try:
                async for d in stream:
                    if d.error is not None:
                        raise d.error
                    if d.finished:
                        self.finals.append(d)
                    status = "incomplete" if d.finish_reason == "length" else "completed"
                    for e in output.feed(d.text, d.logprobs, d.finished, status):
                        yield e
            finally:
                stream.close()
            self.items += output.items
            self.conversation += output.items
            if self.finals[-1].finish_reason == "length":
                self.incomplete = "context_length" if self._context_bound and self.tools.runs_any \
                    else "max_output_tokens"
                return
            calls = output.calls()
            if not calls or not all(self.tools.runs(c["name"]) for c in calls):
                return  # an answer, or calls the client runs
            for i, call in enumerate(calls):
                if self.req.max_tool_calls is not None and self.tool_calls >= self.req.max_tool_calls:
                    self.incomplete = "max_tool_calls"
                    for skipped in calls[i:]:  # never run: their items end here
                        if skipped["type"] == "mcp_call":
                            skipped["status"] = "incomplete"
                            yield {"type": "response.output_item.done", "output_index": self.items.index(skipped),
                                   "item": skipped}
                    return
                self.tool_calls += 1
                async for e in self._run_tool(call):
                    yield e
            if len(self.finals) >= (self.req.max_turns or MAX_TURNS):
                self.incomplete = "max_turns"
                return
            self._turn = await self._submit()
            if self._turn is None:
                self.incomplete = "context_length"

    async def _run_tool(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        where = {"item_id": call["id"], "output_index": self.items.index(call)}
        if call["type"] == "mcp_call":
            yield {"type": "response.mcp_call.in_progress", **where}
        result = await self.tools.call(call["name"], call["arguments"])
        if call["type"] == "mcp_call":
            call["output"], call["status"] = (None, "failed") if result.error else (result.output, "completed")
            if result.error:
                call["error"] = {"type": "mcp_tool_execution_error",
                                 "content": [{"type": "text", "text": result.error}]}
            yield {"type": f"response.mcp_call.{call['status']}", **where}
            yield {"type": "response.output_item.done", "output_index": where["output_index"], "item": call}
            return
        item = {"type": "function_call_output", "id": ra.new_item_id("fco"), "call_id": call["call_id"],
                "output": result.output, "status": "completed"}
        self.items.append(item)
        self.conversation.append(item)
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item}
        yield {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}

    def _body(self, status: str | None = None, error: dict | None = None) -> dict[str, Any]:
        if status is None:
            status = "incomplete" if self.incomplete else "completed"
        usage = None
        if self.finals:
            reasoning = "".join(p["text"] for it in self.items if it["type"] == "reasoning" for p in it["content"])
            usage = ra.usage([d.usage for d in self.finals],
                             len(self.st.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0)
        body = ra.response_object(self.rid, self.req, self.model, self.created_at, status,
                                  self.items if status != "in_progress" else [], usage, error, self.incomplete)
        if self.finals:
            body["kiln"] = {"latency": [d.metrics for d in self.finals], "lineage": self.st.lineage(self.adapter)}
        return body

    def _store(self, body: dict[str, Any]) -> None:
        if self.req.store:
            self.st.responses.put(body, self.new_items, self.context + self.new_items)

    async def whole(self) -> dict[str, Any]:
        try:
            async for _ in self._events():
                pass
        finally:
            await self._close()
        body = self._body()
        self._store(body)
        return body

    async def events(self) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(payload: dict[str, Any]) -> bytes:
            payload = {"type": payload["type"], "sequence_number": next(numbers), **payload}
            return b"event: " + payload["type"].encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

        start = self._body(status="in_progress")
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        try:
            async for e in self._events():
                yield event(e)
            body = self._body()
            self._store(body)
            yield event({"type": f"response.{body['status']}", "response": body})
        except KilnError as exc:
            error = {"code": exc.code or exc.type, "message": exc.message}
            yield event({"type": "response.failed", "response": self._body(status="failed", error=error)})
        finally:  # also when the client went away: the turn in flight is aborted and no tool runs again
            await self._close()

    async def _close(self) -> None:
        if self._turn is not None:
            self._turn[0].close()
            self._turn = None
        await self.tools.close()


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", code="response_not_found", param="response_id")


@get("/v1/responses/{response_id:str}", sync_to_thread=False)
def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
    body = server_state(request).responses.get(response_id)
    if body is None:
        raise _not_found(response_id)
    return body


@delete("/v1/responses/{response_id:str}", status_code=200, sync_to_thread=False)
def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    if not server_state(request).responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@get("/v1/responses/{response_id:str}/input_items", sync_to_thread=False)
def list_input_items(request: Request, response_id: str, after: str | None = None, limit: int | None = None,
                     order: str = "desc") -> dict[str, Any]:
    st = server_state(request)
    items = st.responses.input_items(response_id)
    if items is None:
        raise _not_found(response_id)
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    if order == "desc":
        items = items[::-1]
    ids = [it["id"] for it in items]
    start = ids.index(after) + 1 if after in ids else 0 if after is None else len(ids)
    size = page_limit(limit)
    return page(items[start:start + size], start + size < len(items))


ROUTES = [create_response, retrieve_response, delete_response, list_input_items]
