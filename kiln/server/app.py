"""The Litestar application: routes, the OpenAI error body for every failure, API keys."""

from __future__ import annotations

import logging

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig

from kiln import __version__
from kiln.errors import InvalidRequest, KilnError, Unauthorized
from kiln.server import admin_routes, eval_routes, grader_routes, openai_routes, training_routes
from kiln.server.state import ServerState, server_state

log = logging.getLogger("kiln.server")


def _error(status: int, message: str, type_: str, param: str | None = None) -> Response:
    return Response({"error": {"message": message, "type": type_, "code": None, "param": param}}, status_code=status)


def _kiln_error(_: Request, exc: KilnError) -> Response:
    return Response(exc.body(), status_code=exc.status)


def _validation_error(_: Request, exc: ValidationException) -> Response:
    detail = exc.extra if isinstance(exc.extra, list) else []
    message = "; ".join(str(e.get("message", e)) for e in detail if isinstance(e, dict)) or exc.detail
    param = next((e.get("key") for e in detail if isinstance(e, dict) and e.get("key")), None)
    return _kiln_error(_, InvalidRequest(f"invalid request body: {message}", param=param))


def _http_error(_: Request, exc: HTTPException) -> Response:
    type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _error(exc.status_code, str(exc.detail), type_)


def _unexpected_error(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return _error(500, f"internal error: {type(exc).__name__}", "internal_error")


async def _authorize(request: Request) -> None:
    keys = server_state(request).settings.server.api_keys
    if not keys or request.url.path in admin_routes.OPEN_ROUTES:
        return
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer ") or header[7:].strip() not in keys:
        raise Unauthorized("missing or invalid API key")


def create_app(state: ServerState) -> Litestar:
    app = Litestar(
        route_handlers=[*openai_routes.ROUTES, *admin_routes.ROUTES, *training_routes.ROUTES, *grader_routes.ROUTES,
                        *eval_routes.ROUTES],
        exception_handlers={KilnError: _kiln_error, ValidationException: _validation_error,
                            HTTPException: _http_error, Exception: _unexpected_error},
        before_request=_authorize,
        request_max_body_size=state.settings.server.max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="Kiln", version=__version__, path="/schema"),
        logging_config=None,  # logging is configured once, from [server] log_level
        debug=False,
    )
    app.state.kiln = state
    return app
