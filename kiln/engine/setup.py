"""Builds the model and engine from resolved settings (shared by serve, `kiln warmup` and bench)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import jax

from kiln.config import Settings
from kiln.engine import step_mirror
from kiln.engine.backends import Backend, select_backend
from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.metrics import EngineMetrics
from kiln.engine.warmup import build_step_set
from kiln.errors import BackendUnavailable
from kiln.models.loader import LoadedModel, load_model, resolve_dtype

log = logging.getLogger("kiln.engine")


def configure_compilation_cache(directory: Path) -> None:
    """Every executable goes to JAX's persistent cache, so a later start loads instead of compiling."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_model_from_settings(settings: Settings, show_progress: bool = True, route: Backend | None = None
                             ) -> LoadedModel:
    """The configured model. With `[model] quantization = auto` a GGUF file keeps its own layer format,
    except on an IREE `route`, which runs float weights."""
    m = settings.model
    quantization = m.quantization
    if quantization == "auto" and route is not None and route.is_iree:
        quantization = "none"
    model = load_model(m.path or None, dtype=m.dtype, show_progress=show_progress,
                       model_id=m.served_model_name or None, cache_root=settings.cache_dir(), quantization=quantization)
    if m.quantization != "auto":
        model.quantization_source = "[model] quantization"
    elif quantization != m.quantization:
        model.quantization_source = f"auto: the {route.name} route runs float weights"
    return model


def resolve_model(model, settings: Settings, show_progress: bool = True) -> LoadedModel:
    """A LoadedModel as is; a path loaded with the settings' dtype and cache; None: the configured
    model (the Python training APIs take any of the three)."""
    if model is None:
        return load_model_from_settings(settings, show_progress)
    if isinstance(model, LoadedModel):
        return model
    return load_model(model, dtype=settings.model.dtype, show_progress=show_progress, cache_root=settings.cache_dir(),
                      quantization=settings.model.quantization)


def select_backend_from_settings(settings: Settings, model: LoadedModel) -> Backend:
    """The backend route ([backend] route); BackendUnavailable when one asked for cannot run here."""
    requested = settings.backend.route
    if model.quantization == "none":
        route = select_backend(requested, settings.iree_cache_dir(), str(model.dtype))
    elif requested in ("auto", "xla"):  # (quantized steps are verified on XLA only: no IREE route is probed)
        route = select_backend("xla", settings.iree_cache_dir(), str(model.dtype))
        if requested == "auto":
            route.choice = dataclasses.replace(route.choice, reason=f"auto: {model.quantization} weights run on XLA")
    else:
        raise BackendUnavailable(f"route {requested}: model.quantization = {model.quantization} runs on the xla "
                                 "route only; set backend.route = xla or model.quantization = none")
    log.info("backend route %s (%s)", route.name, route.choice.reason)
    return route


def load_model_and_route(settings: Settings, show_progress: bool = True) -> tuple[LoadedModel, Backend]:
    """The model and the backend route it runs on. With quantization = auto and a route other than
    xla the route is chosen first (an IREE route takes the model's float weights)."""
    route = None
    if settings.model.quantization == "auto" and settings.backend.route != "xla":
        route = select_backend(settings.backend.route, settings.iree_cache_dir(), resolve_dtype(settings.model.dtype))
    model = load_model_from_settings(settings, show_progress, route)
    if route is None:
        route = select_backend_from_settings(settings, model)
    else:
        log.info("backend route %s (%s)", route.name, route.choice.reason)
    log.info("weights: %s (%s)", model.quantization, model.quantization_source)
    return model, route


def build_engine(settings: Settings, show_progress: bool = True) -> AsyncEngine:
    """The server's engine; on process 0 of a server over several processes, leading the others'."""
    configure_compilation_cache(settings.compilation_dir())
    d = settings.distributed
    listener = step_mirror.listen(d.coordinator) if d.num_processes > 1 else None
    model, route = load_model_and_route(settings, show_progress)
    engine = AsyncEngine(model, EngineConfig.from_settings(settings), EngineMetrics(model.model_id), route)
    if listener is not None:
        engine.lead(listener, d.num_processes - 1, d.timeout_s)
    return engine


def follow(settings: Settings, index: int, following: threading.Event | None = None) -> int:
    """Process `index` (> 0) of a server over several processes: builds the same engine (without KV
    events: process 0 publishes them), then repeats process 0's device work until it stops (`following`
    is set meanwhile). Exit status: 0 when process 0 stopped, 1 when it went away."""
    configure_compilation_cache(settings.compilation_dir())
    model, route = load_model_and_route(settings, show_progress=False)
    config = dataclasses.replace(EngineConfig.from_settings(settings), kv_events_endpoint="",
                                 kv_events_replay_endpoint="")
    core = EngineCore(model, config, backend=route)
    d = settings.distributed
    conn = step_mirror.connect(d.coordinator, index, d.timeout_s)
    try:
        step_mirror.Follower(core.runner, index).run(conn, following)
    except ConnectionError:
        log.error("process %d: process 0 went away; stopping", index)
        return 1
    finally:
        conn.close()
        core.close()
    log.info("process %d: process 0 stopped; stopping", index)
    return 0


def warmup(settings: Settings) -> int:
    """`kiln warmup`: builds the step set of the resolved settings into the compilation cache, so that
    the next start only loads it."""
    start = time.monotonic()
    configure_compilation_cache(settings.compilation_dir())
    model, backend = load_model_and_route(settings)
    core = EngineCore(model, EngineConfig.from_settings(settings), backend=backend)
    try:
        done = build_step_set(core.runner)
        print(f"warmup: {done['executables']} step executables ready in {time.monotonic() - start:.1f}s "
              f"({done['built']} built, {done['loaded']} loaded from disk) -> {settings.compilation_dir()}")
    finally:
        core.close()
    return 0
