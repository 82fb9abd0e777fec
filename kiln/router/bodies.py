"""Request bodies streamed to `PushBody`: assembled within per-request and server-wide byte caps.

Each stream's bytes count against the stream (`body_max_request_kb`) and against every stream
being received at once (`body_max_total_kb`), from the chunk that brings them until the body is
parsed or the stream fails. A stream that pauses longer than `body_idle_timeout_secs` between
chunks is refused; `body_ttl_secs` bounds the whole reception (the caller applies it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

RejectReason = Literal["too_large", "budget", "idle", "ttl", "invalid"]


class BodyRejected(Exception):
    """The body is refused; `reason` picks the gRPC status (see grpc_api)."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Chunk(Protocol):  # router_pb2.BodyChunk
    request_id: str
    data: bytes
    last: bool
    tenant: str
    inference_pool: str


class BodyBudget:
    """Bytes of bodies being received, over all streams; `hold()` opens one stream's account."""

    def __init__(self, max_total_bytes: int, max_request_bytes: int) -> None:
        self.max_total = max_total_bytes
        self.max_request = max_request_bytes
        self.bytes = 0
        self.count = 0

    def hold(self) -> HeldBody:
        return HeldBody(self)


class HeldBody:
    """One stream's bytes; a context manager that gives them back to the budget on exit."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.parts: list[bytes] = []
        self.size = 0
        self.open = False

    def __enter__(self) -> HeldBody:
        self.open = True
        self.budget.count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def add(self, data: bytes) -> None:
        b = self.budget
        if self.size + len(data) > b.max_request:
            raise BodyRejected(
                "too_large", f"request body over body_max_request_kb ({b.max_request // 1024} KB): refused"
            )
        if b.bytes + len(data) > b.max_total:
            raise BodyRejected(
                "budget",
                f"the router is holding {b.bytes} bytes of bodies; this chunk would exceed "
                f"body_max_total_kb ({b.max_total // 1024} KB): retry later",
            )
        b.bytes += len(data)
        self.size += len(data)
        self.parts.append(data)

    def data(self) -> bytes:
        return b"".join(self.parts)

    def release(self) -> None:
        if self.open:
            self.open = False
            self.budget.bytes -= self.size
            self.budget.count -= 1
            self.parts.clear()


@dataclass(frozen=True, slots=True)
class Received:
    """A whole body and the first non-empty value of each of its chunks' metadata fields."""

    data: bytes
    request_id: str
    tenant: str
    inference_pool: str


async def receive(chunks: AsyncIterator[Chunk], held: HeldBody, idle_s: float) -> Received:
    """Read chunks into `held` until one is `last` or the stream ends; raises BodyRejected."""
    meta = {"request_id": "", "tenant": "", "inference_pool": ""}
    iterator = aiter(chunks)
    received = 0
    while True:
        try:
            chunk = await asyncio.wait_for(anext(iterator), idle_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyRejected(
                "idle", f"no chunk for {idle_s:g} s (body_idle_timeout_secs) after {received} chunk(s)"
            ) from None
        received += 1
        for key, value in meta.items():
            if not value:
                meta[key] = getattr(chunk, key)
        if chunk.data:
            held.add(chunk.data)
        if chunk.last:
            break
    if not received:
        raise BodyRejected("invalid", "empty stream: send the request body in one or more chunks")
    return Received(held.data(), **meta)


def parse(data: bytes) -> dict[str, Any]:
    """The JSON object of an OpenAI chat or completion body, with a non-empty string `model`."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise BodyRejected("invalid", f"the body is not valid JSON: {e}"[:300]) from None
    if not isinstance(body, dict):
        raise BodyRejected("invalid", "the body must be a JSON object (an OpenAI chat or completion request)")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BodyRejected("invalid", "the body has no model (a non-empty string)")
    return body
