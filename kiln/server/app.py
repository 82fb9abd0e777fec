"""The Litestar application: OpenAI-compatible routes, health, config, metrics, render.

`serve(settings)` loads the model, starts the engine, prewarms (unless the serving profile
is maintenance) and runs uvicorn; SIGTERM drains in-flight requests before exit.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
from typing import Any

import jax
import uvicorn
from litestar import Litestar, Request, Response, delete, get, post
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream

from kiln import __version__
from kiln.adapters.registry import AdapterError, AdapterRegistry, LoadedAdapter
from kiln.config import Settings
from kiln.engine.engine import Engine
from kiln.errors import (
    AdmissionRejected,
    InvalidRequest,
    KilnError,
    NotFound,
    QueueFull,
    RequestFailed,
    Unauthorized,
)
from kiln.models.errors import ModelLoadError
from kiln.profiles import ServingProfile, log_startup
from kiln.server import openai_api as oa
from kiln.server.metrics import Metrics
from kiln.server.schemas import (
    AdapterLoadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    RenderRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)

log = logging.getLogger("kiln.server")
OPEN_ROUTES = {"/health", "/v1/health", "/metrics"}


@dataclasses.dataclass
class ServerState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    model_id: str
    adapters: AdapterRegistry
    prewarm: str = "pending"  # pending | done | skipped

    @property
    def profile(self):
        return self.settings.serving_profile

    @property
    def tokenizer(self):
        return self.engine.model.tokenizer

    def admit_inference(self) -> None:
        if not self.profile.policy.inference_admission:
            raise AdmissionRejected("inference is disabled by the maintenance serving profile", "inference_disabled_by_profile")
        if not self.engine.alive():
            raise AdmissionRejected("the engine is not running", "engine_unavailable")
        if self.engine.num_waiting() >= self.settings.server.max_waiting_requests:
            raise QueueFull("too many requests are waiting; retry later")

    def check_model(self, model: str | None) -> LoadedAdapter | None:
        """The adapter a request's `model` selects (None: the base model)."""
        if model in (None, "", self.model_id):
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise NotFound(f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return adapter

    def lineage(self, adapter: LoadedAdapter | None = None) -> dict[str, Any]:
        m = self.engine.model
        return {"model": self.model_id, "weights_digest": m.weights_digest,
                "adapter": adapter.name if adapter else None,
                "adapter_manifest_digest": adapter.artifact.manifest_digest if adapter else None,
                "serving_profile": self.profile.profile.value, "backend_route": f"xla:{jax.default_backend()}"}

    def kiln_object(self, finals, adapter: LoadedAdapter | None = None) -> dict[str, Any]:
        return {"latency": [d.metrics for d in finals], "lineage": self.lineage(adapter)}


def _state(request: Request) -> ServerState:
    return request.app.state.kiln


# ---- errors --------------------------------------------------------------------------------


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None) -> Response:
    return Response({"error": {"message": message, "type": type_, "code": code, "param": param}}, status_code=status)


def _kiln_error(_: Request, exc: KilnError) -> Response:
    return Response(exc.body(), status_code=exc.status)


def _validation_error(_: Request, exc: ValidationException) -> Response:
    detail = exc.extra if isinstance(exc.extra, list) else []
    message = "; ".join(str(e.get("message", e)) for e in detail if isinstance(e, dict)) or exc.detail
    param = next((e.get("key") for e in detail if isinstance(e, dict) and e.get("key")), None)
    return _error(400, f"invalid request body: {message}", "invalid_request_error", None, param)


def _http_error(_: Request, exc: HTTPException) -> Response:
    type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _error(exc.status_code, str(exc.detail), type_)


def _unexpected_error(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return _error(500, f"internal error: {type(exc).__name__}", "internal_error")


async def _authorize(request: Request) -> Response | None:
    keys = _state(request).settings.server.api_keys
    if not keys or request.url.path in OPEN_ROUTES:
        return None
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer ") or header[7:].strip() not in keys:
        raise Unauthorized("missing or invalid API key")
    return None


# ---- health, config, models, metrics -------------------------------------------------------


def _health(request: Request) -> Response:
    st = _state(request)
    admission = st.profile.policy.inference_admission
    engine_ok = st.engine.alive()
    if st.profile.profile is ServingProfile.MAINTENANCE:
        status = "maintenance"
    elif not engine_ok:
        status = "unhealthy"
    elif st.prewarm == "pending":
        status = "starting"
    else:
        status = "ok"
    body = {
        "status": status,
        "model": st.model_id,
        "serving_profile": st.profile.to_json(),
        "backend_runtime": {"healthy": engine_ok, "platform": jax.default_backend(),
                            "devices": [str(d) for d in jax.devices()], "route": f"xla:{jax.default_backend()}"},
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
    st = _state(request)
    return {**st.settings.to_json(), "model": {"id": st.model_id, "weights_digest": st.engine.model.weights_digest,
                                               "max_model_len": st.engine.max_model_len}, "version": __version__}


@get("/v1/models", sync_to_thread=False)
def models(request: Request) -> dict[str, Any]:
    st = _state(request)
    card = {"id": st.model_id, "object": "model", "created": 0, "owned_by": "kiln", "root": st.model_id,
            "parent": None, "max_model_len": st.engine.max_model_len}
    adapters = [{"id": a.name, "object": "model", "created": int(a.loaded_at), "owned_by": "kiln", "root": a.source,
                 "parent": st.model_id, "max_model_len": st.engine.max_model_len} for a in st.adapters.loaded()]
    return {"object": "list", "data": [card, *adapters]}


# ---- adapters ------------------------------------------------------------------------------


def _adapter_call(fn, *args, **kwargs):
    """Registry refusals become OpenAI error bodies with the registry's code."""
    try:
        return fn(*args, **kwargs)
    except AdapterError as exc:
        if exc.status == 404:
            raise NotFound(str(exc), code=exc.code) from None
        if exc.status == 503:
            raise AdmissionRejected(str(exc), exc.code) from None
        if exc.status == 500:
            raise RequestFailed(str(exc), code=exc.code) from None
        raise InvalidRequest(str(exc), code=exc.code) from None


@get("/v1/adapters", sync_to_thread=True)
def list_adapters(request: Request) -> dict[str, Any]:
    st = _state(request)
    return {"object": "list", "data": st.adapters.describe_all(), "slots": st.engine.lora_slots.resident(),
            "max_loras": st.engine.config.max_loras, "max_lora_rank": st.engine.config.max_lora_rank}


@post("/v1/adapters", status_code=200, sync_to_thread=True)
def load_adapter(request: Request, data: AdapterLoadRequest) -> dict[str, Any]:
    st = _state(request)
    return _adapter_call(st.adapters.load, data.name, data.path, replace=data.replace).describe()


@delete("/v1/adapters/{name:str}", status_code=200, sync_to_thread=True)
def unload_adapter(request: Request, name: str) -> dict[str, Any]:
    st = _state(request)
    entry = _adapter_call(st.adapters.unload, name)
    return {"name": entry.name, "object": "adapter", "unloaded": True}


@post("/v1/load_lora_adapter", status_code=200, sync_to_thread=True, media_type="text/plain")
def load_lora_adapter(request: Request, data: LoadLoraAdapterRequest) -> str:
    st = _state(request)
    _adapter_call(st.adapters.load, data.lora_name, data.lora_path, replace=data.load_inplace)
    return f"Success: LoRA adapter '{data.lora_name}' added successfully."


@post("/v1/unload_lora_adapter", status_code=200, sync_to_thread=True, media_type="text/plain")
def unload_lora_adapter(request: Request, data: UnloadLoraAdapterRequest) -> str:
    st = _state(request)
    _adapter_call(st.adapters.unload, data.lora_name)
    return f"Success: LoRA adapter '{data.lora_name}' removed successfully."


@get("/metrics", sync_to_thread=False, media_type="text/plain; version=0.0.4")
def metrics(request: Request) -> bytes:
    return _state(request).metrics.render()


# ---- tokenizer routes ----------------------------------------------------------------------


def _prompt_ids(st: ServerState, body) -> list[int]:
    if body.messages is not None:
        return oa.render_chat(st.tokenizer, body, body.messages)
    if isinstance(body.prompt, list):
        return list(body.prompt)
    if body.prompt is not None:
        return st.tokenizer.encode(body.prompt, add_special_tokens=getattr(body, "add_special_tokens", True))
    raise InvalidRequest("either messages or prompt is required", param="prompt")


@post("/tokenize", status_code=200, sync_to_thread=False)
def tokenize(request: Request, data: TokenizeRequest) -> dict[str, Any]:
    st = _state(request)
    st.check_model(data.model)
    ids = _prompt_ids(st, data)
    return {"tokens": ids, "count": len(ids), "max_model_len": st.engine.max_model_len}


@post("/detokenize", status_code=200, sync_to_thread=False)
def detokenize(request: Request, data: DetokenizeRequest) -> dict[str, Any]:
    st = _state(request)
    st.check_model(data.model)
    if any(not 0 <= t < st.tokenizer.vocab_size for t in data.tokens):
        raise InvalidRequest("token ids must be within the vocabulary", param="tokens")
    return {"prompt": st.tokenizer.decode(data.tokens)}


@post("/render", status_code=200, sync_to_thread=False)
def render(request: Request, data: RenderRequest) -> dict[str, Any]:
    """The exact prompt token ids Kiln would compute for a chat or completion body."""
    st = _state(request)
    st.check_model(data.model)
    ids = _prompt_ids(st, data)
    return {"model": st.model_id, "prompt_token_ids": ids, "count": len(ids)}


# ---- generation ----------------------------------------------------------------------------


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, data: ChatCompletionRequest) -> Response | Stream:
    st = _state(request)
    st.admit_inference()
    adapter = st.check_model(data.model)
    if not data.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    prompt = oa.render_chat(st.tokenizer, data, data.messages)
    params = oa.sampling_params(data, oa.chat_max_tokens(data), oa.chat_logprob_count(data))
    oa.check_sampling(st.engine, prompt, params)
    rid = oa.new_id("chatcmpl")
    stream = st.engine.generate(rid, prompt, params, cache_salt=data.cache_salt, adapter=adapter and adapter.weights)
    model_name = adapter.name if adapter else st.model_id
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(_chat_stream(st, rid, stream, params, len(prompt), include_usage, adapter),
                      media_type="text/event-stream")
    texts, lps, finals = [""] * params.n, [[] for _ in range(params.n)], [None] * params.n
    async for d in stream:
        oa.raise_if_failed(d)
        texts[d.index] += d.text
        lps[d.index] += d.logprobs or []
        if d.finish_reason is not None:
            finals[d.index] = d
            st.metrics.observe(d.metrics, d.usage["completion_tokens"], d.finish_reason)
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                "logprobs": oa.chat_logprobs(st.tokenizer, lps[i]) if params.logprobs is not None else None,
                "finish_reason": finals[i].finish_reason, "stop_reason": finals[i].stop_reason} for i in range(params.n)]
    return Response({"id": rid, "object": "chat.completion", "created": oa.now(), "model": model_name,
                     "choices": choices, "usage": oa.usage(finals, [len(prompt)]),
                     "kiln": st.kiln_object(finals, adapter)})


async def _chat_stream(st: ServerState, rid: str, stream, params, prompt_len: int, include_usage: bool, adapter):
    created = oa.now()
    base = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": adapter.name if adapter else st.model_id}
    finals = []
    try:
        for i in range(params.n):
            yield oa.sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        async for d in stream:
            oa.raise_if_failed(d)
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                      "logprobs": oa.chat_logprobs(st.tokenizer, d.logprobs) if d.logprobs else None,
                      "finish_reason": d.finish_reason}
            chunk = {**base, "choices": [choice]}
            if d.finish_reason is not None:
                finals.append(d)
                st.metrics.observe(d.metrics, d.usage["completion_tokens"], d.finish_reason)
                if len(finals) == params.n and not include_usage:
                    chunk["kiln"] = st.kiln_object(finals, adapter)
            if choice["delta"] or choice["finish_reason"] or choice["logprobs"]:
                yield oa.sse(chunk)
        if include_usage:
            yield oa.sse({**base, "choices": [], "usage": oa.usage(finals, [prompt_len]),
                          "kiln": st.kiln_object(finals, adapter)})
    except KilnError as exc:
        yield oa.sse(exc.body())
    finally:
        await stream.aclose()
    yield b"data: [DONE]\n\n"


@post("/v1/completions", status_code=200)
async def completions(request: Request, data: CompletionRequest) -> Response | Stream:
    st = _state(request)
    st.admit_inference()
    adapter = st.check_model(data.model)
    oa.completion_checks(data)
    prompts = oa.completion_prompts(st.tokenizer, data.prompt)
    params = oa.sampling_params(data, data.max_tokens, data.logprobs)
    if data.echo and data.logprobs is not None and params.prompt_logprobs is None:
        params.prompt_logprobs = data.logprobs  # echo + logprobs returns the prompt's logprobs too
    for p in prompts:
        oa.check_sampling(st.engine, p, params)
    rid = oa.new_id("cmpl")
    streams = [st.engine.generate(f"{rid}-{i}", p, params, cache_salt=data.cache_salt, adapter=adapter and adapter.weights)
               for i, p in enumerate(prompts)]
    merged = oa.merged(streams)
    n = params.n
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(_completion_stream(st, rid, merged, n, len(prompts), [len(p) for p in prompts], include_usage,
                                         adapter), media_type="text/event-stream")
    total = n * len(prompts)
    texts, lps, finals, prompt_lps = [""] * total, [[] for _ in range(total)], [None] * total, [None] * total
    async for pi, d in merged:
        oa.raise_if_failed(d)
        idx = pi * n + d.index
        texts[idx] += d.text
        lps[idx] += d.logprobs or []
        if d.prompt_logprobs is not None:
            prompt_lps[idx] = d.prompt_logprobs
        if d.finish_reason is not None:
            finals[idx] = d
            st.metrics.observe(d.metrics, d.usage["completion_tokens"], d.finish_reason)
    choices = []
    for idx in range(total):
        prompt_ids = prompts[idx // n]
        text = texts[idx]
        logprobs = None
        if data.echo:
            prompt_text = st.tokenizer.decode(prompt_ids)
            text = prompt_text + text
        if data.logprobs is not None:
            items = lps[idx]
            if data.echo:  # the first prompt token has no logprob; the rest come from prompt logprobs
                items = [oa.TokenLogprob(prompt_ids[0], None, []), *(prompt_lps[idx] or [])[1:], *items]
            logprobs = oa.completion_logprobs(st.tokenizer, items)
        choices.append({"index": idx, "text": text, "logprobs": logprobs, "finish_reason": finals[idx].finish_reason,
                        "stop_reason": finals[idx].stop_reason})
    return Response({"id": rid, "object": "text_completion", "created": oa.now(),
                     "model": adapter.name if adapter else st.model_id, "choices": choices,
                     "usage": oa.usage(finals, [len(p) for p in prompts]), "kiln": st.kiln_object(finals, adapter)})


async def _completion_stream(st: ServerState, rid, merged, n, n_prompts, prompt_lens, include_usage, adapter):
    base = {"id": rid, "object": "text_completion", "created": oa.now(), "model": adapter.name if adapter else st.model_id}
    finals = []
    total = n * n_prompts
    try:
        async for pi, d in merged:
            oa.raise_if_failed(d)
            idx = pi * n + d.index
            choice = {"index": idx, "text": d.text, "logprobs": oa.completion_logprobs(st.tokenizer, d.logprobs) if d.logprobs else None,
                      "finish_reason": d.finish_reason}
            chunk = {**base, "choices": [choice]}
            if d.finish_reason is not None:
                finals.append(d)
                st.metrics.observe(d.metrics, d.usage["completion_tokens"], d.finish_reason)
                if len(finals) == total and not include_usage:
                    chunk["kiln"] = st.kiln_object(finals, adapter)
            if d.text or d.finish_reason is not None:
                yield oa.sse(chunk)
        if include_usage:
            yield oa.sse({**base, "choices": [], "usage": oa.usage(finals, prompt_lens),
                          "kiln": st.kiln_object(finals, adapter)})
    except KilnError as exc:
        yield oa.sse(exc.body())
    finally:
        await merged.aclose()
    yield b"data: [DONE]\n\n"


# ---- app and serve -------------------------------------------------------------------------


def create_app(state: ServerState) -> Litestar:
    app = Litestar(
        route_handlers=[health, health_v1, config, models, metrics, tokenize, detokenize, render,
                        chat_completions, completions, list_adapters, load_adapter, unload_adapter,
                        load_lora_adapter, unload_lora_adapter],
        exception_handlers={KilnError: _kiln_error, ValidationException: _validation_error,
                            HTTPException: _http_error, Exception: _unexpected_error},
        before_request=_authorize,
        request_max_body_size=state.settings.server.max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="Kiln", version=__version__, path="/schema"),
        debug=False,
    )
    app.state.kiln = state
    return app


def prewarm(state: ServerState) -> None:
    """Compiles (or loads from the persistent cache) the smallest decode and prefill buckets."""
    if state.profile.profile is ServingProfile.MAINTENANCE:
        state.prewarm = "skipped"
        log.info("prewarm skipped: serving profile is maintenance")
        return
    runner = state.engine.runner
    shapes = [s for s in runner.warmup_shapes(runner.config.block_size) if s.blocks == 1]
    done = threading.Event()

    def task():
        try:
            runner.warm(shapes)
        finally:
            done.set()

    state.engine.at_boundary(task)  # the runner belongs to the engine thread
    done.wait()
    state.prewarm = "done"
    log.info("prewarm: %d step buckets ready", len(shapes))


def preload_adapters(state: ServerState) -> bool:
    """Loads `adapters.load` entries ("name" from the store, or "name=path") before serving."""
    for entry in state.settings.adapters.load:
        name, _, path = entry.partition("=")
        try:
            state.adapters.load(name.strip(), path.strip() or None)
        except AdapterError as exc:
            print(f"kiln: error: cannot load adapter {entry!r} (adapters.load): {exc}", file=sys.stderr)
            return False
    return True


def serve(settings: Settings) -> int:
    from kiln.adapters.store import AdapterStore
    from kiln.engine.setup import build_engine

    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_startup(settings.serving_profile, log)
    try:
        engine = build_engine(settings)
    except ModelLoadError as exc:
        print(f"kiln: error: cannot load the model: {exc}", file=sys.stderr)
        return 1
    model_id = engine.model.model_id
    registry = AdapterRegistry(engine, AdapterStore(settings.adapter_store()),
                               settings.serving_profile.policy.adapter_weight_transitions)
    state = ServerState(settings, engine, Metrics(engine, model_id), model_id, registry)
    prewarm(state)
    if not preload_adapters(state):
        engine.shutdown()
        return 1
    config = uvicorn.Config(create_app(state), host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level, timeout_graceful_shutdown=30, access_log=False)
    log.info("serving %s on http://%s:%d", model_id, settings.server.host, settings.server.port)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; a Python handler lets us
    # finish our own shutdown and exit 0 instead of dying by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()  # on SIGTERM: stop accepting, drain in-flight requests, exit
    finally:
        engine.shutdown()
    return 0
