"""What the HTTP layer holds: settings, the engine, the adapter registry, and the request policy."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import jax
from litestar import Request

from kiln.adapters.registry import AdapterRegistry, LoadedAdapter
from kiln.config import Settings
from kiln.engine.client import AsyncEngine
from kiln.engine.grammar import GrammarCompiler
from kiln.engine.metrics import EngineMetrics
from kiln.errors import AdmissionRejected, DeviceLost, NotFound, QueueFull
from kiln.profiles import ResolvedProfile
from kiln.server.openai_api import ChatPath

Lineage = dict[str, Any]
RETRY_AFTER_S = 5  # what a 503 while starting or shutting down tells a client to wait


@dataclasses.dataclass
class ServerState:
    settings: Settings
    engine: AsyncEngine
    metrics: EngineMetrics
    adapters: AdapterRegistry
    jobs: Any = None  # kiln.train.jobs.JobManager
    evals: Any = None  # kiln.eval.service.EvalService
    responses: Any = None  # kiln.server.response_store.ResponseStore: the Responses API's stored responses
    agent_metrics: Any = None  # kiln.agent.metrics.AgentMetrics, on the engine's registry
    prewarm: str = "pending"  # pending | done | skipped
    step_set: dict | None = None  # what prewarm built: executables, built, loaded, seconds
    draining: bool = False  # SIGTERM came: inference is refused while running requests finish

    def __post_init__(self):
        self.grammars.timeout_s = self.settings.server.grammar_compile_timeout_s

    @property
    def model_id(self) -> str:
        return self.engine.model.model_id

    @property
    def profile(self) -> ResolvedProfile:
        return self.settings.serving_profile

    @property
    def tokenizer(self):
        return self.engine.model.tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        return self.engine.grammars

    @property
    def chat_path(self) -> ChatPath:
        server = self.settings.server
        return ChatPath(self.tokenizer, self.grammars, server.reasoning_parser, server.tool_call_parser)

    @property
    def backend_route(self) -> str:
        route = self.engine.route_info()["route"]
        return f"xla:{jax.default_backend()}" if route == "xla" else route

    def admit_inference(self) -> None:
        """Request policy before anything is submitted: device, profile, engine health, queue length."""
        if self.engine.device_lost is not None:
            raise DeviceLost(self.engine.device_lost.message)
        if self.draining:
            raise AdmissionRejected("the server is shutting down; send the request to another instance",
                                    code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        if not self.profile.policy.inference_admission:
            raise AdmissionRejected("inference is disabled by the maintenance serving profile",
                                    code="inference_disabled_by_profile")
        if not self.engine.alive():
            raise AdmissionRejected("the engine is not running", code="engine_unavailable")
        if self.engine.num_waiting() >= self.settings.server.max_waiting_requests:
            raise QueueFull("too many requests are waiting; retry later")

    async def admit(self, model: str | None) -> LoadedAdapter | None:
        """An inference request's admission, then the adapter its `model` selects (None: the base model)."""
        self.admit_inference()
        return await self.select_model_async(model)

    def select_model(self, model: str | None) -> LoadedAdapter | None:
        """The adapter a request's `model` selects (None: the base model), loaded from the store on its
        first request (blocking: from a worker thread, or `await select_model_async`)."""
        if model in (None, "", self.model_id):
            return None
        adapter = self.adapters.ensure_loaded(model)
        if adapter is None:
            raise NotFound(f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return adapter

    async def select_model_async(self, model: str | None) -> LoadedAdapter | None:
        """select_model for the event loop: a load from the store runs on a worker thread."""
        if model in (None, "", self.model_id):
            return None
        return self.adapters.get(model) or await asyncio.to_thread(self.select_model, model)

    def check_model(self, model: str | None) -> None:
        """Raises NotFound unless `model` is the base model or an adapter served by name (loaded or not)."""
        if model not in (None, "", self.model_id) and self.adapters.get(model) is None \
                and self.adapters.stored(model) is None:
            raise NotFound(f"The model `{model}` does not exist.", code="model_not_found", param="model")

    def lineage(self, adapter: LoadedAdapter | None = None) -> Lineage:
        return {"model": self.model_id, "weights_digest": self.engine.model.weights_digest,
                "adapter": adapter.name if adapter else None,
                "adapter_manifest_digest": adapter.artifact.manifest_digest if adapter else None,
                "serving_profile": self.profile.profile.value, "backend_route": self.backend_route}


def server_state(request: Request) -> ServerState:
    """The server's state; while it starts, every route but health's answers 503 `starting`."""
    state = request.app.state.kiln
    if state is None:
        progress = request.app.state.progress
        raise AdmissionRejected(f"the server is starting ({progress.phase}); /health says when it is ready",
                                code="starting", headers={"Retry-After": str(RETRY_AFTER_S)})
    return state


def server_settings(request: Request) -> Settings:
    """The settings, from the first moment (the state comes when the server is ready)."""
    return request.app.state.settings
