"""Running the router: the core, the gRPC server on `listen` and the admin HTTP server on
`admin_listen`, on one asyncio loop, until SIGTERM or SIGINT.

Startup order: tokenizers are registered (a local tokenizer that cannot load is a configuration
error), ingest and scraping start, then Kubernetes discovery and the custom resources' watchers
(resources.py), then the gRPC server binds and its health turns SERVING, then
the admin server binds, then (with [leader_election]) the replica starts campaigning for the Lease.
Shutdown runs the other way round: the Lease is released, health NOT_SERVING, the gRPC server
stops (calls under way get a short grace), the admin server, scraping and ingest stop.

The Kubernetes client (k8s.py), needed by [token_review], [leader_election], [kubernetes], [policy]
and worker sets with `discovery.mode = "kubernetes"`, is built before anything starts: credentials
that cannot be loaded are a configuration error. Discovery (discovery.py) starts with ingest and
scraping, before the gRPC server binds, and stops before them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from kiln.router.admin import AdminServer
from kiln.router.bodies import BodyBudget
from kiln.router.config import RouterConfig, RouterConfigError
from kiln.router.core import RouterCore
from kiln.router.grpc_api import GrpcServer
from kiln.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from lightkube import AsyncClient

    from kiln.router.discovery import EndpointSliceDiscovery
    from kiln.router.leader import LeaderElector
    from kiln.router.resources import PoolWatcher, StatusWriter, WorkerSetWatcher

log = logging.getLogger("kiln.router")

EXIT_OK = 0
EXIT_START_FAILED = 1
EXIT_CONFIG_ERROR = 2


async def serve(config: RouterConfig) -> int:
    """Serve until SIGTERM or SIGINT; returns the process's exit status."""
    budget = BodyBudget(config.body_max_total_kb * 1024, config.body_max_request_kb * 1024)
    core: RouterCore | None = None
    metrics = RouterMetrics(config, snapshot=lambda: core.snapshot())
    core = RouterCore.from_config(config, metrics, budget)
    grpc_server: GrpcServer | None = None
    admin: AdminServer | None = None
    kube: AsyncClient | None = None
    elector: LeaderElector | None = None
    watchers: list[EndpointSliceDiscovery | WorkerSetWatcher | PoolWatcher | StatusWriter] = []
    try:
        if needs_kubernetes(config):
            from kiln.router.k8s import KubernetesError, make_client

            try:
                kube = make_client()
            except KubernetesError as e:
                log.error("%s", e)
                return EXIT_CONFIG_ERROR
        if config.leader_election.enabled:
            elector = _elector(config, kube)
            core.leader_election = elector
        try:
            await core.start()
        except RouterConfigError as e:
            log.error("%s", e)
            return EXIT_CONFIG_ERROR
        watchers = _discoveries(config, core, kube) + _resource_watchers(config, core, kube, elector)
        for watcher in watchers:
            watcher.start()
        if config.mock_mode:
            log.warning("mock mode: picks are a hash of model and prompt; no KV events, scraping or tokenization")
        reviewer = None
        if config.token_review.enabled:
            from kiln.router.token_review import TokenReviewer

            reviewer = TokenReviewer.from_config(kube, config.token_review)
        grpc_server = GrpcServer(core, budget, reviewer)
        try:
            address = await grpc_server.start()
        except RuntimeError as e:
            log.error("cannot serve gRPC on listen = %r: %s", config.listen, e)
            return EXIT_START_FAILED
        log.info("gRPC listening on %s (%s)", address, ", ".join(grpc_server.services))
        if config.admin_listen is not None:
            admin = AdminServer(core, metrics, config.admin_listen)
            try:
                address = await admin.start()
            except (OSError, ValueError) as e:
                log.error("cannot serve admin HTTP on admin_listen = %r: %s", config.admin_listen, e)
                return EXIT_START_FAILED
            log.info("admin HTTP listening on http://%s (/metrics, /readyz, dashboard at /)", address)
        if elector is not None:
            elector.start()
            log.info(
                "leader election: campaigning for lease %s/%s as %s",
                elector.namespace,
                elector.lease_name,
                elector.identity,
            )

        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        log.info("shutting down")
        return EXIT_OK
    finally:
        if elector is not None:
            await elector.stop(release=True)
        if grpc_server is not None:
            await grpc_server.stop()
        if admin is not None:
            await admin.stop()
        for watcher in reversed(watchers):
            await watcher.stop()
        await core.stop()
        if kube is not None:
            await kube.close()
        log.info("router stopped")


def needs_kubernetes(config: RouterConfig) -> bool:
    """Whether anything configured talks to the Kubernetes API."""
    return (
        config.token_review.enabled
        or config.leader_election.enabled
        or config.kubernetes.enabled
        or config.policy.enabled
        or any(ws.discovery.mode == "kubernetes" for ws in config.workerset)
    )


def _discoveries(config: RouterConfig, core: RouterCore, client: AsyncClient | None) -> list[EndpointSliceDiscovery]:
    """EndpointSlice discovery for each [[workerset]] with discovery.mode = "kubernetes"."""
    sets = [ws for ws in config.workerset if ws.discovery.mode == "kubernetes"]
    if not sets:
        return []
    from kiln.router.discovery import EndpointSliceDiscovery
    from kiln.router.k8s import own_namespace

    assert client is not None
    return [
        EndpointSliceDiscovery(
            client,
            core,
            ws.name,
            namespace=ws.discovery.namespace or own_namespace(client),
            service_name=ws.discovery.service_name,
            defaults=ws.discovery.defaults,
        )
        for ws in sets
    ]


def _resource_watchers(
    config: RouterConfig, core: RouterCore, client: AsyncClient | None, elector: LeaderElector | None
) -> list[StatusWriter | WorkerSetWatcher | PoolWatcher]:
    """With [kubernetes] and/or [policy]: the status writer, then the watchers of the custom resources."""
    if not (config.kubernetes.enabled or config.policy.enabled):
        return []
    from kiln.router.resources import PoolWatcher, StatusWriter, WorkerSetWatcher

    assert client is not None
    status = StatusWriter(client, elector)
    watchers: list[StatusWriter | WorkerSetWatcher | PoolWatcher] = [status]
    if config.kubernetes.enabled:
        watchers.append(WorkerSetWatcher(client, core, config, status))
    if config.policy.enabled:
        watchers.append(PoolWatcher(client, core, config, status))
    return watchers


def _elector(config: RouterConfig, client: AsyncClient) -> LeaderElector:
    from kiln.router.k8s import own_namespace
    from kiln.router.leader import LeaderElector

    le = config.leader_election
    return LeaderElector(
        client,
        lease_name=le.lease_name,
        namespace=le.namespace or own_namespace(client),
        lease_duration_s=le.lease_duration_secs,
        renew_grace_s=le.renew_grace_secs,
        retry_s=le.retry_secs,
    )


def run(config: RouterConfig) -> int:
    # httpx logs every request at INFO: a line per worker scrape (several a second) and per render;
    # the scraper logs a worker's failures itself, once per change of state
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(serve(config))
