"""Kubernetes discovery: the workers of a worker set are the ready endpoints of its Service.

`EndpointSliceDiscovery` follows the EndpointSlices labelled `kubernetes.io/service-name=<service>`
in one namespace: it lists them, then watches from the list's resourceVersion, and lists again
when the watch expires (410 Gone) or breaks. After each list and each event, the set's workers
are made to match the slices (`RouterCore.add_worker` / `remove_worker`):

* one worker per endpoint whose `conditions.ready` is not false (a terminating or unready pod
  leaves at once), at its first address;
* its ports are the slice's ports named `http`, `zmq` and `replay` (an InferenceWorkerSet may
  name others), else the worker set's discovery defaults; without a replay port, ingest is
  live-only;
* its topology labels come from the slice (`targetRef` pod name and namespace, `nodeName`,
  `zone`, the address as `pod_ip`) and, once per pod, from the Pod (`hostIP` as `node_ip`, and
  its labels, which InferencePool selectors match), when the Pod can be read within
  `POD_READ_TIMEOUT_S`; the slice's named ports are kept too (an InferencePool's targetPortName);
* its worker_id_str is the pod's name (the address without a pod), its worker_id_num a stable hash
  of worker set, namespace and pod (`RouterCore.worker_id_num_for`).

An apiserver that cannot be reached, or that refuses (RBAC), is logged as an error, and retried
every `retry_s`; the workers last known stay. Until the first list succeeds, the router is not
ready (`RouterCore.not_ready`), unless `gates_readiness` is off (an InferenceWorkerSet's set).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightkube import ApiError, AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from kiln.router.config import DiscoveryDefaults, Worker
from kiln.router.k8s import describe_error, stop_api_task
from kiln.router.types import WorkerMeta

if TYPE_CHECKING:
    from kiln.router.core import RouterCore

_Found = tuple[Worker, dict[str, int]]  # a worker and its slice's named ports

log = logging.getLogger("kiln.router.discovery")

SERVICE_LABEL = "kubernetes.io/service-name"
RETRY_S = 5.0  # after a failed list or a broken watch
WATCH_TIMEOUT_S = 290  # the server ends each watch request after this; lightkube then resumes it
POD_READ_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class PortNames:
    """The names of a worker's ports on its Service (an InferenceWorkerSet's `spec.ports`)."""

    http: str = "http"
    zmq: str = "zmq"
    replay: str = "replay"


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


class EndpointSliceDiscovery:
    """Keeps one worker set's workers equal to its Service's ready endpoints; see the module docstring."""

    def __init__(
        self,
        client: AsyncClient,
        core: RouterCore,
        workerset: str,
        *,
        namespace: str,
        service_name: str,
        defaults: DiscoveryDefaults,
        ports: PortNames = PortNames(),
        model_name: str = "",
        retry_s: float = RETRY_S,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        gates_readiness: bool = True,
    ) -> None:
        self.client = client
        self.core = core
        self.workerset = workerset
        self.namespace = namespace
        self.service_name = service_name
        self.defaults = defaults
        self.ports = ports
        self.model_name = model_name
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s
        self.listed = False  # a list has succeeded
        self.failing: str | None = None  # the last error, while the apiserver fails
        self._slices: dict[str, list[_Found]] = {}  # slice name -> its ready endpoints' workers
        self._nums: dict[str, int] = {}  # worker identity -> worker_id_num
        self._workers: dict[str, tuple[Worker, WorkerMeta]] = {}  # identity -> the worker as the core holds it
        self._pods: dict[str, tuple[str | None, dict[str, str]]] = {}  # pod identity -> (node IP, labels)
        self._task: asyncio.Task | None = None
        self._ready_key = f"discovery:{workerset}"
        self.gates_readiness = gates_readiness

    @property
    def where(self) -> str:
        return f"Service {self.namespace}/{self.service_name}"

    def start(self) -> None:
        if self._task is None:
            if self.gates_readiness:
                self.core.not_ready[self._ready_key] = (
                    f"worker set {self.workerset}: the EndpointSlices of {self.where} are not listed yet"
                )
            self._task = asyncio.create_task(self._run(), name=f"discovery-{self.workerset}")

    async def stop(self) -> None:
        """Stop watching; the workers stay with the core (removing the worker set removes them)."""
        if self._task is not None:
            await stop_api_task(self._task)
            self._task = None
        self.core.not_ready.pop(self._ready_key, None)

    # ---- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        labels = {SERVICE_LABEL: self.service_name}
        while True:
            try:
                listing = self.client.list(EndpointSlice, namespace=self.namespace, labels=labels)
                slices = [s async for s in listing]
                version = listing.resourceVersion
                self._slices = {s.metadata.name: self._workers_of(s) for s in slices}
                await self._reconcile()
                self._listed()
                async for kind, eps in self.client.watch(
                    EndpointSlice,
                    namespace=self.namespace,
                    labels=labels,
                    resource_version=version,
                    server_timeout=self.watch_timeout_s,
                ):
                    name = eps.metadata.name
                    if kind == "DELETED":
                        self._slices.pop(name, None)
                    else:
                        self._slices[name] = self._workers_of(eps)
                    await self._reconcile()
                raise ConnectionError("the watch ended")  # (lightkube resumes ended watches itself)
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status.code == 410:  # the watch's resourceVersion is too old: list again
                    log.debug("worker set %s: watch of %s expired; listing again", self.workerset, self.where)
                    continue
                self._failed(e)
            except Exception as e:  # the watch loop outlives any failure of the API server or client: retried
                self._failed(e)
            await asyncio.sleep(self.retry_s)

    def _listed(self) -> None:
        if not self.listed or self.failing is not None:
            log.info(
                "worker set %s: %d worker(s) from the EndpointSlices of %s",
                self.workerset,
                len(self._workers),
                self.where,
            )
        self.listed = True
        self.failing = None
        self.core.not_ready.pop(self._ready_key, None)

    def _failed(self, error: BaseException) -> None:
        message = describe_error(error, self.client)
        if message != self.failing:  # logged when it starts failing, or fails differently
            log.error(
                "worker set %s: cannot follow the EndpointSlices of %s: %s; keeping its %d known worker(s)",
                self.workerset,
                self.where,
                message,
                len(self._workers),
            )
        self.failing = message

    # ---- slices -> workers ----------------------------------------------------------------------

    def _workers_of(self, eps: EndpointSlice) -> list[_Found]:
        ports = {p.name: p.port for p in eps.ports or () if p.name and p.port}
        http = ports.get(self.ports.http, self.defaults.http_port)
        zmq = ports.get(self.ports.zmq, self.defaults.zmq_port)
        replay = ports.get(self.ports.replay, self.defaults.replay_port)
        found = []
        for ep in eps.endpoints or ():
            if ep.conditions is not None and ep.conditions.ready is False:
                continue
            if not ep.addresses:
                continue
            ip = ep.addresses[0]
            ref = ep.targetRef if ep.targetRef is not None and ep.targetRef.kind in (None, "Pod") else None
            pod = ref.name if ref is not None and ref.name else None
            pod_ns = (ref.namespace if ref is not None else None) or self.namespace
            host = _host(ip)
            found.append(
                (
                    Worker(
                        worker_id_str=pod or ip,
                        worker_id_num=0,  # assigned by _reconcile
                        model_name=self.model_name,
                        zmq_endpoint=f"tcp://{host}:{zmq}",
                        replay_endpoint=f"tcp://{host}:{replay}" if replay else None,
                        metrics_url=f"http://{host}:{http}/metrics",
                        http_url=f"http://{host}:{http}",
                        endpoint=f"{host}:{http}",
                        pod_name=pod,
                        namespace=pod_ns,
                        node_name=ep.nodeName,
                        pod_ip=ip,
                        availability_zone=ep.zone,
                    ),
                    ports,
                )
            )
        return found

    @staticmethod
    def _identity(worker: Worker) -> str:
        return f"{worker.namespace}/{worker.pod_name or worker.pod_ip}"

    async def _reconcile(self) -> None:
        """Make the core's workers of this set those of the slices (an endpoint in two slices counts once)."""
        wanted: dict[str, _Found] = {}
        for workers in self._slices.values():
            for worker, ports in workers:
                wanted.setdefault(self._identity(worker), (worker, ports))
        for identity in [i for i in self._workers if i not in wanted]:
            del self._workers[identity]
            await self.core.remove_worker(self._nums.pop(identity))
        for identity in [i for i in self._pods if i not in wanted]:
            del self._pods[identity]
        for identity, (worker, ports) in wanted.items():
            num = self._nums.get(identity)
            if num is None:
                num = self._nums[identity] = self.core.worker_id_num_for(f"{self.workerset}/{identity}")
            node_ip, labels = await self._pod(worker)
            worker = worker.model_copy(update={"worker_id_num": num, "node_ip": node_ip})
            meta = WorkerMeta(labels, ports)
            if self._workers.get(identity) == (worker, meta):
                continue
            try:
                await self.core.add_worker(self.workerset, worker, meta)
            except (KeyError, ValueError, RuntimeError) as e:  # (the set was removed meanwhile, or an id clash)
                log.error("worker set %s: cannot add worker %s: %s", self.workerset, worker.worker_id_str, e)
                self._nums.pop(identity, None)
                continue
            self._workers[identity] = (worker, meta)

    async def _pod(self, worker: Worker) -> tuple[str | None, dict[str, str]]:
        """The pod's hostIP and labels, read once per pod; (None, {}) when it cannot be read quickly."""
        if worker.pod_name is None:
            return None, {}
        identity = self._identity(worker)
        if identity not in self._pods:
            node_ip, labels = None, {}
            try:
                async with asyncio.timeout(POD_READ_TIMEOUT_S):
                    pod = await self.client.get(Pod, worker.pod_name, namespace=worker.namespace)
                node_ip = pod.status.hostIP if pod.status is not None else None
                labels = dict(pod.metadata.labels or {}) if pod.metadata is not None else {}
            except Exception as e:  # only labels are missing
                log.debug("worker %s: cannot read its Pod: %s", worker.worker_id_str, describe_error(e, self.client))
            self._pods[identity] = (node_ip, labels)
        return self._pods[identity]
