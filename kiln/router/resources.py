"""The router's custom resources (group kinference.buoyant.io, v1alpha1; server/k8s/crds.yaml).

* `WorkerSetWatcher` ([kubernetes] enabled): each InferenceWorkerSet in `[kubernetes] namespace`
  (all when unset) whose labels match `[kubernetes] selector` becomes a worker set named after the
  resource, whose workers are found from the EndpointSlices of its `serviceName` (discovery.py),
  with `defaultPorts` over `[kubernetes.discovery_defaults]`. A resource that names an unknown
  `[[profile]]`, or that is malformed, is skipped. A changed spec replaces the set; a deleted
  resource removes it.
* `PoolWatcher` ([policy] enabled): the InferencePools in `[policy] namespace` (all when unset),
  which `RouterCore.pick` looks up by `PickRequest.inference_pool` (`name`, or `namespace/name`
  when the name is in several namespaces). A pool admits the workers of its `workerSets`, narrowed
  to the pods its `selector` matches (pod labels come from discovery, so a static worker never
  matches a selector).
* `StatusWriter`: each resource's `status` (an `Accepted` condition, saying why when False, and
  worker counts), written through the status subresource by the leader only: with
  [leader_election], only while this replica holds the Lease (a lost Lease stops the writes at
  once); without it, always. A new leader writes every status again.

Both watchers list, then watch from the list's resourceVersion, and list again after a 410 or a
broken watch; an apiserver failure is logged and retried, and what was known stays. The router is
not ready until each has listed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType
from pydantic import ValidationError

from kiln.router.config import RouterConfig, WorkerSet
from kiln.router.discovery import RETRY_S, WATCH_TIMEOUT_S, EndpointSliceDiscovery, PortNames
from kiln.router.k8s import describe_error, stop_api_task
from kiln.router.selectors import match_expressions, parse_selector
from kiln.router.types import Pool

if TYPE_CHECKING:
    from kiln.router.core import RouterCore
    from kiln.router.leader import LeaderElector

log = logging.getLogger("kiln.router.resources")

GROUP, VERSION = "kinference.buoyant.io", "v1alpha1"
InferenceWorkerSet = create_namespaced_resource(GROUP, VERSION, "InferenceWorkerSet", "inferenceworkersets")
InferencePool = create_namespaced_resource(GROUP, VERSION, "InferencePool", "inferencepools")
STATUS_EVERY_S = 5.0  # how often the leader refreshes the worker counts in statuses


# ---- status -------------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Status:
    res: type
    namespace: str
    name: str
    generation: int | None
    accepted: bool
    reason: str
    message: str
    counts: Callable[[], dict[str, int]]
    since: str  # lastTransitionTime of the Accepted condition


class StatusWriter:
    """Writes each resource's status while this replica may (see the module docstring)."""

    def __init__(self, client: AsyncClient, elector: LeaderElector | None = None, every_s: float = STATUS_EVERY_S):
        self.client = client
        self.elector = elector
        self.every_s = every_s
        self._wanted: dict[tuple[str, str, str], _Status] = {}
        self._written: dict[tuple[str, str, str], dict[str, Any]] = {}  # this term's last write
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.writes = 0

    @property
    def may_write(self) -> bool:
        return self.elector is None or self.elector.is_leader

    def start(self) -> None:
        if self.elector is not None:
            self.elector.on_change.append(self._leadership)
        if self.may_write:
            self._begin()

    async def stop(self) -> None:
        if self.elector is not None and self._leadership in self.elector.on_change:
            self.elector.on_change.remove(self._leadership)
        await self._end()

    def _leadership(self, leading: bool) -> None:
        if leading:
            self._begin()
        elif self._task is not None:
            self._task.cancel()  # at once: a write under way is abandoned
            self._task = None

    def _begin(self) -> None:
        self._written.clear()  # a new term writes every status again
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="resource-status")

    async def _end(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop_api_task(task)

    def set(
        self,
        res: type,
        namespace: str,
        name: str,
        generation: int | None,
        accepted: bool,
        reason: str,
        message: str,
        counts: Callable[[], dict[str, int]] = dict,
    ) -> None:
        key = (res.__name__, namespace, name)
        old = self._wanted.get(key)
        since = old.since if old is not None and old.accepted == accepted else _now()
        self._wanted[key] = _Status(res, namespace, name, generation, accepted, reason, message, counts, since)
        self._wake.set()

    def forget(self, res: type, namespace: str, name: str) -> None:
        key = (res.__name__, namespace, name)
        self._wanted.pop(key, None)
        self._written.pop(key, None)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            for key, wanted in list(self._wanted.items()):
                status = self._status(wanted)
                if self._written.get(key) == status:
                    continue
                if not self.may_write:
                    return
                try:
                    await self.client.patch(
                        wanted.res.Status,
                        wanted.name,
                        {"status": status},
                        namespace=wanted.namespace,
                        patch_type=PatchType.MERGE,
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a status write is best effort: the next reconcile writes it again
                    if not (isinstance(e, ApiError) and e.status.code == 404):  # (deleted meanwhile)
                        log.warning(
                            "cannot write the status of %s %s/%s: %s",
                            wanted.res.__name__,
                            wanted.namespace,
                            wanted.name,
                            describe_error(e, self.client),
                        )
                    continue
                self._written[key] = status
                self.writes += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.every_s):
                    await self._wake.wait()

    @staticmethod
    def _status(wanted: _Status) -> dict[str, Any]:
        condition = {
            "type": "Accepted",
            "status": "True" if wanted.accepted else "False",
            "reason": wanted.reason,
            "message": wanted.message,
            "lastTransitionTime": wanted.since,
        }
        status: dict[str, Any] = {**wanted.counts(), "conditions": [condition]}
        if wanted.generation is not None:
            condition["observedGeneration"] = status["observedGeneration"] = wanted.generation
        return status


# ---- following a resource -----------------------------------------------------------------------


class _Follower:
    """List, then watch; `_apply` each object, `_drop` those gone (see the module docstring)."""

    res: type
    what: str
    section: str  # the configuration section whose `namespace` it watches

    def __init__(self, client: AsyncClient, core: RouterCore, config: RouterConfig, status: StatusWriter, *,
                 retry_s: float = RETRY_S) -> None:
        self.client = client
        self.core = core
        self.config = config
        self.status = status
        self.namespace = getattr(config, self.section).namespace or "*"
        self.retry_s = retry_s
        self.listed = False
        self.failing: str | None = None
        self.known: dict[tuple[str, str], str] = {}  # (namespace, name) -> the spec as last applied (JSON)
        self._task: asyncio.Task | None = None

    @property
    def where(self) -> str:
        return "all namespaces" if self.namespace == "*" else f"namespace {self.namespace}"

    def start(self) -> None:
        if self._task is None:
            self.core.not_ready[self.what] = f"the {self.what}s of {self.where} are not listed yet"
            self._task = asyncio.create_task(self._run(), name=f"watch-{self.what}")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_api_task(self._task)
            self._task = None
        self.core.not_ready.pop(self.what, None)

    def selected(self, obj: Any) -> bool:
        return True

    async def _run(self) -> None:
        while True:
            try:
                listing = self.client.list(self.res, namespace=self.namespace)
                objs = [o async for o in listing]
                version = listing.resourceVersion
                present = {(o.metadata.namespace or "", o.metadata.name) for o in objs if self.selected(o)}
                for key in [k for k in self.known if k not in present]:
                    await self._drop(key)
                for obj in objs:
                    if self.selected(obj):
                        await self._changed(obj)
                self._listed()
                async for kind, obj in self.client.watch(
                    self.res, namespace=self.namespace, resource_version=version, server_timeout=WATCH_TIMEOUT_S
                ):
                    key = (obj.metadata.namespace or "", obj.metadata.name)
                    if kind == "DELETED" or not self.selected(obj):
                        if key in self.known:
                            await self._drop(key)
                    else:
                        await self._changed(obj)
                raise ConnectionError("the watch ended")
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status.code == 410:
                    continue
                self._failed(e)
            except Exception as e:  # the watch loop outlives any failure of the API server or client: retried
                self._failed(e)
            await asyncio.sleep(self.retry_s)

    async def _changed(self, obj: Any) -> None:
        key = (obj.metadata.namespace or "", obj.metadata.name)
        spec = json.dumps(obj.get("spec"), sort_keys=True, default=str)
        if self.known.get(key) == spec:  # (a status write, or nothing that matters)
            return
        if key in self.known:
            await self._drop(key)
        self.known[key] = spec
        try:
            await self._apply(key, obj)
        except Exception:  # a bug: the resource is skipped, the watch goes on
            log.exception("%s %s/%s could not be applied", self.what, *key)

    async def _drop(self, key: tuple[str, str]) -> None:
        self.known.pop(key, None)

    async def _apply(self, key: tuple[str, str], obj: Any) -> None:
        raise NotImplementedError

    def _listed(self) -> None:
        if not self.listed or self.failing is not None:
            log.info("%d %s(s) in %s", len(self.known), self.what, self.where)
        self.listed = True
        self.failing = None
        self.core.not_ready.pop(self.what, None)

    def _failed(self, error: BaseException) -> None:
        message = describe_error(error, self.client)
        if message != self.failing:
            log.error("cannot follow the %ss of %s: %s; keeping what is known", self.what, self.where, message)
        self.failing = message


# ---- InferenceWorkerSet -------------------------------------------------------------------------


class Rejected(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class _Derived:
    name: str  # the worker set's
    discovery: EndpointSliceDiscovery


class WorkerSetWatcher(_Follower):
    """Worker sets from InferenceWorkerSet resources; see the module docstring."""

    res = InferenceWorkerSet
    what = "InferenceWorkerSet"
    section = "kubernetes"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        selector = self.config.kubernetes.selector
        self._selector = parse_selector(selector) if selector else None
        self.derived: dict[tuple[str, str], _Derived] = {}

    def selected(self, obj: Any) -> bool:
        return self._selector is None or self._selector(obj.metadata.labels or {})

    async def stop(self) -> None:
        await super().stop()
        for derived in self.derived.values():
            await derived.discovery.stop()

    async def _drop(self, key: tuple[str, str]) -> None:
        await super()._drop(key)
        self.status.forget(self.res, *key)
        derived = self.derived.pop(key, None)
        if derived is not None:
            await derived.discovery.stop()
            await self.core.remove_worker_set(derived.name)
            log.info("worker set %s (InferenceWorkerSet %s/%s) removed", derived.name, *key)

    async def _apply(self, key: tuple[str, str], obj: Any) -> None:
        generation = obj.metadata.generation
        try:
            ws, ports, model_name = self._parse(key, obj.get("spec"))
            try:
                await self.core.add_worker_set(ws)
            except Exception as e:  # e.g. local tokenization without a mount_dir
                raise Rejected("Invalid", f"the worker set cannot be served: {e}") from None
        except Rejected as e:
            log.warning("InferenceWorkerSet %s/%s skipped: %s", *key, e.message)
            self.status.set(self.res, *key, generation, False, e.reason, e.message)
            return
        d = ws.discovery
        discovery = EndpointSliceDiscovery(
            self.client,
            self.core,
            ws.name,
            namespace=d.namespace,
            service_name=d.service_name,
            defaults=d.defaults,
            ports=ports,
            model_name=model_name,
            retry_s=self.retry_s,
            gates_readiness=False,  # one resource's Service must not keep the whole router unready
        )
        self.derived[key] = _Derived(ws.name, discovery)
        discovery.start()
        where = f"the EndpointSlices of Service {d.namespace}/{d.service_name}"
        log.info("worker set %s from InferenceWorkerSet %s/%s: workers from %s", ws.name, *key, where)
        self.status.set(
            self.res,
            *key,
            generation,
            True,
            "Accepted",
            f"worker set {ws.name}: workers from {where}",
            self._counts(ws.name),
        )

    def _counts(self, name: str) -> Callable[[], dict[str, int]]:
        def counts() -> dict[str, int]:
            entry = self.core.sets.get(name)
            workers = list(entry.workers) if entry is not None else []
            alive = sum(1 for num in workers if self.core._ineligible(self.core.workers[num][0], entry) is None)
            return {"workers": len(workers), "aliveWorkers": alive}

        return counts

    def _parse(self, key: tuple[str, str], spec: Any) -> tuple[WorkerSet, PortNames, str]:
        namespace, name = key
        if not isinstance(spec, dict):
            raise Rejected("Invalid", "spec: expected an object")
        profile = spec.get("profile")
        if not isinstance(profile, str) or not profile:
            raise Rejected("Invalid", "spec.profile: required, a non-empty string")
        try:
            self.config.profile_named(profile)
        except KeyError:
            defined = ", ".join(p.name for p in self.config.profile) or "none"
            raise Rejected(
                "UnknownProfile", f"spec.profile {profile!r}: no [[profile]] has this name (defined: {defined})"
            ) from None
        block = spec.get("kvBlockSize")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise Rejected("Invalid", f"spec.kvBlockSize = {json.dumps(block)}: required, an integer >= 1")
        service = spec.get("serviceName")
        if service is None and spec.get("selector") is not None:
            raise Rejected(
                "Unsupported", "spec.selector: finding workers by pod selector is not supported; set serviceName"
            )
        if not isinstance(service, str) or not service:
            raise Rejected("Invalid", "spec.serviceName: required, a non-empty string")
        for field in ("modelName", "renderUrl", "namespace"):
            if spec.get(field) is not None and not isinstance(spec.get(field), str):
                raise Rejected("Invalid", f"spec.{field}: expected a string")
        names = spec.get("ports") or {}
        if not isinstance(names, dict) or not all(isinstance(v, str) and v for v in names.values()):
            raise Rejected("Invalid", "spec.ports: expected port names (strings)")
        ports = PortNames(**{k: names[k] for k in ("http", "zmq", "replay") if k in names})
        given = spec.get("defaultPorts") or {}
        if not isinstance(given, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535 for v in given.values()
        ):
            raise Rejected("Invalid", "spec.defaultPorts: expected port numbers 1 to 65535")
        defaults = self.config.kubernetes.discovery_defaults.model_dump()
        defaults.update({f"{k}_port": given[k] for k in ("http", "zmq", "replay") if k in given})
        taken = {ws.name for ws in self.config.workerset} | {d.name for k, d in self.derived.items() if k != key}
        if name in taken:
            raise Rejected(
                "NameConflict", f"a worker set named {name!r} exists already (in router.toml or another namespace)"
            )
        try:
            ws = WorkerSet.model_validate(
                {
                    "name": name,
                    "profile": profile,
                    "kv_block_size": block,
                    "render_url": spec.get("renderUrl"),
                    "discovery": {
                        "mode": "kubernetes",
                        "service_name": service,
                        "namespace": spec.get("namespace") or namespace,
                        "defaults": defaults,
                    },
                }
            )
        except ValidationError as e:
            raise Rejected("Invalid", str(e).splitlines()[0]) from None
        return ws, ports, spec.get("modelName") or ""


# ---- InferencePool ------------------------------------------------------------------------------


class PoolWatcher(_Follower):
    """The InferencePools (types.Pool), for `RouterCore.pick` (`core.pools`); see the module docstring."""

    res = InferencePool
    what = "InferencePool"
    section = "policy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pools: dict[tuple[str, str], Pool] = {}

    def _listed(self) -> None:
        super()._listed()
        self.core.pools = self

    def lookup(self, name: str) -> Pool:
        """The pool `name` (or `namespace/name`); KeyError when there is none, ValueError when ambiguous."""
        if "/" in name:
            found = [p for k, p in self.pools.items() if "/".join(k) == name]
        else:
            found = [p for k, p in self.pools.items() if k[1] == name]
        if not found:
            known = ", ".join(sorted("/".join(k) for k in self.pools)) or "none"
            raise KeyError(f"no InferencePool named {name!r} (known: {known})")
        if len(found) > 1:
            raise ValueError(f"inference_pool {name!r} is in several namespaces; name it namespace/name")
        return found[0]

    async def _drop(self, key: tuple[str, str]) -> None:
        await super()._drop(key)
        self.pools.pop(key, None)
        self.status.forget(self.res, *key)

    async def _apply(self, key: tuple[str, str], obj: Any) -> None:
        generation = obj.metadata.generation
        spec = obj.get("spec")
        try:
            pool = self._parse(key, spec)
        except Rejected as e:
            log.warning("InferencePool %s/%s skipped: %s", *key, e.message)
            self.status.set(self.res, *key, generation, False, e.reason, e.message)
            return
        self.pools[key] = pool
        self.status.set(
            self.res,
            *key,
            generation,
            True,
            "Accepted",
            "picks naming the pool are made among its workers",
            self._counts(pool),
        )

    def _counts(self, pool: Pool) -> Callable[[], dict[str, int]]:
        def counts() -> dict[str, int]:
            n = sum(1 for num, (_, e) in self.core.workers.items() if pool.admits(e.ws.name, self.core.meta.get(num)))
            return {"workers": n}

        return counts

    @staticmethod
    def _parse(key: tuple[str, str], spec: Any) -> Pool:
        if not isinstance(spec, dict):
            raise Rejected("Invalid", "spec: expected an object")
        sets, selector = spec.get("workerSets"), spec.get("selector")
        if sets is None and selector is None:
            raise Rejected("Invalid", "spec: needs workerSets, selector or both")
        if sets is not None and (not isinstance(sets, list) or not all(isinstance(s, str) and s for s in sets)):
            raise Rejected("Invalid", "spec.workerSets: expected a list of worker set names")
        try:
            matcher = match_expressions(selector) if selector is not None else None
        except ValueError as e:
            raise Rejected("Invalid", f"spec.{e}") from None
        target = spec.get("targetPortName") or "http"
        if not isinstance(target, str):
            raise Rejected("Invalid", "spec.targetPortName: expected a port name")
        return Pool("/".join(key), frozenset(sets) if sets is not None else None, matcher, target)
