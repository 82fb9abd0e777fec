"""Serving and lifecycle: `serve(settings)` binds the HTTP port first, then starts the server behind
it: loads the model, starts the engine, prewarms (unless the serving profile is maintenance),
loads configured adapters and resumes unfinished eval runs. Until that is done `/health` answers
503 `starting` with the start's progress and every other route 503 `starting`. SIGTERM drains:
new inference gets 503 `server_shutting_down`, running requests finish until `drain_timeout_s`,
and those still running then end with that error (a stream gets it as its last event, then
`[DONE]`) before the process exits 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from kiln.config import Settings
from kiln.errors import AdmissionRejected, BackendUnavailable, KilnError, ModelLoadError, TemplateError
from kiln.profiles import ServingProfile, log_startup
from kiln.server.app import create_app
from kiln.server.state import ServerState

log = logging.getLogger("kiln.server")

# after the drain, uvicorn waits this long for connections to close (the responses have ended by then)
CLOSE_TIMEOUT_S = 5
# after the drain's deadline has ended the remaining requests, their streams get this long to send it
ABORT_GRACE_S = 5


@dataclasses.dataclass
class StartProgress:
    """What a starting server reports on /health: the phase, and for the step set k of n built."""

    phase: str = "starting the engine"
    done: int | None = None
    total: int | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)

    def to_json(self) -> dict:
        return {"phase": self.phase, "done": self.done, "total": self.total,
                "elapsed_s": round(time.monotonic() - self.started, 1)}

    def step(self, done: int, total: int) -> None:
        # the phase changes with the first count, so /health never says "building" without k of n
        self.phase, self.done, self.total = "building the step set", done, total


def start_prewarm(settings: Settings, engine, progress: StartProgress | None = None
                  ) -> concurrent.futures.Future | None:
    """Starts building the engine's step set (or loading it from disk) on the engine thread, so the
    rest of the start (adapter registry, jobs, evals, the grammar tokenizer) runs beside it; `finish_prewarm`
    waits for it before the server reports ready: from then on no request waits for a compiler. The
    LoRA steps are left for the first adapter load to build, before it returns: a server that never
    serves an adapter starts in about half the time. The steps a short chat turn runs are then run
    once (primed), so that a first request does not pay their first run. None under maintenance
    (nothing is built)."""
    if settings.serving_profile.profile is ServingProfile.MAINTENANCE:
        return None
    return engine.prewarm(progress.step if progress is not None else None)


def finish_prewarm(state: ServerState, warming: concurrent.futures.Future | None) -> None:
    if warming is None:
        state.prewarm = "skipped"
        log.info("prewarm skipped: serving profile is maintenance")
        return
    done = warming.result()
    state.prewarm = "done"
    state.step_set = done
    if done["built"]:
        import jax

        # tracing and lowering the steps left their jaxprs and MLIR modules in JAX's caches (some 60 MiB
        # for the default model), which nothing reads again: the engine holds the executables themselves.
        # Dropped here, in the server's own process only, so a library user's compiled functions stay.
        jax.clear_caches()
    log.info("step set ready: %d executables in %.1fs (%d built, %d loaded from disk, %d refused by a correctness "
             "gate, %d LoRA steps left for the first adapter; %d memory mappings); %d steps primed in %.1fs",
             done["executables"], done["seconds"], done["built"], done["loaded"], done["refused_by_gate"],
             done["deferred"], done["memory_mappings"], done["primed"], done["prime_seconds"])


def warm_chat_prefix(state: ServerState) -> None:
    """Prefills what every one-message chat starts with into the prefix cache before ready (the chat
    template's opening: for a template that adds a default system prompt, that prompt), so that a
    first chat request finds it cached, as the requests after it do. Found as the tokens two
    renderings share; none where the profile admits no inference or the model has no template."""
    if not state.profile.policy.inference_admission:
        return
    tok = state.tokenizer
    try:
        a, b = (tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                           add_special_tokens=False) for text in ("a", "b"))
    except TemplateError:
        return
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    try:
        cached = state.engine.warm_prefix(a[:shared]).result()
    except KilnError as exc:  # an optimisation: a failure is logged, never fatal
        log.warning("prefilling the chat template's opening failed (%s); a first chat request prefills it", exc)
        return
    if cached:
        log.info("chat template's opening prefilled: %d tokens in the prefix cache", cached)


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


class Start:
    """The server behind the port: built on its own thread while the port already answers, and
    published to the app (`app.state.kiln`) once ready. A start that fails prints why and stops
    the HTTP server with exit status 1."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.progress = StartProgress()
        self.state: ServerState | None = None  # set once ready
        self.exit_code = 0
        self._built: list = []  # what to stop at exit, in order: evals, jobs, engine
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """The start is still under way (a stop now cannot wait for it)."""
        return self._thread is not None and self._thread.is_alive()

    def begin(self, app, server: uvicorn.Server) -> None:
        self._thread = threading.Thread(target=self._run, args=(app, server), name="kiln-start", daemon=True)
        self._thread.start()

    def _run(self, app, server: uvicorn.Server) -> None:
        try:
            state = self._build()
        except ModelLoadError as exc:
            print(f"kiln: error: cannot load the model: {exc}", file=sys.stderr)
            state = None
        except BackendUnavailable as exc:
            print(f"kiln: error: backend: {exc}", file=sys.stderr)
            state = None
        except KilnError as exc:
            print(f"kiln: error: {exc}", file=sys.stderr)
            state = None
        except Exception:  # the start thread's boundary: any failure ends the process with exit 1, logged
            log.exception("the server failed to start")
            state = None
        if state is None:
            self.exit_code = 1
            server.should_exit = True
            return
        self.state = app.state.kiln = state
        self.progress.phase = "ready"
        log.info("serving %s on http://%s:%d (ready in %.1fs)", state.model_id, self.settings.server.host,
                 self.settings.server.port, time.monotonic() - self.progress.started)

    def _build(self) -> ServerState | None:
        from kiln.adapters.registry import AdapterRegistry
        from kiln.adapters.store import AdapterStore
        from kiln.agent.metrics import AgentMetrics
        from kiln.engine.host_memory import trim_heap
        from kiln.engine.setup import build_engine
        from kiln.eval.service import EvalService
        from kiln.eval.store import EvalStore
        from kiln.server.grader_routes import make_judge
        from kiln.server.response_store import ResponseStore
        from kiln.train.jobs import JobManager
        from kiln.train.store import TrainingStore

        settings, progress = self.settings, self.progress
        progress.phase = "loading the model"
        engine = build_engine(settings)
        self._built.append(engine.shutdown)
        warming = start_prewarm(settings, engine, progress)
        registry = AdapterRegistry(engine, AdapterStore(settings.adapter_store()),
                                   settings.serving_profile.policy.adapter_weight_transitions)
        jobs = JobManager(settings, engine, registry, TrainingStore(settings.training_dir()), start=False)
        state = ServerState(settings, engine, engine.metrics, registry, jobs,
                            responses=ResponseStore(settings.training_dir()),
                            agent_metrics=AgentMetrics(engine.metrics.registry, engine.metrics.model_name))
        self._built.append(state.responses.close)
        state.evals = jobs.evals = EvalService(EvalStore(settings.training_dir()), engine,
                                               select_model=state.select_model, judge=make_judge(state),
                                               files=jobs.store, mcp_commands=settings.server.mcp_commands)
        jobs.start()  # after the eval service: a resumed job may end with its gate
        self._built[:0] = [state.evals.shutdown, jobs.shutdown]
        state.grammars.tokenizer  # noqa: B018 (built now, so no request's compile waits for it)
        finish_prewarm(state, warming)
        warm_chat_prefix(state)
        trim_heap()  # what the start freed (host copies of the weights, compiler scratch) goes back to the OS
        progress.phase = "loading adapters"
        if not preload_adapters(state):
            return None
        resume_evals(state)
        return state

    def stop(self) -> None:
        """Stops what the start built: eval runs keep their outcomes and running jobs checkpoint (both
        resume at the next start), then the engine."""
        for stop in self._built:
            stop()


class KilnServer(uvicorn.Server):
    """uvicorn, bound before the server behind it starts, and draining on the first SIGTERM or
    SIGINT: admission refuses inference (503 server_shutting_down, Retry-After), running requests
    finish until the drain deadline, and whatever still runs then ends with that error. A second
    signal ends them at once."""

    def __init__(self, config: uvicorn.Config, start: Start, app):
        super().__init__(config)
        self.start = start
        self.app = app
        self.drain_deadline: float | None = None
        self.aborted_at: float | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if not self.should_exit:  # the port answers from here on; the engine starts behind it
            self.start.begin(self.app, self)

    def handle_exit(self, sig: int, frame) -> None:
        state = self.start.state
        if state is None or self.should_exit:  # still starting (or already stopping): stop now
            super().handle_exit(sig, frame)
        elif self.drain_deadline is None:
            timeout = self.start.settings.server.drain_timeout_s
            self.drain_deadline = time.monotonic() + timeout
            state.draining = True
            log.info("draining: %d request(s) in flight may finish within %.0fs; new inference gets 503",
                     state.engine.num_requests(), timeout)
        else:  # a second signal: end the drain now
            self.drain_deadline = 0.0

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            self._drain_tick()
        return await super().on_tick(counter)

    def _drain_tick(self) -> None:
        engine, now = self.start.state.engine, time.monotonic()
        if engine.num_requests() == 0:
            self.should_exit = True
        elif self.aborted_at is None and now >= self.drain_deadline:
            n = engine.num_requests()
            engine.abort_all(AdmissionRejected("the server is shutting down: the request did not finish within "
                                               "drain_timeout_s", code="server_shutting_down"))
            self.aborted_at = now
            log.info("drain deadline: %d request(s) still running were ended", n)
        elif self.aborted_at is not None and now - self.aborted_at > ABORT_GRACE_S:
            self.should_exit = True


def serve(settings: Settings, sock: socket.socket) -> int:
    """Serves on `sock`, the listening socket bound before anything else was loaded (`kiln.cli`)."""
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_startup(settings.serving_profile, log)
    start = Start(settings)
    app = create_app(None, settings=settings, progress=start.progress)
    config = uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level, timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
                            access_log=False)
    server = KilnServer(config, start, app)
    # uvicorn re-raises SIGTERM/SIGINT after its shutdown; a Python handler lets us finish our own
    # shutdown and exit 0 instead of dying by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        if not start.running:
            start.stop()
    if start.running:  # stopped while starting: the start's thread may be inside a compile
        log.info("stopped while starting")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(start.exit_code)
    return start.exit_code
