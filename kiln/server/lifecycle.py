"""Serving and lifecycle: `serve(settings)` loads the model, starts the engine, prewarms (unless
the serving profile is maintenance), loads configured adapters, resumes unfinished eval runs
and runs uvicorn; SIGTERM drains in-flight requests before exit."""

from __future__ import annotations

import logging
import os
import signal
import sys

import uvicorn

from kiln.config import Settings
from kiln.errors import KilnError, ModelLoadError
from kiln.iree.device import RouteUnavailable
from kiln.profiles import ServingProfile, log_startup
from kiln.server.app import create_app
from kiln.server.state import ServerState

log = logging.getLogger("kiln.server")


def prewarm(state: ServerState) -> None:
    """Compiles (or loads from the persistent cache) a decode bucket per row bucket and a prefill
    bucket per token bucket, each with room for a full prefill chunk of context: every plain
    batch up to that context can then run at once, padded, while its own bucket compiles."""
    if state.profile.profile is ServingProfile.MAINTENANCE:
        state.prewarm = "skipped"
        log.info("prewarm skipped: serving profile is maintenance")
        return
    runner = state.engine.core.runner
    shapes = runner.fallback_shapes(state.engine.config.max_num_batched_tokens)
    # the runner belongs to the engine thread
    state.engine.at_boundary(lambda: runner.warm(shapes, workers=os.cpu_count() or 1)).result()
    state.prewarm = "done"
    log.info("prewarm: %d step buckets ready", len(shapes))


def preload_adapters(state: ServerState) -> bool:
    """Loads `adapters.load` entries ("name" from the store, or "name=path") before serving."""
    for entry in state.settings.adapters.load:
        name, _, path = entry.partition("=")
        try:
            state.adapters.load(name.strip(), path.strip() or None)
        except KilnError as exc:
            print(f"kiln: error: cannot load adapter {entry!r} (adapters.load): {exc}", file=sys.stderr)
            return False
    return True


def resume_evals(state: ServerState) -> None:
    """Restarts the eval runs a previous process left unfinished (after adapters are loaded, so a
    run on an adapter finds it); under maintenance they wait for a start that admits inference."""
    if not state.profile.policy.inference_admission:
        log.info("eval runs not resumed: the serving profile disables inference")
        return
    resumed = state.evals.resume()
    if resumed:
        log.info("resumed %d eval run(s)", resumed)


def serve(settings: Settings) -> int:
    from kiln.adapters.registry import AdapterRegistry
    from kiln.adapters.store import AdapterStore
    from kiln.engine.setup import build_engine

    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_startup(settings.serving_profile, log)
    try:
        engine = build_engine(settings)
    except ModelLoadError as exc:
        print(f"kiln: error: cannot load the model: {exc}", file=sys.stderr)
        return 1
    except RouteUnavailable as exc:
        print(f"kiln: error: backend: {exc}", file=sys.stderr)
        return 1
    registry = AdapterRegistry(engine, AdapterStore(settings.adapter_store()),
                               settings.serving_profile.policy.adapter_weight_transitions)
    from kiln.eval.service import EvalService
    from kiln.eval.store import EvalStore
    from kiln.server.grader_routes import make_judge
    from kiln.train.jobs import JobManager
    from kiln.train.store import TrainingStore

    jobs = JobManager(settings, engine, registry, TrainingStore(settings.training_dir()), start=False)
    state = ServerState(settings, engine, engine.core.metrics, registry, jobs)
    state.evals = jobs.evals = EvalService(EvalStore(settings.training_dir()), engine, select_model=state.select_model,
                                           judge=make_judge(state), files=jobs.store)
    jobs.start()  # after the eval service: a resumed job may end with its gate
    state.grammars.tokenizer  # noqa: B018 (built now, so no request's compile waits for it)
    prewarm(state)
    if not preload_adapters(state):
        jobs.shutdown()
        engine.shutdown()
        return 1
    resume_evals(state)
    config = uvicorn.Config(create_app(state), host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level, timeout_graceful_shutdown=30, access_log=False)
    log.info("serving %s on http://%s:%d", state.model_id, settings.server.host, settings.server.port)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; a Python handler lets us
    # finish our own shutdown and exit 0 instead of dying by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()  # on SIGTERM: stop accepting, drain in-flight requests, exit
    finally:
        state.evals.shutdown()  # a run in progress keeps its outcomes; it resumes at the next start
        jobs.shutdown()  # a running job checkpoints; it resumes at the next start
        engine.shutdown()
    return 0
