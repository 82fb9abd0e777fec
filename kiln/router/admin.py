"""The router's admin HTTP server on `admin_listen`: `/metrics`, `/readyz`, the dashboard (`/`, also
`/dashboard`), the JSON it polls (`/api/state`) and fleet-wide adapter rollouts
(`/admin/adapters/rollout`, rollout.py). Served by uvicorn on the router's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from litestar import Litestar, MediaType, Request, Response, get, post
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.router.core import RouterCore
from kiln.router.dashboard import PAGE
from kiln.router.metrics import RouterMetrics
from kiln.router.rollout import RolloutRefused


def create_admin_app(core: RouterCore, metrics: RouterMetrics) -> Litestar:
    @get("/metrics", media_type=CONTENT_TYPE_LATEST)
    async def prometheus() -> Response[bytes]:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @get("/readyz")
    async def readyz() -> Response[dict[str, Any]]:
        ready, reasons = core.ready()
        return Response({"ready": ready, "reasons": reasons}, status_code=200 if ready else 503)

    @get("/api/state")
    async def state() -> dict[str, Any]:
        return core.state()

    @get(["/", "/dashboard"], media_type=MediaType.HTML)
    async def dashboard() -> str:
        return PAGE

    @post("/admin/adapters/rollout")
    async def start_rollout(request: Request) -> Response[dict[str, Any]]:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body is the caller's
            body = None
        try:
            status, rollout = await core.rollouts.create(body)
        except RolloutRefused as e:
            return Response(e.body(), status_code=e.status)
        return Response(rollout, status_code=status)

    @get("/admin/adapters/rollout")
    async def list_rollouts() -> dict[str, Any]:
        return {"object": "list", "data": core.rollouts.describe()}

    @get("/admin/adapters/rollout/{rollout_id:str}")
    async def one_rollout(rollout_id: str) -> Response[dict[str, Any]]:
        found = core.rollouts.items.get(rollout_id)
        if found is None:
            error = {
                "message": f"no rollout {rollout_id!r}",
                "type": "invalid_request_error",
                "param": None,
                "code": "rollout_not_found",
            }
            return Response({"error": error}, status_code=404)
        return Response(found.to_json())

    handlers = [prometheus, readyz, state, dashboard, start_rollout, list_rollouts, one_rollout]
    return Litestar(handlers, openapi_config=None, logging_config=None)


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "0.0.0.0", int(port)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the router handles SIGTERM and SIGINT itself


class AdminServer:
    """`await start()` binds (raising OSError when it cannot) and serves; `await stop()`."""

    def __init__(self, core: RouterCore, metrics: RouterMetrics, address: str) -> None:
        self.address = address
        config = uvicorn.Config(create_admin_app(core, metrics), log_level="warning", access_log=False, lifespan="off")
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        host, port = split_host_port(self.address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, reuse_port=False)
        sock.setblocking(False)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the admin HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        bound = sock.getsockname()
        return f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
