"""The router's gRPC server (grpc.aio): the Router service, RateLimiter and TokenReview when
enabled, the standard health service and server reflection.

Every failure is a gRPC status with a message, never a crash:

    NOT_FOUND           no worker set serves the model
    UNAVAILABLE         no eligible worker (all dead or evicted); TokenReview: the API server did not answer
    INVALID_ARGUMENT    no model or prompt, a body that is not a JSON object, a prompt that cannot be tokenized
    RESOURCE_EXHAUSTED  a streamed body over body_max_request_kb, or over body_max_total_kb with the others
    DEADLINE_EXCEEDED   a streamed body paused longer than body_idle_timeout_secs, or took over body_ttl_secs
    INTERNAL            a bug (logged with its traceback)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kiln.router import bodies
from kiln.router.core import RouterCore
from kiln.router.proto import router_pb2, router_pb2_grpc
from kiln.router.types import PickError, PickInput, PickResult

if TYPE_CHECKING:
    from kiln.router.token_review import TokenReviewer  # (imports lightkube: only with [token_review])

log = logging.getLogger("kiln.router")

ROUTER = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
RATE_LIMITER = router_pb2.DESCRIPTOR.services_by_name["RateLimiter"].full_name
TOKEN_REVIEW = router_pb2.DESCRIPTOR.services_by_name["TokenReview"].full_name

PICK_CODES = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
}
BODY_CODES = {
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "budget": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "idle": grpc.StatusCode.DEADLINE_EXCEEDED,
    "ttl": grpc.StatusCode.DEADLINE_EXCEEDED,
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
}

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _guarded(method: Handler) -> Handler:
    """An unexpected exception becomes INTERNAL with a message (aborts pass through)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:  # the RPC boundary: a bug answers INTERNAL to this call, the server lives
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"router error: {type(e).__name__}: {e}"[:500])

    return wrapper  # type: ignore[return-value]


def _response(result: PickResult) -> router_pb2.PickResponse:
    return router_pb2.PickResponse(
        worker_id=result.worker_id,
        endpoint=result.endpoint,
        workerset=result.workerset,
        predicted_ms=result.predicted_ms,
        cached_blocks=result.cached_blocks,
        request_id=result.request_id,
        prompt_blocks=result.prompt_blocks,
        reason=result.reason,
    )


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, budget: bodies.BodyBudget) -> None:
        self.core = core
        self.budget = budget
        config = core.config
        self.idle_s = float(config.body_idle_timeout_secs)
        self.ttl_s = float(config.body_ttl_secs)

    async def _pick(self, context: grpc.aio.ServicerContext, sent: Any, **fields: Any) -> router_pb2.PickResponse:
        """Pick for `fields` and what every call sends (`sent`: its tenant, inference pool and request id)."""
        request = PickInput(
            tenant=sent.tenant, inference_pool=sent.inference_pool, request_id=sent.request_id, **fields
        )
        try:
            return _response(await self.core.pick(request))
        except PickError as e:
            await self._fail(context, PICK_CODES[e.kind], e.message, request.tenant)
            raise  # (abort raised already)

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, tenant: str) -> None:
        metrics = self.core.metrics
        metrics.pick_failures.labels(code=code.name, **metrics.tenant_labels(tenant)).inc()
        await context.abort(code, message)

    @_guarded
    async def Pick(self, request: router_pb2.PickRequest, context: grpc.aio.ServicerContext) -> Any:
        if request.token_ids:
            body = None
        elif request.messages:
            body = {"messages": [{"role": m.role, "content": m.content} for m in request.messages]}
        else:
            body = {"prompt": request.prompt} if request.prompt else None
        return await self._pick(context, request, model=request.model, token_ids=list(request.token_ids) or None,
                                body=body)

    @_guarded
    async def PushBody(self, request_iterator: AsyncIterator[router_pb2.BodyChunk], context: Any) -> Any:
        tenant = ""
        try:
            with self.budget.hold() as held:
                try:
                    async with asyncio.timeout(self.ttl_s):
                        received = await bodies.receive(request_iterator, held, self.idle_s)
                except TimeoutError:
                    raise bodies.BodyRejected(
                        "ttl", f"the body took longer than body_ttl_secs ({self.ttl_s:g} s) to arrive"
                    ) from None
                tenant = received.tenant
                body = bodies.parse(received.data)
        except bodies.BodyRejected as e:
            self.core.metrics.body_rejections.labels(e.reason).inc()
            await self._fail(context, BODY_CODES[e.reason], e.message, tenant)
            raise
        return await self._pick(context, received, model=body["model"], body=body)

    @_guarded
    async def Feedback(self, request: router_pb2.FeedbackRequest, context: grpc.aio.ServicerContext) -> Any:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        known = self.core.feedback(request.request_id, request.ttft_ms, request.e2e_ms, request.failed)
        return router_pb2.FeedbackResponse(known=known)


class RateLimiterService(router_pb2_grpc.RateLimiterServicer):
    """Admits every reservation: the budgets are not built yet (config loading warns when enabled)."""

    @_guarded
    async def Reserve(self, request: router_pb2.ReserveRequest, context: grpc.aio.ServicerContext) -> Any:
        return router_pb2.ReserveResponse(admitted=True)


class TokenReviewService(router_pb2_grpc.TokenReviewServicer):
    """Checks a bearer token with the Kubernetes API server (token_review.TokenReviewer, cached).

    A rejected token is an answer (authenticated = false, with the reason in `error`); an API server
    that cannot answer within the deadline is UNAVAILABLE.
    """

    def __init__(self, reviewer: TokenReviewer | None) -> None:
        self.reviewer = reviewer

    @_guarded
    async def Review(self, request: router_pb2.TokenReviewRequest, context: grpc.aio.ServicerContext) -> Any:
        if not request.token:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token is required")
        if self.reviewer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router has no Kubernetes client")
        from kiln.router.token_review import ReviewUnavailable

        remaining = context.time_remaining()  # the caller's deadline, None without one
        try:
            review = await self.reviewer.review(request.token, tuple(request.audiences), remaining)
        except ReviewUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return router_pb2.TokenReviewResponse(
            authenticated=review.authenticated,
            username=review.username,
            uid=review.uid,
            groups=review.groups,
            error=review.error,
        )


class GrpcServer:
    """The gRPC server of one router: `await start()` binds `listen`; `await stop()`."""

    def __init__(
        self, core: RouterCore, budget: bodies.BodyBudget, token_reviewer: TokenReviewer | None = None
    ) -> None:
        config = core.config
        # A single chunk or Pick may carry a whole body (or its token ids): allow the per-request cap.
        max_message = max(4 << 20, config.body_max_request_kb * 1024 + (64 << 10))
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", max_message), ("grpc.so_reuseport", 0)]
        )
        self.health = health.aio.HealthServicer()
        self.services = [ROUTER]
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(core, budget), self.server)
        if config.rate_limit.enabled:
            router_pb2_grpc.add_RateLimiterServicer_to_server(RateLimiterService(), self.server)
            self.services.append(RATE_LIMITER)
        if config.token_review.enabled:
            router_pb2_grpc.add_TokenReviewServicer_to_server(TokenReviewService(token_reviewer), self.server)
            self.services.append(TOKEN_REVIEW)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.listen = config.listen
        self.port: int | None = None

    async def start(self) -> str:
        """Bind and serve; returns the bound address. Raises RuntimeError when `listen` cannot be bound."""
        self.port = self.server.add_insecure_port(self.listen)  # raises RuntimeError on failure
        await self.server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        for name in self.services:
            await self.health.set(name, serving)
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
