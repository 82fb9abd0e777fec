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

from kiln.agent.loop import AgentRun
from kiln.agent.tools import AgentTools
from kiln.errors import InvalidRequest, KilnError, NotFound
from kiln.server import responses_api as ra
from kiln.server.generation import unless_disconnected
from kiln.server.openai_api import now
from kiln.server.pagination import page, page_limit
from kiln.server.schemas import ResponsesRequest
from kiln.server.state import ServerState, server_state

_encoder = msgspec.json.Encoder()

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
    adapter = await st.admit(data.model)
    ra.check_request(data)
    tools = AgentTools(data.tools, allowed_commands=st.settings.server.mcp_commands)
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
    run = ResponseRun(st, data, adapter, AgentRun(st.chat_path, st.engine, data, tools, context + new_items,
                                                  ra.new_item_id("resp"), adapter and adapter.weights,
                                                  metrics=st.agent_metrics),
                      new_items, context)
    try:
        await run.agent.begin()  # the first turn is submitted before the response starts: its errors are a status
    except KilnError as exc:
        await run.agent.close()
        raise _renamed(exc) from None
    except BaseException:
        await run.agent.close()
        raise
    if data.stream:
        return Stream(run.events(), media_type="text/event-stream")
    return await unless_disconnected(request, run.whole())


class ResponseRun:
    """One response: its agent run (one turn, unless Kiln runs tools), as a response object or a
    stream of events, stored when it ends."""

    def __init__(self, st: ServerState, req: ResponsesRequest, adapter, agent: AgentRun, new_items: list[dict],
                 context: list[dict]):
        self.st, self.req, self.adapter, self.agent = st, req, adapter, agent
        self.new_items, self.context = new_items, context
        self.model = adapter.name if adapter else st.model_id
        self.created_at = now()

    def _body(self, status: str | None = None, error: dict | None = None) -> dict[str, Any]:
        agent = self.agent
        if status is None:
            status = "incomplete" if agent.incomplete else "completed"
        body = ra.response_object(agent.rid, self.req, self.model, self.created_at, status,
                                  agent.items if status != "in_progress" else [], agent.usage(), error,
                                  agent.incomplete)
        if agent.turns:
            body["kiln"] = {"latency": [t.metrics for t in agent.turns], "lineage": self.st.lineage(self.adapter)}
        return body

    def _store(self, body: dict[str, Any]) -> None:
        if self.req.store:
            self.st.responses.put(body, self.new_items, self.context + self.new_items)

    def _ended(self, status: str) -> None:
        """Counts an agent run (a response whose tools Kiln ran) by how it ended."""
        if self.agent.tools.runs_any and self.st.agent_metrics is not None:
            self.st.agent_metrics.run_ended(status, len(self.agent.turns))

    async def whole(self) -> Response:
        status = "cancelled"  # unless it ends otherwise: the client left, and the run was cancelled
        try:
            await self.agent.run()
            body = self._body()
            status = body["status"]
        except KilnError:
            status = "failed"
            raise
        finally:
            await self.agent.close()
            self._ended(status)
        self._store(body)
        return Response(body)

    async def events(self) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(payload: dict[str, Any]) -> bytes:
            payload = {"type": payload["type"], "sequence_number": next(numbers), **payload}
            return b"event: " + payload["type"].encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

        start = self._body(status="in_progress")
        status = "cancelled"  # unless it ends otherwise: the client went away
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        try:
            async for e in self.agent.events():
                yield event(e)
            body = self._body()
            status = body["status"]
            self._store(body)
            yield event({"type": f"response.{body['status']}", "response": body})
        except KilnError as exc:
            status = "failed"
            error = {"code": exc.code or exc.type, "message": exc.message}
            yield event({"type": "response.failed", "response": self._body(status="failed", error=error)})
        finally:  # also when the client went away: the turn in flight is aborted and no tool runs again
            await self.agent.close()
            self._ended(status)


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
