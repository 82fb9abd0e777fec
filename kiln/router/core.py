"""The router's core: for one request, the worker it should go to.

`RouterCore` owns the moving parts and joins them for each pick:

* the worker sets and their workers, from the configuration;
* per worker set, KV-event ingest and its prefix index (`KVIngest`), a `PrefixHeat` and a
  `PrefixFootprint` (which ties between workers read);
* the `Scraper` (each worker's load, liveness and served models) and `Tokenization`;
* the bookkeeping of picks: requests in flight per worker, and observations awaiting Feedback.

A pick (`pick`) resolves the worker sets serving the model (a worker's `model_name`, or a model its
`/v1/models` lists), takes the first of them, in configuration order, with an eligible worker
(alive by its scrapes and not evicted by ingest), tokenizes the prompt unless token ids came with
it, matches it against the set's prefix index, predicts each eligible worker's latency and picks.
If the prompt cannot be tokenized because no renderer answers, the pick is made on load alone
(no prefix credit) and counted, rather than refused: the prefix is an optimisation.

With [policy] enabled, a request naming an InferencePool (`inference_pool`) is confined to the
pool's workers (`pools`, kept by resources.PoolWatcher): an unknown pool is not_found. Without
[policy], the name is ignored.

In mock mode there is no ingest, scraping or tokenization: the worker is a stable hash of the
model and the prompt over the workers of the first worker set whose `model_name` is the model. The
mode is an object chosen once, at construction (`_Live` or `_Mock`): it says what the core follows
and how it picks.

Workers and worker sets can come and go while the router runs (`add_worker`, `remove_worker`,
`add_worker_set`, `remove_worker_set`), as Kubernetes discovery finds them (discovery.py): a
worker added is subscribed to and scraped at once; one removed is never picked again, and its
prefix index entries and requests in flight are dropped. A discovered worker's `worker_id_num` is
`derive_worker_id_num` of its identity: stable across restarts and replicas, and never one in use.
A worker whose `model_name` is empty serves the first model its `/v1/models` lists (and any other
listed there).

Everything runs on one asyncio loop; only the prefix index is shared with ingest threads (it has
its own lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.router.bookkeeping import InFlight, Observation, Observations
from kiln.router.calibration import Calibration, scraped_prefill_scale
from kiln.router.config import Profile, RouterConfig, Worker, WorkerSet
from kiln.router.ingest import KVIngest, ingest_for
from kiln.router.kv_index import KVIndex
from kiln.router.picker import PrefixFootprint, PrefixHeat, pick, prefix_key
from kiln.router.predictor import WorkerLoad, predict_all
from kiln.router.rollout import Rollouts
from kiln.router.scrape import PrefillCounters, Scraper, WorkerHealth
from kiln.router.tokenization import Tokenization, TokenizationError
from kiln.router.types import PickError, PickInput, PickResult, Pool, Pools, WorkerMeta

if TYPE_CHECKING:
    from kiln.router.bodies import BodyBudget
    from kiln.router.leader import LeaderElector
    from kiln.router.metrics import RouterMetrics

log = logging.getLogger("kiln.router")

SWEEP_EVERY_S = 5.0  # how often expired observations and in-flight entries are dropped
TOKENIZE_LOG_EVERY_S = 30.0  # at most one "routed on load alone" warning per worker set this often
TOPOLOGY = ("pod_name", "namespace", "node_name", "node_ip", "pod_ip", "availability_zone", "instance_type")


@dataclass(slots=True)
class _Tally:
    """Per worker, for the dashboard."""

    picks: int = 0
    predicted_ms: float | None = None  # the last prediction made for the worker, picked or not
    ttft_ms: float | None = None  # the last time to first token Feedback reported
    e2e_ms: float | None = None  # the last end-to-end latency Feedback reported


@dataclass(eq=False)
class _Set:
    ws: WorkerSet
    profile: Profile
    index: KVIndex
    ingest: KVIngest | None
    heat: PrefixHeat = field(default_factory=PrefixHeat)
    footprint: PrefixFootprint = field(default_factory=PrefixFootprint)
    calibration: Calibration = field(default_factory=Calibration)
    tokenize_warned_at: float = -TOKENIZE_LOG_EVERY_S
    workers: dict[int, Worker] = field(default_factory=dict)  # by worker_id_num, in the order added


def derive_worker_id_num(identity: str, taken: Collection[int] = ()) -> int:
    """A stable worker_id_num for a discovered worker (e.g. `namespace/pod`): a hash of its identity in
    2**40 .. 2**41 - 1, above any id a workers file is likely to use, stepping past ids in `taken`."""
    num = (1 << 40) + int.from_bytes(hashlib.sha256(identity.encode()).digest()[:5], "big")
    while num in taken:
        num = (1 << 40) + (num + 1) % (1 << 40)
    return num


class RouterCore:
    """Picks workers; see the module docstring. `start()` and `stop()` run on the serving loop."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        metrics: RouterMetrics,
        bodies: BodyBudget | None = None,
        ingests: dict[str, KVIngest] | None = None,
        scraper: Scraper | None = None,
        tokenization: Tokenization | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.mode = _mode(config)
        self.metrics = metrics
        self.bodies = bodies
        self.ingests = ingests or {}
        self.scraper = scraper
        self.tokenization = tokenization
        self.rng = random.Random(seed)
        self.inflight = InFlight()
        self.observations = Observations(config.observation_ttl_secs)
        self.sets: dict[str, _Set] = {}
        self.workers: dict[int, tuple[Worker, _Set]] = {}
        self.tally: dict[int, _Tally] = {}
        self.meta: dict[int, WorkerMeta] = {}  # discovered workers only
        # With [policy]: the InferencePools (resources.PoolWatcher sets it); None until they are listed.
        self.pools: Pools | None = None
        for ws in config.workerset:
            ingest = self.ingests.get(ws.name)
            index = ingest.index if ingest is not None else KVIndex(ws.kv_block_size)
            entry = _Set(ws, config.profile_named(ws.profile), index, ingest)
            self.sets[ws.name] = entry
            for worker in ws.workers:
                self.workers[worker.worker_id_num] = (worker, entry)
                entry.workers[worker.worker_id_num] = worker
                self.tally[worker.worker_id_num] = _Tally()
        self._sweeper: asyncio.Task | None = None
        self._started = False
        self.leader_election: LeaderElector | None = None  # set by serve() with [leader_election]
        # Why the router is not ready yet, by who says so (e.g. a discovery that has not listed yet).
        self.not_ready: dict[str, str] = {}
        self.rollouts = Rollouts(self, config.rollout)

    @classmethod
    def from_config(cls, config: RouterConfig, metrics: RouterMetrics, bodies: BodyBudget | None = None) -> RouterCore:
        """The core with its ingest, scraper and tokenization (none of them in mock mode)."""
        return cls(config, metrics=metrics, bodies=bodies, **_mode(config).follows(config))

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register tokenizers (which may fail on the configuration), then start ingest and scraping."""
        if self.tokenization is not None:
            await self.tokenization.start()
        for ingest in self.ingests.values():
            ingest.start()
        if self.scraper is not None:
            self.scraper.start()
        self._sweeper = asyncio.create_task(self._sweep())
        await self.rollouts.start()
        self._started = True

    async def stop(self) -> None:
        self._started = False
        await self.rollouts.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.scraper is not None:
            await self.scraper.stop()
        if self.tokenization is not None:
            await self.tokenization.aclose()
        await asyncio.gather(*(asyncio.to_thread(ingest.stop) for ingest in self.ingests.values()))

    async def _sweep(self) -> None:
        ttl = self.config.observation_ttl_secs
        while True:
            await asyncio.sleep(min(SWEEP_EVERY_S, max(ttl, 0.1)))
            now = time.monotonic()
            self.observations.expire(now)
            self.inflight.expire(now - ttl)

    # ---- membership -----------------------------------------------------------------------------

    async def add_worker_set(self, ws: WorkerSet, profile: Profile | None = None) -> None:
        """A worker set found at run time (an InferenceWorkerSet), with its workers; replaces one of the
        same name. Raises KeyError for an unknown profile, TokenizeConfigError when its profile's
        tokenization cannot work (as at startup)."""
        profile = profile if profile is not None else self.config.profile_named(ws.profile)
        for worker in ws.workers:
            if (held := self.workers.get(worker.worker_id_num)) is not None and held[1].ws.name != ws.name:
                raise ValueError(f"worker_id_num {worker.worker_id_num} is taken by worker {held[0].worker_id_str}")
        if ws.name in self.sets:
            await self.remove_worker_set(ws.name)
        ingest = self.mode.ingest(ws.model_copy(update={"workers": ()}), self.config)
        if ingest is not None:
            if self._started:
                ingest.start()
            self.ingests[ws.name] = ingest
        index = ingest.index if ingest is not None else KVIndex(ws.kv_block_size)
        entry = _Set(ws.model_copy(update={"workers": ()}), profile, index, ingest)
        if self.tokenization is not None:
            try:
                await self.tokenization.register_worker_set(entry.ws)
            except Exception:
                if ingest is not None:
                    await asyncio.to_thread(ingest.stop)
                    del self.ingests[ws.name]
                raise
        self.sets[ws.name] = entry
        for worker in ws.workers:
            await self.add_worker(ws.name, worker)

    async def remove_worker_set(self, name: str) -> None:
        """Forget a worker set: its workers (as `remove_worker`), its ingest and its prefix index."""
        entry = self.sets.get(name)
        if entry is None:
            return
        for num in list(entry.workers):
            await self.remove_worker(num)
        del self.sets[name]
        if entry.ingest is not None:
            self.ingests.pop(name, None)
            await asyncio.to_thread(entry.ingest.stop)
        if self.tokenization is not None:
            self.tokenization.unregister_worker_set(name)

    async def add_worker(self, workerset: str, worker: Worker, meta: WorkerMeta | None = None) -> None:
        """A worker joins a worker set: its KV events are subscribed to and it is scraped from now on.
        A worker of the same set with the same worker_id_num is replaced; raises ValueError when another
        set's worker has that worker_id_num, KeyError for an unknown set."""
        entry = self.sets[workerset]
        num = worker.worker_id_num
        if num in self.workers:
            if self.workers[num][1] is not entry:
                other = self.workers[num][0]
                raise ValueError(f"worker_id_num {num} is taken by worker {other.worker_id_str} of another set")
            await self.remove_worker(num)
        if entry.ingest is not None:
            if not worker.zmq_endpoint:
                raise ValueError(f"worker {worker.worker_id_str} has no zmq_endpoint")
            await asyncio.to_thread(entry.ingest.add_worker, worker)
        else:
            entry.index.add_worker(num)
        entry.workers[num] = worker
        self.workers[num] = (worker, entry)
        self.tally[num] = _Tally()
        if meta is not None:
            self.meta[num] = meta
        if self.scraper is not None:
            self.scraper.add_worker(worker, workerset)
        if self.tokenization is not None:
            await self.tokenization.add_worker(workerset, worker)
        log.info(
            "worker set %s: worker %s added (%s)", workerset, worker.worker_id_str, worker.endpoint or "no endpoint"
        )

    async def remove_worker(self, worker_id_num: int) -> bool:
        """A worker leaves: no more picks, no more ingest or scraping, and its index entries and requests
        in flight are dropped. False when no such worker is known."""
        found = self.workers.pop(worker_id_num, None)
        if found is None:
            return False
        worker, entry = found
        entry.workers.pop(worker_id_num, None)
        self.tally.pop(worker_id_num, None)
        self.meta.pop(worker_id_num, None)
        self.inflight.drop_worker(worker_id_num)
        entry.footprint.forget(worker_id_num)
        if self.tokenization is not None:
            self.tokenization.remove_worker(entry.ws.name, worker_id_num)
        if self.scraper is not None:
            await self.scraper.remove_worker(worker_id_num)
        if entry.ingest is not None:
            await asyncio.to_thread(entry.ingest.remove_worker, worker_id_num)
        else:
            entry.index.remove_worker(worker_id_num)
        log.info("worker set %s: worker %s removed", entry.ws.name, worker.worker_id_str)
        return True

    def worker_id_num_for(self, identity: str) -> int:
        """`derive_worker_id_num(identity)`, stepping past the ids of workers already known."""
        return derive_worker_id_num(identity, self.workers)

    # ---- picking --------------------------------------------------------------------------------

    async def pick(self, request: PickInput) -> PickResult:
        """The worker for one request; raises PickError."""
        started = time.perf_counter()
        if not request.model:
            raise PickError("invalid", "model is required")
        if not request.token_ids and not _has_prompt(request.body):
            raise PickError("invalid", "a prompt is required: token_ids, prompt or messages")
        pool = self._pool(request.inference_pool)
        result = await self.mode.pick(self, request, pool)
        self.metrics.pick_seconds.observe(time.perf_counter() - started)
        return result

    def _pool(self, name: str) -> Pool | None:
        """The InferencePool a request names, with [policy] enabled; None without one (or without [policy]:
        then a pool's name is ignored and the pick is made on load alone)."""
        if not name or not self.config.policy.enabled:
            return None
        if self.pools is None:
            raise PickError("unavailable", f"inference_pool {name!r}: the InferencePools are not listed yet")
        try:
            return self.pools.lookup(name)
        except KeyError as e:
            raise PickError("not_found", e.args[0]) from None
        except ValueError as e:
            raise PickError("invalid", str(e)) from None

    def _in_pool(self, pool: Pool | None, worker: Worker, entry: _Set) -> bool:
        return pool is None or pool.admits(entry.ws.name, self.meta.get(worker.worker_id_num))

    def _endpoint(self, worker: Worker, pool: Pool | None) -> str:
        """Where the caller sends the request: the worker's endpoint, or the pool's target port on it."""
        meta = self.meta.get(worker.worker_id_num)
        if pool is not None and meta is not None and worker.pod_ip and pool.target_port in meta.ports:
            host = f"[{worker.pod_ip}]" if ":" in worker.pod_ip else worker.pod_ip
            return f"{host}:{meta.ports[pool.target_port]}"
        return worker.endpoint or ""

    def _serves(self, worker: Worker, model: str) -> bool:
        if worker.model_name == model:
            return True
        health = self._health(worker.worker_id_num)
        return health is not None and model in health.models

    def _offers(self, worker: Worker, model: str) -> bool:
        """Serves the model, by what it lists or, during its rollout, by what the rollout loaded there."""
        return self._serves(worker, model) or self.rollouts.serves(model, worker.worker_id_num)

    def _base_model(self, worker: Worker) -> str:
        """The worker's `model_name`; unset, the first model its /v1/models lists."""
        if worker.model_name:
            return worker.model_name
        health = self._health(worker.worker_id_num)
        return health.models[0] if health is not None and health.models else ""

    def _health(self, worker_id_num: int) -> WorkerHealth | None:
        if self.scraper is None:
            return None
        try:
            return self.scraper.state(worker_id_num)
        except KeyError:
            return None

    def _ineligible(self, worker: Worker, entry: _Set) -> str | None:
        """Why the worker cannot be picked (dead, evicted), or None."""
        health = self._health(worker.worker_id_num)
        if health is not None and not health.alive:
            return "dead"
        if entry.ingest is not None and entry.ingest.is_evicted(worker.worker_id_num):
            return "evicted"
        return None

    # ---- what rollouts read (rollout.Fleet) -------------------------------------------------------

    def fleet(self) -> list[Worker]:
        return [w for e in self.sets.values() for w in sorted(e.workers.values(), key=lambda w: w.worker_id_num)
                if self._ineligible(w, e) is None]

    def why_ineligible(self, worker_id_num: int) -> str | None:
        found = self.workers.get(worker_id_num)
        return self._ineligible(*found) if found is not None else "gone"

    def base_model_of(self, worker: Worker) -> str:
        return self._base_model(worker)

    def lists(self, worker: Worker, model: str) -> bool:
        return self._serves(worker, model)

    async def _pick(self, request: PickInput, pool: Pool | None = None) -> PickResult:
        model = request.model
        serving = [
            (e, [w for w in e.workers.values() if self._offers(w, model) and self._in_pool(pool, w, e)])
            for e in self.sets.values()
        ]
        serving = [(e, ws) for e, ws in serving if ws]
        if not serving:
            raise PickError("not_found", f"no worker{_of(pool)} serves model {model!r}")
        for entry, workers in serving:
            # (during a rollout of the model: only the workers that serve a version of it now)
            eligible = self.rollouts.eligible(model, [w for w in workers if self._ineligible(w, entry) is None])
            if eligible:
                break
        else:
            why = ", ".join(f"{w.worker_id_str} {self._ineligible(w, e)}" for e, ws in serving for w in ws)
            sets = ", ".join(e.ws.name for e, _ in serving)
            raise PickError("unavailable", f"no eligible worker for model {model!r} in worker set(s) {sets}: {why}")

        token_ids = list(request.token_ids) if request.token_ids else await self._tokenize(entry, model, request.body)
        eligible = [w for w in eligible if w.worker_id_num in entry.workers]  # (one may have left meanwhile)
        if not eligible:
            raise PickError(
                "unavailable", f"no eligible worker for model {model!r}: they left worker set {entry.ws.name}"
            )
        # a model no worker has as its base is an adapter: its blocks are keyed by its name
        lora = None if any(self._base_model(w) == model for w in entry.workers.values()) else model
        keys = entry.index.prompt_keys(token_ids, lora) if token_ids else []
        matched = entry.index.match(token_ids, lora) if keys else {}
        picker, tracking = entry.profile.picker, entry.profile.picker.inflight_tracking

        loads = []
        prefills = []  # the eligible workers' counters
        for w in eligible:
            num = w.worker_id_num
            health = self._health(num)
            if health is not None:
                self.inflight.settle(num, health.scrape_started_at)
                prefills.append(health.prefill)
            cached = matched.get(num, 0)
            running, waiting = self._scraped_load(num, health)
            loads.append(
                WorkerLoad(
                    worker_id=num,
                    running=running,
                    waiting=waiting,
                    kv_usage=health.kv_usage if health else 0.0,
                    cached_blocks=cached,
                    inflight_blocks=self.inflight.leading_blocks(num, keys, cached) if tracking else 0,
                    inflight=self.inflight.count(num),
                    adapter_load=lora is not None and health is not None and lora in health.unloaded,
                    recent_blocks=entry.footprint.blocks(num),
                )
            )
        predictor = entry.profile.predictor
        entry.calibration.scraped(scraped_prefill_scale(predictor, entry.ws.kv_block_size,
                                                             PrefillCounters.total(prefills)))
        predictions = predict_all(predictor, loads, len(keys), tracking, entry.calibration.factors)
        key = prefix_key(keys)
        share = entry.heat.observe(key)
        choice = pick(predictions, picker, self.rng, prefix_share_pct=share)
        entry.footprint.observe(choice.worker_id, key, len(keys))
        for p in predictions:
            self.tally[p.worker_id].predicted_ms = p.total_ms
        log.debug("model %s, %d blocks: %s", model, len(keys), choice.describe())

        worker, _ = self.workers[choice.worker_id]
        prediction = choice.prediction
        result = self._record(
            request,
            worker,
            entry,
            prediction.total_ms,
            prediction.load.cached_blocks,
            len(keys),
            choice.reason,
            self._endpoint(worker, pool),
            prediction.features(),
        )
        self.inflight.add(result.request_id, result.worker_id_num, keys, time.monotonic())
        self.rollouts.picked(result.request_id, model, result.worker_id_num)
        return result

    def _scraped_load(self, num: int, health) -> tuple[int, int]:
        """(running, waiting) of the worker's last scrape, less the requests it counted that have
        ended since (their Feedback came after the scrape began): running ones first."""
        if health is None:
            return 0, 0
        ended = self.inflight.finished(num)
        running = max(0, health.running - ended)
        return running, max(0, health.waiting - (ended - (health.running - running)))

    async def _tokenize(self, entry: _Set, model: str, body: dict[str, Any] | None) -> list[int]:
        assert self.tokenization is not None and body is not None
        try:
            return await self.tokenization.prompt_token_ids(entry.ws.name, model, body)
        except TokenizationError as e:
            if e.kind != "unavailable":
                raise PickError(e.kind, str(e)) from None
            self.metrics.tokenize_failures.labels(entry.ws.name).inc()
            now = time.monotonic()
            if now - entry.tokenize_warned_at >= TOKENIZE_LOG_EVERY_S:
                entry.tokenize_warned_at = now
                log.warning("worker set %s: cannot tokenize (%s); routing on load alone", entry.ws.name, e)
            return []

    def _record(
        self,
        request: PickInput,
        worker: Worker,
        entry: _Set,
        predicted_ms: float,
        cached_blocks: float,
        prompt_blocks: int,
        reason: str,
        endpoint: str,
        features: tuple[float, float, float, float] | None = None,
    ) -> PickResult:
        """Count the pick and keep its observation for Feedback."""
        request_id = request.request_id or uuid.uuid4().hex
        now = time.monotonic()
        num = worker.worker_id_num
        self.observations.add(
            Observation(
                request_id, num, worker.worker_id_str, entry.ws.name, predicted_ms, now, request.tenant, features
            )
        )
        self.tally[num].picks += 1
        labels = self.metrics.tenant_labels(request.tenant)
        self.metrics.picks.labels(workerset=entry.ws.name, worker=worker.worker_id_str, reason=reason, **labels).inc()
        per_worker = {"workerset": entry.ws.name, "worker": worker.worker_id_str, **labels}
        self.metrics.pick_cached_blocks.labels(**per_worker).inc(cached_blocks)
        self.metrics.pick_prompt_blocks.labels(**per_worker).inc(prompt_blocks)
        return PickResult(
            request_id=request_id,
            worker_id=worker.worker_id_str,
            worker_id_num=num,
            endpoint=endpoint,
            workerset=entry.ws.name,
            predicted_ms=predicted_ms,
            cached_blocks=int(cached_blocks),
            prompt_blocks=prompt_blocks,
            reason=reason,
        )

    # ---- feedback -------------------------------------------------------------------------------

    def feedback(self, request_id: str, ttft_ms: float = 0.0, e2e_ms: float = 0.0, failed: bool = False) -> bool:
        """How a picked request went; False when no pick with that id is held (never made, or expired)."""
        self.inflight.end(request_id, time.monotonic())
        self.rollouts.feedback(request_id, failed)
        observation = self.observations.pop(request_id)
        if observation is None:
            self.metrics.feedback.labels("unknown").inc()
            return False
        metrics = self.metrics
        metrics.feedback.labels("failed" if failed else "ok").inc()
        if failed:
            return True
        labels = {
            "workerset": observation.workerset,
            "worker": observation.worker_id_str,
            **metrics.tenant_labels(observation.tenant),
        }
        tally = self.tally.get(observation.worker_id_num)  # (None: the worker left)
        if ttft_ms > 0:
            error = ttft_ms - observation.predicted_ms
            metrics.prediction_error.labels(observation.workerset).observe(error)
            metrics.prediction_abs_error.labels(observation.workerset).observe(abs(error))
            metrics.ttft.labels(**labels).observe(ttft_ms)
            if tally is not None:
                tally.ttft_ms = ttft_ms
            entry = self.sets.get(observation.workerset)
            if entry is not None and observation.features is not None:
                entry.calibration.observe(ttft_ms, *observation.features)
        if e2e_ms > 0:
            metrics.e2e.labels(**labels).observe(e2e_ms)
            if tally is not None:
                tally.e2e_ms = e2e_ms
        return True

    # ---- reading --------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, list[str]]:
        """Ready once every static worker set with ingest (none in mock mode) has a reachable worker, and
        Kubernetes discovery and the custom resources' watchers have listed once (`not_ready`). A worker is
        reachable when it is not evicted, its /v1/models answered (with a scraper) and its KV-event socket
        (and replay socket, where it has one) connected. Warm caches are not asked for: an idle fleet sends
        no KV events until it serves, and it serves nothing until its router is ready."""
        reasons = list(self.not_ready.values())
        for entry in self.sets.values():
            if entry.ws.discovery.mode != "static" or entry.ingest is None:
                continue
            why = {w.worker_id_str: self._unreachable(w, entry) for w in entry.workers.values()}
            if not why:
                reasons.append(f"worker set {entry.ws.name}: no workers")
            elif all(why.values()):
                listed = "; ".join(f"{name} {reason}" for name, reason in why.items())
                reasons.append(f"worker set {entry.ws.name}: no worker is reachable yet ({listed})")
        return not reasons, reasons

    def _unreachable(self, worker: Worker, entry: _Set) -> str | None:
        """Why readiness cannot count on the worker yet, or None."""
        try:
            stats = entry.ingest.stats(worker.worker_id_num)
        except KeyError:
            return "is not followed yet"
        if stats.evicted is not None:
            return "is evicted"
        health = self._health(worker.worker_id_num)
        if health is not None and worker.http_url and (health.models_at is None or not health.alive):
            return "has not answered /v1/models" if health.models_at is None else "is dead"
        if not stats.connected:
            return "has no KV-event connection"
        if worker.replay_endpoint and not stats.replay_connected:
            return "has no replay connection"
        return None

    def worker_view(self, worker: Worker, entry: _Set) -> dict[str, Any]:
        """One worker as the dashboard and /metrics see it."""
        num = worker.worker_id_num
        health = self._health(num)
        if health is not None:
            self.inflight.settle(num, health.scrape_started_at)
        ingest = entry.ingest.stats(num) if entry.ingest is not None else None
        tally = self.tally[num]
        return {
            "worker": worker.worker_id_str,
            "worker_id_num": num,
            "workerset": entry.ws.name,
            "model": worker.model_name,
            "endpoint": worker.endpoint,
            "alive": health.alive if health is not None else True,
            "evicted": ingest is not None and ingest.evicted is not None,
            "evicted_reason": ingest.evicted if ingest is not None else None,
            "running": health.running if health else 0,
            "waiting": health.waiting if health else 0,
            "kv_usage": health.kv_usage if health else 0.0,
            "scrape_epoch": health.epoch if health else 0,
            "engine": health.engine if health else "unknown",
            "models": list(health.models) if health else [],
            "adapters_unloaded": list(health.unloaded) if health else [],  # listed, loaded on a first request
            "inflight": self.inflight.count(num),
            "ended_since_scrape": self.inflight.finished(num),
            "index_blocks": entry.index.blocks_of(num),
            "recent_prefix_blocks": entry.footprint.blocks(num),  # (the tie-break's cache footprint)
            "picks": tally.picks,
            "predicted_ms": tally.predicted_ms,
            "ttft_ms": tally.ttft_ms,
            "e2e_ms": tally.e2e_ms,
            "labels": {k: v for k in TOPOLOGY if (v := getattr(worker, k)) is not None},
            "ingest": vars(ingest) if ingest is not None else None,
        }

    def snapshot(self) -> dict[str, Any]:
        """What /metrics reads at scrape time (metrics._StateCollector)."""
        tokenization = self.tokenization
        return {
            "workers": [self.worker_view(w, e) for w, e in self.workers.values()],
            "worker_sets": [
                {"name": name, "index_blocks": e.index.size(), "calibration": e.calibration.view()}
                for name, e in self.sets.items()
            ],
            "tokenize": {
                "mismatches": dict(tokenization.mismatches) if tokenization else {},
                "local_failures": dict(tokenization.local_failures) if tokenization else {},
            },
            "bodies": {"bytes": self.bodies.bytes, "count": self.bodies.count}
            if self.bodies
            else {"bytes": 0, "count": 0},
            "observations": len(self.observations),
            "leader": self.is_leader(),
        }

    def is_leader(self) -> bool | None:
        """Whether this replica holds the leader Lease; None without [leader_election]."""
        return self.leader_election.is_leader if self.leader_election is not None else None

    def state(self) -> dict[str, Any]:
        """The dashboard's JSON: the first `dashboard_max_workers` workers and the totals."""
        limit = self.config.dashboard_max_workers
        shown = list(self.workers.values())[:limit]
        ready, reasons = self.ready()
        workers = []
        for worker, entry in shown:
            view = self.worker_view(worker, entry)
            del view["ingest"]
            workers.append(view)
        return {
            "mode": self.mode.name,
            "ready": ready,
            "not_ready": reasons,
            "worker_sets": [
                {
                    "name": name,
                    "profile": e.profile.name,
                    "kv_block_size": e.ws.kv_block_size,
                    "workers": len(e.workers),
                    "index_blocks": e.index.size(),
                    "calibration": e.calibration.view(),
                }
                for name, e in self.sets.items()
            ],
            "workers": workers,
            "workers_total": len(self.workers),
            "picks_total": sum(t.picks for t in self.tally.values()),
            "inflight": len(self.inflight),
            "observations": len(self.observations),
            "leader": self.is_leader(),
            "rollouts": self.rollouts.describe(),
        }


class _Live:
    """The core follows its workers (KV-event ingest, scraping, tokenization) and picks on what they say."""

    name = "live"

    def follows(self, config: RouterConfig) -> dict[str, Any]:
        """`RouterCore.from_config`'s ingests, scraper and tokenization."""
        scraper = Scraper(config)
        return {"ingests": ingest_for(config), "scraper": scraper, "tokenization": Tokenization(config, scraper)}

    def ingest(self, ws: WorkerSet, config: RouterConfig) -> KVIngest | None:
        """The ingest of a worker set added at run time."""
        return KVIngest(ws, replay_timeout_ms=config.replay_timeout_ms)

    async def pick(self, core: RouterCore, request: PickInput, pool: Pool | None) -> PickResult:
        return await core._pick(request, pool)


class _Mock:
    """mock_mode: the core follows nothing; a pick is a stable hash of model and prompt over the workers of
    the first worker set whose `model_name` is the model (no prefix, load or in-flight bookkeeping)."""

    name = "mock"

    def follows(self, config: RouterConfig) -> dict[str, Any]:
        return {}

    def ingest(self, ws: WorkerSet, config: RouterConfig) -> KVIngest | None:
        return None

    async def pick(self, core: RouterCore, request: PickInput, pool: Pool | None) -> PickResult:
        model = request.model
        for entry in core.sets.values():
            workers = [w for w in entry.workers.values() if w.model_name == model and core._in_pool(pool, w, entry)]
            if workers:
                break
        else:
            raise PickError("not_found", f"no worker{_of(pool)} serves model {model!r}")
        if request.token_ids:
            prompt: Any = {"token_ids": list(request.token_ids)}
        else:
            body = request.body or {}
            prompt = {"messages": body["messages"]} if body.get("messages") is not None else {"prompt": body["prompt"]}
        key = json.dumps([model, prompt], sort_keys=True, separators=(",", ":"), default=str).encode()
        worker = workers[int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % len(workers)]
        blocks = len(request.token_ids or ()) // entry.ws.kv_block_size
        endpoint = core._endpoint(worker, pool)
        return core._record(request, worker, entry, entry.profile.predictor.base_ms, 0, blocks, "mock", endpoint)


def _mode(config: RouterConfig) -> _Live | _Mock:
    return _Mock() if config.mock_mode else _Live()


def _of(pool: Pool | None) -> str:
    return f" of InferencePool {pool.key}" if pool is not None else " set"


def _has_prompt(body: dict[str, Any] | None) -> bool:
    return body is not None and (body.get("messages") is not None or body.get("prompt") is not None)
