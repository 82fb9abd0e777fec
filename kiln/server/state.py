"""What the HTTP layer holds: settings, the engine, the adapter registry, and the request policy."""

from __future__ import annotations

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

Lineage = dict[str, Any]


@dataclasses.dataclass
class ServerState:
    settings: Settings
    engine: AsyncEngine
    metrics: EngineMetrics
    adapters: AdapterRegistry
    jobs: Any = None  # kiln.train.jobs.JobManager
    evals: Any = None  # kiln.eval.service.EvalService
    prewarm: str = "pending"  # pending | done | skipped
    step_set: dict | None = None  # what prewarm built: executables, built, loaded, seconds

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
        return self.engine.core.grammars

    @property
    def backend_route(self) -> str:
        route = self.engine.core.route
        return f"xla:{jax.default_backend()}" if route.name == "xla" else route.name

    def admit_inference(self) -> None:
        """Request policy before anything is submitted: device, profile, engine health, queue length."""
        if self.engine.device_lost is not None:
            raise DeviceLost(self.engine.device_lost.message)
        if not self.profile.policy.inference_admission:
            raise AdmissionRejected("inference is disabled by the maintenance serving profile",
                                    code="inference_disabled_by_profile")
        if not self.engine.alive():
            raise AdmissionRejected("the engine is not running", code="engine_unavailable")
        if self.engine.num_waiting() >= self.settings.server.max_waiting_requests:
            raise QueueFull("too many requests are waiting; retry later")

    def select_model(self, model: str | None) -> LoadedAdapter | None:
        """The adapter a request's `model` selects (None: the base model)."""
        if model in (None, "", self.model_id):
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise NotFound(f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return adapter

    def lineage(self, adapter: LoadedAdapter | None = None) -> Lineage:
        return {"model": self.model_id, "weights_digest": self.engine.model.weights_digest,
                "adapter": adapter.name if adapter else None,
                "adapter_manifest_digest": adapter.artifact.manifest_digest if adapter else None,
                "serving_profile": self.profile.profile.value, "backend_route": self.backend_route}


def server_state(request: Request) -> ServerState:
    return request.app.state.kiln
