"""Operator routes: health, configuration, metrics, and the adapter API (Kiln's and vLLM's)."""

from __future__ import annotations

from typing import Any

import jax
from litestar import Request, Response, delete, get, post

from kiln import __version__
from kiln.profiles import ServingProfile
from kiln.server.schemas import AdapterLoadRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from kiln.server.state import server_settings, server_state

OPEN_ROUTES = {"/health", "/v1/health", "/metrics"}  # answered without an API key


def _starting(request: Request) -> Response:
    """503 `starting`, with the start's progress: the process answers long before it can serve."""
    settings, progress = server_settings(request), request.app.state.progress
    profile = settings.serving_profile
    body = {
        "status": "starting",
        "model": settings.model.served_model_name or None,
        "serving_profile": profile.to_json(),
        "backend_runtime": {"healthy": True, "reason": None, "restart_required": False, "platform": None,
                            "devices": [], "route": None, "route_reason": None},
        "checks": {"inference_admission": profile.policy.inference_admission, "engine_loop": False,
                   "model_loaded": progress.phase not in ("starting the engine", "loading the model"),
                   "prewarm": "pending"},
        "startup": progress.to_json(),
    }
    return Response(body, status_code=503)


def serving_status(st) -> str:
    """What /health's `status` says of a ready server (the console shows it too)."""
    if st.engine.device_lost is not None or not st.engine.alive():
        return "unhealthy"
    if st.engine.route_info()["quarantined"] is not None:
        return "degraded"
    if st.profile.profile is ServingProfile.MAINTENANCE:
        return "maintenance"
    if st.prewarm == "pending":
        return "starting"
    if st.draining:
        return "draining"
    return "ok"


def _health(request: Request) -> Response:
    """200 only when serving. Device loss (unhealthy) and a quarantined route (degraded: requests are
    still served, on XLA) report backend_runtime.healthy false until a restart; a starting server says
    how far its start got, a draining one that it is leaving."""
    if request.app.state.kiln is None:
        return _starting(request)
    st = server_state(request)
    admission = st.profile.policy.inference_admission
    engine_ok = st.engine.alive()
    lost = st.engine.device_lost
    route = st.engine.route_info()
    quarantined = route["quarantined"]
    backend_ok = engine_ok and lost is None and quarantined is None
    if lost is not None:
        reason = f"device_lost: {lost.message}"
    elif not engine_ok:
        reason = "engine_stopped: the engine loop is not running"
    elif quarantined is not None:
        reason = f"route_quarantined: {quarantined}"
    else:
        reason = None
    status = serving_status(st)
    restart = lost is not None or quarantined is not None
    body = {
        "status": status,
        "model": st.model_id,
        "serving_profile": st.profile.to_json(),
        "backend_runtime": {"healthy": backend_ok, "reason": reason, "restart_required": restart,
                            "platform": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                            "route": st.backend_route, "route_reason": route["reason"]},
        "checks": {"inference_admission": admission, "engine_loop": engine_ok, "model_loaded": True,
                   "prewarm": st.prewarm},
    }
    return Response(body, status_code=200 if status == "ok" else 503)


@get("/health", sync_to_thread=False)
def health(request: Request) -> Response:
    return _health(request)


@get("/v1/health", sync_to_thread=False)
def health_v1(request: Request) -> Response:
    return _health(request)


@get("/v1/config", sync_to_thread=False)
def config(request: Request) -> dict[str, Any]:
    st = server_state(request)
    loaded = st.engine.model
    model = {"id": st.model_id, "weights_digest": loaded.weights_digest, "max_model_len": st.engine.max_model_len,
             "quantization": {"value": loaded.quantization, "source": loaded.quantization_source}}
    kv_pool = {**st.engine.kv_pool.to_json(), "blocks_now": st.engine.snapshot["kv_blocks_total"] + 1,
               "resident_bytes": st.engine.kv_resident_bytes}
    steps = {"executables": st.engine.step_set(), "startup": st.step_set}
    backend = st.engine.route_info()
    return {**st.settings.to_json(), "model": model, "backend": backend, "mesh": st.engine.mesh_info(),
            "step_set": steps, "kv_pool": kv_pool, "version": __version__}


@get("/metrics", sync_to_thread=False, media_type="text/plain; version=0.0.4")
def metrics(request: Request) -> bytes:
    return server_state(request).metrics.render()


@get("/v1/adapters", sync_to_thread=True)
def list_adapters(request: Request) -> dict[str, Any]:
    st = server_state(request)
    return {"object": "list", "data": st.adapters.describe_all(), "slots": st.engine.snapshot["resident_adapters"],
            "max_loras": st.engine.config.max_loras, "max_lora_rank": st.engine.config.max_lora_rank}


@post("/v1/adapters", status_code=200, sync_to_thread=True)
def load_adapter(request: Request, data: AdapterLoadRequest) -> dict[str, Any]:
    return server_state(request).adapters.load(data.name, data.path, replace=data.replace).describe()


@delete("/v1/adapters/{name:str}", status_code=200, sync_to_thread=True)
def unload_adapter(request: Request, name: str) -> dict[str, Any]:
    entry = server_state(request).adapters.unload(name)
    return {"name": entry.name, "object": "adapter", "unloaded": True}


@post("/v1/load_lora_adapter", status_code=200, sync_to_thread=True, media_type="text/plain")
def load_lora_adapter(request: Request, data: LoadLoraAdapterRequest) -> str:
    server_state(request).adapters.load(data.lora_name, data.lora_path, replace=data.load_inplace)
    return f"Success: LoRA adapter '{data.lora_name}' added successfully."


@post("/v1/unload_lora_adapter", status_code=200, sync_to_thread=True, media_type="text/plain")
def unload_lora_adapter(request: Request, data: UnloadLoraAdapterRequest) -> str:
    server_state(request).adapters.unload(data.lora_name)
    return f"Success: LoRA adapter '{data.lora_name}' removed successfully."


ROUTES = [health, health_v1, config, metrics, list_adapters, load_adapter, unload_adapter, load_lora_adapter,
          unload_lora_adapter]
