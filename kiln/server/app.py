"""The Litestar application: routes, the OpenAI error body for every failure, API keys."""

from __future__ import annotations

import logging

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig

from kiln import __version__
from kiln.config import Settings
from kiln.errors import InvalidRequest, KilnError, NotFound, PayloadTooLarge, Unauthorized
from kiln.server import (
    admin_routes,
    console,
    eval_routes,
    grader_routes,
    openai_routes,
    responses_routes,
    training_routes,
)
from kiln.server.state import ServerState, server_settings

log = logging.getLogger("kiln.server")


def _error(status: int, message: str, type_: str, code: str | None = None) -> Response:
    return Response({"error": {"message": message, "type": type_, "code": code, "param": None}}, status_code=status)


def _kiln_error(_: Request, exc: KilnError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers=exc.headers)


def _validation_error(_: Request, exc: ValidationException) -> Response:
    detail = exc.extra if isinstance(exc.extra, list) else []
    message = "; ".join(str(e.get("message", e)) for e in detail if isinstance(e, dict)) or exc.detail
    param = next((e.get("key") for e in detail if isinstance(e, dict) and e.get("key")), None)
    return _kiln_error(_, InvalidRequest(f"invalid request body: {message}", param=param))


def _http_error(request: Request, exc: HTTPException) -> Response:
    """Litestar's own refusals, in Kiln's taxonomy: no such route, a method the route lacks, a body over the limit."""
    status = exc.status_code
    if status == 404:
        return _kiln_error(request, NotFound(f"no route {request.method} {request.url.path}", code="route_not_found"))
    if status == 405:
        return _error(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error",
                      "method_not_allowed")
    if status == 413:
        limit = server_settings(request).server.max_request_body_bytes
        return _kiln_error(request, PayloadTooLarge(f"the request body is over {limit} bytes (max_request_body_bytes)"))
    return _error(status, str(exc.detail), "invalid_request_error" if status < 500 else "internal_error")


def _unexpected_error(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return _error(500, f"internal error: {type(exc).__name__}", "internal_error")


async def _authorize(request: Request) -> None:
    keys = server_settings(request).server.api_keys
    if not keys:
        return
    path = request.url.path
    if path in admin_routes.OPEN_ROUTES or path == console.PATH:  # the page asks for its key itself
        return
    if console.is_console_path(path):
        if not console.authorized(request, keys):
            raise Unauthorized("missing or invalid API key: open /console?key=<key> or send it as a bearer key")
        return
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer ") or header[7:].strip() not in keys:
        raise Unauthorized("missing or invalid API key")


def create_app(state: ServerState | None, *, settings: Settings | None = None, progress=None) -> Litestar:
    """The app over a ready server's `state`, or (None) over one still starting: its state is set on
    `app.state.kiln` when ready, and `progress` (lifecycle.StartProgress) says how far it got."""
    settings = settings or state.settings
    app = Litestar(
        route_handlers=[*openai_routes.ROUTES, *responses_routes.ROUTES, *admin_routes.ROUTES, *training_routes.ROUTES,
                        *grader_routes.ROUTES, *eval_routes.ROUTES, *console.ROUTES],
        exception_handlers={KilnError: _kiln_error, ValidationException: _validation_error,
                            HTTPException: _http_error, Exception: _unexpected_error},
        before_request=_authorize,
        request_max_body_size=settings.server.max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="Kiln", version=__version__, path="/schema"),
        logging_config=None,  # logging is configured once, from [server] log_level
        debug=False,
    )
    app.state.kiln = state
    app.state.settings = settings
    app.state.progress = progress
    return app
