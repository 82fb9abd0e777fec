"""Serving and lifecycle: `serve(settings)` loads the model, starts the engine, prewarms (unless
the serving profile is maintenance), loads configured adapters, resumes unfinished eval runs
and runs uvicorn; SIGTERM drains in-flight requests before exit."""

from __future__ import annotations

import concurrent.futures
import logging
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


def start_prewarm(settings: Settings, engine) -> concurrent.futures.Future | None:
    """Starts building the engine's step set (or loading it from disk) on the engine thread, so the
    rest of the start (adapter registry, jobs, evals, the grammar tokenizer) runs beside it; `finish_prewarm`
    waits for it before the server reports ready: from then on no request waits for a compiler. The
    LoRA steps are left for the first adapter load to build, before it returns: a server that never
    serves an adapter starts in about half the time. The steps a short chat turn runs are then run
    once (primed), so that a first request does not pay their first run. None under maintenance
    (nothing is built)."""
    if settings.serving_profile.profile is ServingProfile.MAINTENANCE:
        return None
    from kiln.engine.warmup import build_step_set, prime_first_contact

    runner = engine.core.runner  # it belongs to the engine thread
    return engine.at_boundary(lambda: {**build_step_set(runner, defer_lora=True), **prime_first_contact(runner)})


def finish_prewarm(state: ServerState, warming: concurrent.futures.Future | None) -> None:
    if warming is None:
        state.prewarm = "skipped"
        log.info("prewarm skipped: serving profile is maintenance")
        return
    done = warming.result()
    state.prewarm = "done"
    state.step_set = done
    log.info("step set ready: %d executables in %.1fs (%d built, %d loaded from disk, %d refused by a correctness "
             "gate, %d LoRA steps left for the first adapter; %d memory mappings); %d steps primed in %.1fs",
             done["executables"], done["seconds"], done["built"], done["loaded"], done["refused_by_gate"],
             done["deferred"], done["memory_mappings"], done["primed"], done["prime_seconds"])


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
    warming = start_prewarm(settings, engine)
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
    finish_prewarm(state, warming)
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
