"""Worker scraping: each worker's load from its `/metrics`, and what it serves from its `/v1/models`.

Per worker, one asyncio task GETs `metrics_url` every `metrics_poll_ms` and reads three vLLM
gauges, keeping only samples whose `model_name` label is the worker's `model_name` (for a
discovered worker without one, the first model its `/v1/models` lists):

    vllm:num_requests_running, vllm:num_requests_waiting   summed over matching samples
    vllm:kv_cache_usage_perc                               averaged, clamped to 0..1

and, where the worker exports them, its prefill speed so far (each summed; absent reads as 0):

    vllm:request_prefill_time_seconds (_sum, _count), vllm:prompt_tokens, vllm:prefix_cache_hits

Several matching samples come from one worker running several engines (vLLM's `engine` label);
requests add up, but each engine reports the usage of its own cache, so the fraction is averaged.
vLLM before v1 named the usage gauge `vllm:gpu_cache_usage_perc`; it is read when the other is absent.

A second task GETs `{http_url}/v1/models` every `models_refresh_secs`: the ids served (the base
model and adapters), which of them are not loaded yet (Kiln lists its store's adapters with
`"loaded": false`; the predictor charges a worker the load for them), and the engine type, which
is only displayed, never used for routing.

Liveness (`WorkerHealth.alive`): a worker is dead once `FAILURE_THRESHOLD` consecutive metrics
scrapes failed, or as many consecutive `/v1/models` polls found it unreachable (a transport error,
a timeout, a 5xx or an unreadable answer; a 4xx means the worker is up). One success of the same
kind revives it. While dead by its models poll, the worker's models are polled every
`metrics_poll_ms`, so that its return is noticed quickly. Without `metrics_url` nothing is
scraped: the load stays at zero, the epoch at 0, and the worker is alive unless its models poll
says otherwise.

Nothing a worker sends stops its task: a failure is counted, and logged once when the worker's
state changes (first failure, death, recovery), not on every scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kiln.router.config import RouterConfig, Worker

log = logging.getLogger("kiln.router.scrape")

FAILURE_THRESHOLD = 3  # consecutive failed scrapes (or unreachable models polls) before a worker is dead
MAX_BODY_BYTES = 8 << 20  # a worker's /metrics or /v1/models answer is cut off (and fails) beyond this

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_V0 = "vllm:gpu_cache_usage_perc"
LOAD_METRICS = (RUNNING, WAITING, KV_USAGE)
# the counters a worker's prefill speed is read from, in PrefillCounters' order
PREFILL_METRICS = (
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
)

# owned_by of a /v1/models card -> engine type (display only)
ENGINES = {
    "kiln": "kiln",
    "vllm": "vllm",
    "sglang": "sglang",
    "llamacpp": "llama.cpp",
    "tensorrt_llm": "tensorrt-llm",
    "lmdeploy": "lmdeploy",
}


class ScrapeError(Exception):
    """A worker's answer could not be used (the message says why)."""


# ---- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillCounters:
    """A worker's prefill since it started (cumulative; zero where it exports none of the counters)."""

    seconds: float = 0.0  # time its requests spent prefilling
    prefills: int = 0  # requests that prefilled
    prompt_tokens: int = 0  # their prompt tokens
    cached_tokens: int = 0  # of those, found in its prefix cache

    @staticmethod
    def total(counters: Iterable[PrefillCounters]) -> PrefillCounters:
        """The counters summed (a pick sums every eligible worker's: one object, not one per addition)."""
        seconds = prefills = prompt_tokens = cached_tokens = 0
        for c in counters:
            seconds += c.seconds
            prefills += c.prefills
            prompt_tokens += c.prompt_tokens
            cached_tokens += c.cached_tokens
        return PrefillCounters(float(seconds), prefills, prompt_tokens, cached_tokens)


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """The load figures of one /metrics page, for one model."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    missing: tuple[str, ...] = ()  # load metrics with no sample for the model (read as 0)
    prefill: PrefillCounters = PrefillCounters()


_WANTED = frozenset((*LOAD_METRICS, KV_USAGE_V0, *PREFILL_METRICS))
# one sample line of the text format: name, optional {labels} (quoted values may hold braces), value, timestamp
_SAMPLE_LINE = re.compile(
    r'[ \t]*[a-zA-Z_:][a-zA-Z0-9_:]*(?:[ \t]*\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\}[ \t]*|[ \t]+)'
    r"(?:[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?Inf|NaN)(?:[ \t]+-?\d+)?[ \t]*"
)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _wanted_lines(text: str) -> str:
    """The sample lines of the metrics read, for the parser: a worker's page holds some 400 lines
    (histogram buckets mostly), and parsing them all cost the router about 8 ms a scrape. Every other
    line is only checked for the text format's shape, so a page that is not metrics still fails."""
    kept = []
    for line in text.splitlines():
        if not line or line.startswith("#") or line.isspace():
            continue
        if not _SAMPLE_LINE.fullmatch(line):
            raise ValueError(f"not a sample line: {line[:80]!r}")
        if _NAME.search(line).group() in _WANTED:
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_metrics(text: str, model_name: str) -> MetricsSample:
    """The load of `model_name` in a Prometheus text page; raises ScrapeError if it does not parse.

    Samples without a `model_name` label, or with another model's, are ignored; non-finite values too.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(_wanted_lines(text)):
            for sample in family.samples:
                if sample.name in _WANTED and sample.labels.get("model_name") == model_name:
                    if math.isfinite(sample.value):
                        sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                        counts[sample.name] = counts.get(sample.name, 0) + 1
    except Exception as e:  # the parser raises ValueError and, on some garbage, others
        raise ScrapeError(f"unparseable metrics: {type(e).__name__}: {e}"[:300]) from None
    usage_name = KV_USAGE if KV_USAGE in counts or KV_USAGE_V0 not in counts else KV_USAGE_V0
    usage = sums[usage_name] / counts[usage_name] if usage_name in counts else 0.0
    return MetricsSample(
        running=max(0, round(sums.get(RUNNING, 0.0))),
        waiting=max(0, round(sums.get(WAITING, 0.0))),
        kv_usage=min(1.0, max(0.0, usage)),
        missing=tuple(n for n in LOAD_METRICS if n not in counts and not (n == KV_USAGE and usage_name in counts)),
        prefill=PrefillCounters(
            max(0.0, sums.get(PREFILL_METRICS[0], 0.0)), *(max(0, round(sums.get(n, 0.0))) for n in PREFILL_METRICS[1:])
        ),
    )


def parse_models(body: Any) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(engine type, model ids, the ids of those not loaded) of a /v1/models answer; raises ScrapeError
    if it is not an OpenAI list. A card with `"loaded": false` (Kiln lists the adapters of its store
    that it would load on a first request) is served, but not loaded yet; any other card is loaded."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in data):
        raise ScrapeError("not an OpenAI model list (expected {'data': [{'id': ...}, ...]})")
    return detect_engine(data), tuple(c["id"] for c in data), tuple(c["id"] for c in data if c.get("loaded") is False)


def detect_engine(cards: Iterable[dict[str, Any]]) -> str:
    """The serving engine, by the `owned_by` of its model cards: kiln, vllm, sglang, ... or unknown."""
    for card in cards:
        owner = card.get("owned_by")
        if isinstance(owner, str) and owner.lower() in ENGINES:
            return ENGINES[owner.lower()]
    return "unknown"


# ---- state --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """What the scraper knows of one worker: a snapshot, replaced whole on every change."""

    worker_id_num: int
    worker_id_str: str
    worker_set: str
    model_name: str
    has_metrics: bool  # a metrics_url is configured; without one the load stays at zero
    # load, from the last successful scrape
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    missing: tuple[str, ...] = ()  # load metrics the last scrape had no sample of, for this model
    prefill: PrefillCounters = PrefillCounters()  # of the last scrape
    scrape_started_at: float | None = None  # time.monotonic() when the last successful scrape began
    scraped_at: float | None = None  # time.monotonic() when it ended
    epoch: int = 0  # successful scrapes so far
    failures: int = 0  # consecutive failed scrapes
    scrapes_failed: int = 0  # failed scrapes in all
    last_error: str | None = None  # of the last failed scrape (kept after a recovery)
    # /v1/models
    engine: str = "unknown"  # display only
    models: tuple[str, ...] = ()  # ids served, from the last successful poll
    unloaded: tuple[str, ...] = ()  # of those, adapters the worker loads on their first request
    models_at: float | None = None  # time.monotonic() of that poll
    models_failures: int = 0  # consecutive polls that found the worker unreachable
    models_error: str | None = None  # of the last poll that failed, unreachable or not
    alive: bool = True

    def serves(self, model: str) -> bool:
        return model == self.model_name or model in self.models


@dataclass(eq=False)
class _Tracked:
    worker: Worker
    state: WorkerHealth
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one scrape of each kind at a time
    models_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)


# ---- the scraper --------------------------------------------------------------------------------


class Scraper:
    """Scrapes every worker of the configuration's static worker sets, and any added later.

    `start()` needs a running event loop; `await stop()` ends the tasks and closes the HTTP client.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        client: httpx.AsyncClient | None = None,
        failure_threshold: int = FAILURE_THRESHOLD,
    ) -> None:
        self.poll_s = config.metrics_poll_ms / 1000
        self.models_s = float(config.models_refresh_secs)
        self.failure_threshold = failure_threshold
        # A scrape slower than its poll interval (floored at 1 s) is a failure.
        timeout = httpx.Timeout(max(self.poll_s, 1.0))
        # One connection per worker at a time, kept open between polls.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._owns_client = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout, limits=limits)
        self._timeout = timeout
        self._workers: dict[int, _Tracked] = {}
        self._started = False
        for ws in config.workerset:
            for worker in ws.workers:
                self.add_worker(worker, ws.name)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        for tracked in self._workers.values():
            self._spawn(tracked)

    async def stop(self) -> None:
        self._started = False
        tasks = [t for tracked in self._workers.values() for t in tracked.tasks]
        for tracked in self._workers.values():
            tracked.tasks.clear()
        await _cancel(tasks)
        if self._owns_client:
            await self.client.aclose()

    def add_worker(self, worker: Worker, worker_set: str = "") -> None:
        """Track a worker (discovered at run time, or before `start()`); replaces one with the same id."""
        old = self._workers.pop(worker.worker_id_num, None)
        for task in old.tasks if old is not None else ():
            task.cancel()  # they end at their next await; nothing reads their state any more
        state = WorkerHealth(
            worker_id_num=worker.worker_id_num,
            worker_id_str=worker.worker_id_str,
            worker_set=worker_set,
            model_name=worker.model_name,
            has_metrics=worker.metrics_url is not None,
        )
        tracked = _Tracked(worker, state)
        self._workers[worker.worker_id_num] = tracked
        if self._started:
            self._spawn(tracked)

    async def remove_worker(self, worker_id_num: int) -> None:
        tracked = self._workers.pop(worker_id_num, None)
        if tracked is not None:
            await _cancel(tracked.tasks)

    # ---- reading ------------------------------------------------------------------------------

    def state(self, worker_id_num: int) -> WorkerHealth:
        """The worker's latest snapshot; KeyError for a worker not tracked."""
        return self._workers[worker_id_num].state

    def states(self) -> dict[int, WorkerHealth]:
        return {num: tracked.state for num, tracked in self._workers.items()}

    async def scrape_now(self, worker_id_num: int | None = None, *, models: bool = True) -> None:
        """Scrape one worker (or all) right away and wait for the results; the periodic tasks go on."""
        targets = [self._workers[worker_id_num]] if worker_id_num is not None else list(self._workers.values())
        jobs = [self._scrape_metrics(t) for t in targets]
        if models:
            jobs += [self._poll_models(t) for t in targets]
        await asyncio.gather(*jobs)

    # ---- the loops ----------------------------------------------------------------------------

    def _spawn(self, tracked: _Tracked) -> None:
        if tracked.tasks:
            return
        w = tracked.worker
        if w.metrics_url is not None:
            tracked.tasks.append(asyncio.create_task(self._loop(tracked, self._scrape_metrics, lambda _: self.poll_s)))
        if w.http_url is not None:
            tracked.tasks.append(asyncio.create_task(self._loop(tracked, self._poll_models, self._models_interval)))

    def _models_interval(self, tracked: _Tracked) -> float:
        dead = tracked.state.models_failures >= self.failure_threshold
        return min(self.poll_s, self.models_s) if dead else self.models_s

    async def _loop(
        self,
        tracked: _Tracked,
        once: Callable[[_Tracked], Awaitable[None]],
        interval: Callable[[_Tracked], float],
    ) -> None:
        while True:
            started = time.monotonic()
            try:
                await once(tracked)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug, not a worker's fault: log it and keep polling
                log.exception("worker %s: scrape loop error", tracked.worker.worker_id_str)
            await asyncio.sleep(max(0.0, started + interval(tracked) - time.monotonic()))

    # ---- one metrics scrape -------------------------------------------------------------------

    async def _scrape_metrics(self, tracked: _Tracked) -> None:
        w = tracked.worker
        if w.metrics_url is None:
            return
        async with tracked.lock:
            started = time.monotonic()
            try:
                body = await self._get(w.metrics_url, accept="text/plain;version=0.0.4")
                try:
                    text = body.decode("utf-8")
                except UnicodeDecodeError:
                    raise ScrapeError("not UTF-8 text") from None
                sample = parse_metrics(text, w.model_name or next(iter(tracked.state.models), ""))
            except (ScrapeError, httpx.HTTPError) as e:
                self._metrics_failed(tracked, _describe(e))
                return
            self._metrics_ok(tracked, sample, started)

    def _metrics_ok(self, tracked: _Tracked, sample: MetricsSample, started: float) -> None:
        old = tracked.state
        if old.failures:
            log.info("worker %s: metrics scrape succeeds again after %d failure(s)", old.worker_id_str, old.failures)
        if sample.missing != old.missing and sample.missing:
            log.warning(
                "worker %s: /metrics has no %s sample with model_name=%r; read as 0",
                old.worker_id_str,
                ", ".join(sample.missing),
                old.model_name,
            )
        self._set(
            tracked,
            running=sample.running,
            waiting=sample.waiting,
            kv_usage=sample.kv_usage,
            missing=sample.missing,
            prefill=sample.prefill,
            scrape_started_at=started,
            scraped_at=time.monotonic(),
            epoch=old.epoch + 1,
            failures=0,
        )

    def _metrics_failed(self, tracked: _Tracked, error: str) -> None:
        old = tracked.state
        if old.failures == 0:
            log.warning("worker %s: metrics scrape failed: %s", old.worker_id_str, error)
        self._set(tracked, failures=old.failures + 1, scrapes_failed=old.scrapes_failed + 1, last_error=error)

    # ---- one models poll ----------------------------------------------------------------------

    async def _poll_models(self, tracked: _Tracked) -> None:
        w = tracked.worker
        if w.http_url is None:
            return
        async with tracked.models_lock:
            url = w.http_url.rstrip("/") + "/v1/models"
            try:
                body = await self._get(url, accept="application/json")
                try:
                    engine, models, unloaded = parse_models(json.loads(body))
                except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                    raise ScrapeError("not JSON") from None
            except httpx.HTTPStatusError as e:
                if e.response.status_code < 500:  # the worker answered: it is up
                    self._models_answered_error(tracked, _describe(e))
                    return
                self._models_failed(tracked, _describe(e))
                return
            except (ScrapeError, httpx.HTTPError) as e:
                self._models_failed(tracked, _describe(e))
                return
            self._models_ok(tracked, engine, models, unloaded)

    def _models_ok(self, tracked: _Tracked, engine: str, models: tuple[str, ...], unloaded: tuple[str, ...] = ()
                   ) -> None:
        old = tracked.state
        if old.models_failures:
            log.info("worker %s: /v1/models answers again", old.worker_id_str)
        if (engine, models) != (old.engine, old.models):
            log.info("worker %s: engine %s, serving %s", old.worker_id_str, engine, ", ".join(models) or "nothing")
            if old.model_name not in models:
                log.warning("worker %s: its /v1/models does not list model_name %r", old.worker_id_str, old.model_name)
        self._set(tracked, engine=engine, models=models, unloaded=unloaded, models_at=time.monotonic(),
                  models_failures=0)

    def _models_answered_error(self, tracked: _Tracked, error: str) -> None:
        old = tracked.state
        if old.models_error != error:
            log.warning("worker %s: /v1/models: %s", old.worker_id_str, error)
        self._set(tracked, models_failures=0, models_error=error)

    def _models_failed(self, tracked: _Tracked, error: str) -> None:
        old = tracked.state
        if old.models_failures == 0:
            log.warning("worker %s: /v1/models poll failed: %s", old.worker_id_str, error)
        self._set(tracked, models_failures=old.models_failures + 1, models_error=error)

    # ---- helpers ------------------------------------------------------------------------------

    def _set(self, tracked: _Tracked, **changes: Any) -> None:
        state = dataclasses.replace(tracked.state, **changes)
        alive = state.failures < self.failure_threshold and state.models_failures < self.failure_threshold
        if alive != state.alive:
            if alive:
                log.warning("worker %s: alive again", state.worker_id_str)
            else:
                why = "scrapes failed" if state.failures >= self.failure_threshold else "models polls failed"
                error = state.last_error if state.failures >= self.failure_threshold else state.models_error
                log.warning(
                    "worker %s: dead after %d consecutive %s (last: %s)",
                    state.worker_id_str,
                    self.failure_threshold,
                    why,
                    error,
                )
            state = dataclasses.replace(state, alive=alive)
        tracked.state = state

    async def _get(self, url: str, accept: str) -> bytes:
        """The body of a 2xx answer, at most MAX_BODY_BYTES; raises httpx.HTTPError or ScrapeError."""
        async with self.client.stream("GET", url, headers={"accept": accept}, timeout=self._timeout) as response:
            response.raise_for_status()
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if accept.startswith("text/") and kind and not kind.startswith("text/"):
                raise ScrapeError(f"content-type {kind} is not text")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ScrapeError(f"answer larger than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)


def _describe(error: Exception) -> str:
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}"
    if isinstance(error, httpx.TimeoutException):
        return f"timed out ({type(error).__name__})"
    if isinstance(error, httpx.HTTPError):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return str(error)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
