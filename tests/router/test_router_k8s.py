"""The router's Kubernetes pieces against a local fake API server (tests/fake_apiserver.py), through the
real lightkube client: the client itself (k8s.py), leader election on a Lease (leader.py) and
TokenReview with its cache (token_review.py), in process and through router processes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import time
from pathlib import Path

import grpc
import pytest
from fake_apiserver import FakeApiServer, User
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lightkube import ApiError, KubeConfig
from lightkube.resources.coordination_v1 import Lease
from server_process import free_port
from test_router_scrape import FakeWorker
from test_router_server import BS, RouterProcess, code_of, wait_until, write_config

from kiln.router.config import DiscoveryDefaults, RouterConfig, Worker
from kiln.router.core import RouterCore
from kiln.router.discovery import EndpointSliceDiscovery
from kiln.router.k8s import KubernetesError, describe_error, load_kube_config, make_client, own_namespace
from kiln.router.leader import LeaderElector
from kiln.router.metrics import RouterMetrics
from kiln.router.proto import router_pb2, router_pb2_grpc
from kiln.router.resources import PoolWatcher, StatusWriter, WorkerSetWatcher
from kiln.router.token_review import ReviewUnavailable, TokenReviewer
from kiln.router.types import PickError, PickInput, WorkerMeta

LEASES = "apis/coordination.k8s.io/v1"
NS = "kiln"


@pytest.fixture
def api():
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def kubeconfig(api, tmp_path) -> Path:
    return api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


def client_for(kubeconfig: Path):
    return make_client(KubeConfig.from_file(kubeconfig), timeout_s=5)


def holder(api: FakeApiServer, name: str = "kiln-router") -> str | None:
    lease = api.get(LEASES, NS, "leases", name)
    return lease["spec"].get("holderIdentity") if lease else None


# how long a watch or status write may take to show: generous, so that a busy machine (the suite's
# other processes) does not fail a test; a passing test waits only as long as the change takes
SETTLE_S = 30


async def until(predicate, timeout: float, what: str) -> float:
    """Seconds until predicate() holds (polled every 20 ms); fails after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


# ---- the client -----------------------------------------------------------------------------------


def test_client_from_kubeconfig_and_clear_errors(api, kubeconfig, tmp_path):
    config = load_kube_config({"KUBECONFIG": f"{tmp_path / 'absent'}:{kubeconfig}"})  # the first file that exists
    client = make_client(config)
    assert client.config.cluster.server == api.url
    assert own_namespace(client, {}) == NS and own_namespace(client, {"POD_NAMESPACE": "x"}) == "x"
    with pytest.raises(KubernetesError, match="no such file"):
        load_kube_config({"KUBECONFIG": str(tmp_path / "absent")})
    with pytest.raises(KubernetesError, match="no Kubernetes credentials"):
        load_kube_config({"HOME": str(tmp_path)})
    (tmp_path / "empty").write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(KubernetesError, match="kubeconfig"):
        load_kube_config({"KUBECONFIG": str(tmp_path / "empty")})
    no_namespace = make_client(KubeConfig.from_file(api.write_kubeconfig(tmp_path / "nons", namespace=None)))
    assert own_namespace(no_namespace, {}) == "default"

    async def errors():
        async with asyncio.timeout(20):
            try:
                await client.get(Lease, "absent", namespace=NS)
            except ApiError as e:
                assert "answered 404 NotFound" in describe_error(e, client)
            with pytest.raises(ApiError) as e:  # the fake knows its own token only
                await make_client(KubeConfig.from_dict(_with_token(kubeconfig, "wrong"))).get(Lease, "x", namespace=NS)
            assert "denied by" in describe_error(e.value) and "RBAC" in describe_error(e.value)
            closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            doc = _with_token(kubeconfig, "t")
            doc["clusters"][0]["cluster"]["server"] = closed
            unreachable = make_client(KubeConfig.from_dict(doc))
            with pytest.raises(Exception) as e:
                await unreachable.get(Lease, "x", namespace=NS)
            assert describe_error(e.value, unreachable).startswith(f"cannot reach {closed}")

    asyncio.run(errors())


def _with_token(kubeconfig: Path, token: str) -> dict:
    doc = json.loads(kubeconfig.read_text())
    doc["users"][0]["user"]["token"] = token
    return doc


# ---- leader election, in process ------------------------------------------------------------------


def elector(kubeconfig: Path, name: str, **timing: float) -> LeaderElector:
    timing = {"lease_duration_s": 2, "renew_grace_s": 1, "retry_s": 0.2, **timing}
    return LeaderElector(client_for(kubeconfig), lease_name="kiln-router", namespace=NS, identity=name, **timing)


async def exactly_one_leader_for(electors: list[LeaderElector], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert sum(e.is_leader for e in electors) <= 1
        await asyncio.sleep(0.01)


def test_one_leader_and_a_released_lease_is_taken_at_once(api, kubeconfig):
    async def main():
        a, b = elector(kubeconfig, "a"), elector(kubeconfig, "b")
        changes = []
        a.on_change.append(lambda leading: changes.append(("a", leading)))
        b.on_change.append(lambda leading: changes.append(("b", leading)))
        a.start()
        b.start()
        await until(lambda: a.is_leader or b.is_leader, SETTLE_S, "a leader")
        await exactly_one_leader_for([a, b], 2.5)  # renewals included (every second)
        leader, follower = (a, b) if a.is_leader else (b, a)
        assert holder(api) == leader.identity and leader.leading.is_set() and not follower.leading.is_set()
        lease = api.get(LEASES, NS, "leases", "kiln-router")
        assert lease["spec"]["leaseDurationSeconds"] == 2 and lease["spec"]["leaseTransitions"] == 0
        await leader.stop()  # releases
        assert not leader.is_leader and holder(api) in (None, follower.identity)
        waited = await until(lambda: follower.is_leader, 2, "the follower to take the released lease")
        assert waited < 1.0  # at its next attempt (every 0.2 s), not after the 2 s lease expired
        assert holder(api) == follower.identity
        assert api.get(LEASES, NS, "leases", "kiln-router")["spec"]["leaseTransitions"] == 1
        await follower.stop()
        assert holder(api) is None
        assert changes == [(leader.identity, True), (leader.identity, False), (follower.identity, True),
                           (follower.identity, False)]  # fmt: skip

    asyncio.run(main())


def test_a_leader_that_stops_renewing_is_replaced_after_the_lease_expires(api, kubeconfig):
    async def main():
        a = elector(kubeconfig, "a")
        a.start()
        await until(lambda: a.is_leader, SETTLE_S, "a to lead")
        b = elector(kubeconfig, "b")
        b.start()
        await exactly_one_leader_for([a, b], 1.0)
        assert a.is_leader and not b.is_leader
        renewed = dt.datetime.fromisoformat(api.get(LEASES, NS, "leases", "kiln-router")["spec"]["renewTime"])
        await a.stop(release=False)  # as if the process died
        assert holder(api) == "a"
        await until(lambda: b.is_leader, 2 + 0.2 + 1.5, "b to take over")
        took = dt.datetime.now(dt.UTC) - renewed
        assert dt.timedelta(seconds=2) <= took <= dt.timedelta(seconds=2 + 0.2 + 1.5)
        assert holder(api) == "b"
        await b.stop()

    asyncio.run(main())


def test_a_conflicting_write_makes_the_loser_a_follower(api, kubeconfig):
    async def main():
        # an expired lease both candidates read before either writes it
        old = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=60)
        spec = {"holderIdentity": "gone", "leaseDurationSeconds": 2, "renewTime": old.isoformat()}
        api.put(LEASES, NS, "leases", {"kind": "Lease", "metadata": {"name": "kiln-router"}, "spec": spec})
        a, b = elector(kubeconfig, "a"), elector(kubeconfig, "b")
        stale = await b.client.get(Lease, "kiln-router", namespace=NS)

        async def stale_get(*args, **kwargs):
            return stale.from_dict(stale.to_dict())  # always the version read before a wrote

        b.client.get = stale_get
        a.start()
        await until(lambda: a.is_leader, SETTLE_S, "a to lead")
        b.start()
        await exactly_one_leader_for([a, b], 1.5)
        assert a.is_leader and not b.is_leader and holder(api) == "a"
        conflicts = [r for r in api.requests if r[0] == "PUT"]
        assert len(conflicts) >= 2  # a's renewals and b's rejected writes
        await asyncio.gather(a.stop(), b.stop(release=False))

    asyncio.run(main())


def test_a_leader_that_sees_another_holder_or_cannot_renew_stops_leading_at_once(api, kubeconfig):
    async def main():
        a = elector(kubeconfig, "a")
        seen = []
        a.on_change.append(lambda leading: seen.append((leading, holder(api))))
        a.start()
        await until(lambda: a.is_leader, SETTLE_S, "a to lead")
        # another candidate took the lease (say, after a clock jump): a's next renewal sees it
        now = dt.datetime.now(dt.UTC).isoformat()
        lease = api.get(LEASES, NS, "leases", "kiln-router")
        lease["spec"].update(holderIdentity="intruder", renewTime=now, leaseDurationSeconds=60)
        api.put(LEASES, NS, "leases", lease)
        await until(lambda: not a.is_leader, 1.5, "a to step down")
        assert seen[-1] == (False, "intruder")
        # the intruder gives the lease up: a takes it back, then the API server goes away
        lease = api.get(LEASES, NS, "leases", "kiln-router")
        del lease["spec"]["holderIdentity"]
        api.put(LEASES, NS, "leases", lease)
        await until(lambda: a.is_leader, 2, "a to lead again")
        api.unavailable = True
        waited = await until(lambda: not a.is_leader, 2, "a to step down")
        assert waited <= 1.3  # at its first failed renewal, before the lease expires
        assert holder(api) == "a"  # (the lease still names it: it takes it back once it can)
        api.unavailable = False
        await until(lambda: a.is_leader, 2, "a to lead again")
        await a.stop()

    asyncio.run(main())


def test_the_watchdog_ends_leadership_when_a_renewal_hangs(api, kubeconfig):
    async def main():
        a = elector(kubeconfig, "a", lease_duration_s=2, renew_grace_s=1)
        a.start()
        await until(lambda: a.is_leader, SETTLE_S, "a to lead")
        started = time.monotonic()

        async def hang(*args, **kwargs):
            await asyncio.sleep(60)

        a.client.get = hang
        await until(lambda: not a.is_leader, 2.5, "a to step down")
        assert time.monotonic() - started <= 2.1
        await a.stop()

    asyncio.run(main())


# ---- TokenReview, in process ----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reviewer(kubeconfig: Path, clock: Clock, **settings) -> TokenReviewer:
    settings = {"deadline_s": 2.0, "positive_ttl_s": 60, "negative_ttl_s": 10, "max_entries": 4096, **settings}
    return TokenReviewer(client_for(kubeconfig), clock=clock, **settings)


def test_token_review_answers_and_cache_ttls(api, kubeconfig):
    api.tokens["good"] = User("system:serviceaccount:team:app", uid="u-1", groups=["system:serviceaccounts"])
    api.tokens["scoped"] = User("scoped", audiences=["kiln"])

    async def main():
        clock = Clock()
        r = reviewer(kubeconfig, clock)
        review = await r.review("good", ["kiln"])
        assert review.authenticated and review.username == "system:serviceaccount:team:app"
        assert review.uid == "u-1" and review.groups == ("system:serviceaccounts",) and review.error == ""
        denied = await r.review("bad")
        assert not denied.authenticated and denied.error == "invalid bearer token"
        assert not (await r.review("scoped", ["other"])).authenticated  # audiences are part of the question
        assert (await r.review("scoped", ["kiln"])).authenticated
        assert api.token_reviews == 4
        # within the TTLs: from the cache
        clock.now += 9
        assert (await r.review("good", ["kiln"])).authenticated and not (await r.review("bad")).authenticated
        assert api.token_reviews == 4 and r.hits == 2
        # the negative TTL (10 s) has passed, the positive one (60 s) not
        clock.now += 2
        assert not (await r.review("bad")).authenticated and api.token_reviews == 5
        assert (await r.review("good", ["kiln"])).authenticated and api.token_reviews == 5
        clock.now += 50
        assert (await r.review("good", ["kiln"])).authenticated and api.token_reviews == 6
        # a revoked token is still accepted until its entry expires
        del api.tokens["good"]
        assert (await r.review("good", ["kiln"])).authenticated and api.token_reviews == 6
        clock.now += 61
        assert not (await r.review("good", ["kiln"])).authenticated and api.token_reviews == 7
        assert all("good" not in str(key) for key in r.cache)  # keyed by a hash, never the token

    asyncio.run(main())


def test_token_review_cache_evicts_the_least_recently_used(api, kubeconfig):
    for t in "abc":
        api.tokens[t] = User(t)

    async def main():
        r = reviewer(kubeconfig, Clock(), max_entries=2)
        await r.review("a")
        await r.review("b")
        await r.review("a")  # a is now the most recently used
        await r.review("c")  # evicts b
        assert len(r.cache) == 2 and api.token_reviews == 3
        await r.review("a")
        await r.review("c")
        assert api.token_reviews == 3
        await r.review("b")
        assert api.token_reviews == 4

    asyncio.run(main())


def test_token_review_past_the_deadline_is_unavailable_and_not_cached(api, kubeconfig):
    api.tokens["good"] = User("me")

    async def main():
        r = reviewer(kubeconfig, Clock(), deadline_s=0.3)
        api.token_review_delay_s = 1.0
        started = time.monotonic()
        with pytest.raises(ReviewUnavailable, match="within 300 ms"):
            await r.review("good")
        assert time.monotonic() - started < 0.9
        with pytest.raises(ReviewUnavailable, match="within 100 ms"):
            await r.review("good", deadline_s=0.1)  # a caller's tighter deadline wins
        api.token_review_delay_s = 0.0
        calls = api.token_reviews
        assert (await r.review("good")).authenticated and api.token_reviews == calls + 1
        api.unavailable = True
        with pytest.raises(ReviewUnavailable, match="503"):
            await r.review("other")
        assert len(r.cache) == 1

    asyncio.run(main())


# ---- router processes -------------------------------------------------------------------------------


def router_config(tmp: Path, **sections) -> Path:
    config = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "mock_mode": True,
        "profile": [{"name": "p"}],
        "workerset": [{"name": "a", "profile": "p", "kv_block_size": BS}],
        **sections,
    }
    tmp.mkdir(exist_ok=True)
    return write_config(tmp, config, {"a": [{"worker_id_str": "w0", "worker_id_num": 0, "model_name": "m"}]})


def is_leader(router: RouterProcess) -> bool:
    return router.get("/api/state").json()["leader"]


def test_router_processes_elect_one_leader(api, kubeconfig, tmp_path):
    election = {"leader_election": {"enabled": True, "lease_duration_secs": 3, "renew_grace_secs": 1, "retry_secs": 1}}
    path = router_config(tmp_path / "r", **election)
    env = {"KUBECONFIG": str(kubeconfig), "POD_NAME": "router"}
    routers = [RouterProcess(path, **env), RouterProcess(path, **env)]
    try:
        wait_until(lambda: sum(map(is_leader, routers)) == 1, 20, "one leader")
        for _ in range(10):  # through a renewal or two
            assert sum(map(is_leader, routers)) == 1
            time.sleep(0.2)
        leader, follower = sorted(routers, key=is_leader, reverse=True)
        assert holder(api, "bllmp").startswith("router-")
        assert leader.metric("kiln_router_leader") == 1 and follower.metric("kiln_router_leader") == 0
        # killed: no release; the follower takes over once the lease has expired
        leader.proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        wait_until(lambda: is_leader(follower), 3 + 1 + 3, "the follower to take over")
        assert time.monotonic() - started >= 0.5
        # a clean stop releases the lease: a new replica takes over at its next attempt
        third = RouterProcess(path, **env)
        routers.append(third)
        time.sleep(1.5)
        assert not is_leader(third)
        code, output = follower.stop()
        assert code == 0 and "released lease kiln/bllmp" in output, output[-3000:]
        started = time.monotonic()
        wait_until(lambda: is_leader(third), 2.5, "the new replica to take the released lease")
    finally:
        for router in routers:
            router.stop()


def test_router_token_review_over_grpc(api, kubeconfig, tmp_path):
    api.tokens["good"] = User("alice", uid="u-7", groups=["team"])
    review_settings = {"enabled": True, "default_deadline_ms": 500, "positive_ttl_secs": 60, "negative_ttl_secs": 60}
    path = router_config(tmp_path / "r", token_review=review_settings)
    router = RouterProcess(path, admin=False, KUBECONFIG=str(kubeconfig))
    try:
        review = router_pb2_grpc.TokenReviewStub(router.channel).Review
        answer = review(router_pb2.TokenReviewRequest(token="good", audiences=["kiln"]), timeout=20)
        assert answer.authenticated and answer.username == "alice" and answer.uid == "u-7"
        assert list(answer.groups) == ["team"] and answer.error == ""
        answer = review(router_pb2.TokenReviewRequest(token="bad"), timeout=20)
        assert not answer.authenticated and answer.error == "invalid bearer token" and answer.username == ""
        review(router_pb2.TokenReviewRequest(token="good", audiences=["kiln"]), timeout=20)
        assert api.token_reviews == 2  # the third came from the cache
        code, details = code_of(review, router_pb2.TokenReviewRequest())
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        api.token_review_delay_s = 1.5
        code, details = code_of(review, router_pb2.TokenReviewRequest(token="slow"))
        assert code == grpc.StatusCode.UNAVAILABLE and "within 500 ms" in details
        api.token_review_delay_s = 0.0
        api.tokens["slow"] = User("slow")
        assert review(router_pb2.TokenReviewRequest(token="slow"), timeout=20).authenticated  # not cached
        health = health_pb2_grpc.HealthStub(router.channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="kiln.router.v1.TokenReview"), timeout=20).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        code, output = router.stop()
    assert code == 0, output[-3000:]


def test_unloadable_kubeconfig_is_a_startup_error(api, tmp_path):
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\n")  # no context
    path = router_config(tmp_path / "r", leader_election={"enabled": True})
    router = None
    with pytest.raises(AssertionError, match=r"router exited \(2\)"):
        router = RouterProcess(path, KUBECONFIG=str(bad))
    assert router is None


# ---- the fake itself: lists and watches, for later tests ------------------------------------------------


def test_fake_apiserver_lists_and_watches_with_lightkube(api, kubeconfig):
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import ConfigMap

    async def main():
        client = client_for(kubeconfig)
        await client.create(ConfigMap(metadata=ObjectMeta(name="a", labels={"app": "x"}), data={"k": "1"}))
        await client.create(ConfigMap(metadata=ObjectMeta(name="b", labels={"app": "y"})), namespace="other")
        assert [c.metadata.name async for c in client.list(ConfigMap, namespace="*")] == [
            "a",
            "b",
        ]  # by namespace, then name
        assert [c.metadata.name async for c in client.list(ConfigMap, labels={"app": "x"}, namespace="*")] == ["a"]
        events = []

        async def watch():
            async for kind, cm in client.watch(ConfigMap, namespace=NS, server_timeout=5):
                events.append((kind, cm.metadata.name, (cm.data or {}).get("k")))
                if kind == "DELETED":
                    return

        task = asyncio.create_task(watch())
        await until(lambda: events, SETTLE_S, "the current objects, as ADDED")
        cm = await client.get(ConfigMap, "a", namespace=NS)
        cm.data = {"k": "2"}
        await client.replace(cm)
        await client.create(ConfigMap(metadata=ObjectMeta(name="c"), data={"k": "3"}))
        await client.create(ConfigMap(metadata=ObjectMeta(name="d")), namespace="other")  # not watched
        await client.delete(ConfigMap, "a", namespace=NS)
        async with asyncio.timeout(10):
            await task
        assert events == [("ADDED", "a", "1"), ("MODIFIED", "a", "2"), ("ADDED", "c", "3"), ("DELETED", "a", "2")]

    asyncio.run(main())


# ---- discovery: a worker set's workers from its Service's EndpointSlices -----------------------------------

SLICES = "apis/discovery.k8s.io/v1"
MODELS = {"data": [{"id": "m", "owned_by": "kiln"}]}


def fake_worker() -> FakeWorker:
    """A worker's HTTP side: /v1/models says it serves m; /metrics reports no load."""
    worker = FakeWorker()
    worker.routes["/v1/models"] = (200, "application/json", MODELS)
    worker.routes["/metrics"] = (200, "text/plain", b"")
    return worker


def endpoint_slice(name: str, service: str, http_port: int, *pods: tuple[str, bool], zone: str = "zone-a") -> dict:
    """An EndpointSlice of `service` listing pods (name, ready) at 127.0.0.1, with named ports."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NS},
                "nodeName": "node-1",
                "zone": zone,
            }
            for pod, ready in pods
        ],
        "ports": [{"name": "http", "port": http_port, "protocol": "TCP"}, {"name": "zmq", "port": free_port()}],
    }


def put_slice(api: FakeApiServer, *args, **kw) -> None:
    api.put(SLICES, NS, "endpointslices", endpoint_slice(*args, **kw))


def live_config(**top) -> RouterConfig:
    """Not mock: real ingest, scraping and tokenization; scrapes far apart, so that a worker without
    KV events stays alive for the test."""
    return RouterConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "metrics_poll_ms": 60_000,
            "profile": [{"name": "p"}],
            "workerset": [
                {
                    "name": "a",
                    "profile": "p",
                    "kv_block_size": BS,
                    "discovery": {"mode": "kubernetes", "service_name": "kiln-worker"},
                }
            ],
            **top,
        }
    )


async def picked(core: RouterCore, n: int = 6, **kw) -> set[str]:
    """The workers n picks go to (in flight requests spread them) and end them with Feedback."""
    got = set()
    for i in range(n):
        result = await core.pick(PickInput(model="m", token_ids=list(range(i, i + 4 * BS)), **kw))
        got.add(result.worker_id)
    for request_id in list(core.inflight._where):
        core.feedback(request_id)
    return got


def test_discovery_follows_endpoint_slices(api, kubeconfig, caplog):
    workers = [fake_worker() for _ in range(3)]
    put_slice(api, "kw-a", "kiln-worker", workers[0].port, ("pod-0", True))
    put_slice(api, "kw-b", "kiln-worker", workers[1].port, ("pod-1", True))
    not_ready = endpoint_slice("kw-c", "kiln-worker", workers[2].port, ("pod-2", False))
    api.put(SLICES, NS, "endpointslices", not_ready)
    put_slice(api, "other", "other-service", workers[2].port, ("pod-9", True))
    api.put("api/v1", NS, "pods", {"metadata": {"name": "pod-0"}, "status": {"hostIP": "10.0.0.7"}})
    cfg = live_config()

    async def main():
        core = RouterCore.from_config(cfg, RouterMetrics(cfg))
        await core.start()
        api.unavailable = True
        discovery = EndpointSliceDiscovery(
            client_for(kubeconfig),
            core,
            "a",
            namespace=NS,
            service_name="kiln-worker",
            defaults=cfg.workerset[0].discovery.defaults,
            retry_s=0.1,
        )
        discovery.start()
        try:
            await until(lambda: discovery.failing is not None, SETTLE_S, "the first list to fail")
            ready, reasons = core.ready()
            assert not ready and "EndpointSlices of Service kiln/kiln-worker are not listed yet" in reasons[0]
            assert "cannot follow the EndpointSlices of Service kiln/kiln-worker" in caplog.text
            assert "answered 503" in caplog.text

            api.unavailable = False
            await until(lambda: discovery.listed, SETTLE_S, "the first list")
            assert core.ready() == (True, [])
            names = lambda: {w.worker_id_str for w, _ in core.workers.values()}  # noqa: E731
            assert names() == {"pod-0", "pod-1"}  # pod-2 is not ready; pod-9 is another Service's
            view = {v["worker"]: v for v in core.state()["workers"]}
            assert view["pod-0"]["endpoint"] == f"127.0.0.1:{workers[0].port}"
            assert view["pod-0"]["labels"] == {
                "pod_name": "pod-0",
                "namespace": NS,
                "node_name": "node-1",
                "node_ip": "10.0.0.7",  # from the Pod
                "pod_ip": "127.0.0.1",
                "availability_zone": "zone-a",
            }
            await until(lambda: all(core.scraper.states()[n].models for n in core.workers), SETTLE_S, "/v1/models")
            assert await picked(core) == {"pod-0", "pod-1"}

            # a pod turns ready, another stops being ready, a slice goes away: picks follow
            api.put(
                SLICES, NS, "endpointslices", endpoint_slice("kw-c", "kiln-worker", workers[2].port, ("pod-2", True))
            )
            api.put(
                SLICES, NS, "endpointslices", endpoint_slice("kw-b", "kiln-worker", workers[1].port, ("pod-1", False))
            )
            await until(lambda: names() == {"pod-0", "pod-2"}, SETTLE_S, "pod-2 in, pod-1 out")
            await until(lambda: all(core.scraper.states()[n].models for n in core.workers), SETTLE_S, "/v1/models")
            assert await picked(core) == {"pod-0", "pod-2"}
            api.delete(SLICES, NS, "endpointslices", "kw-a")
            await until(lambda: names() == {"pod-2"}, SETTLE_S, "pod-0 out")
            assert await picked(core) == {"pod-2"}

            # the apiserver goes away: the workers stay, and picks go on
            caplog.clear()
            api.unavailable = True
            api.end_watches()
            await until(lambda: discovery.failing is not None, SETTLE_S, "the watch to fail")
            assert "keeping its 1 known worker(s)" in caplog.text
            assert names() == {"pod-2"} and core.ready()[0]
            assert await picked(core) == {"pod-2"}
            api.put(
                SLICES, NS, "endpointslices", endpoint_slice("kw-a", "kiln-worker", workers[0].port, ("pod-0", True))
            )
            api.unavailable = False  # back: listed again
            await until(lambda: names() == {"pod-0", "pod-2"}, SETTLE_S, "the list after the outage")
            assert discovery.failing is None

            # a watch that expires (410) lists again, quietly
            api.compact()
            api.end_watches()
            api.delete(SLICES, NS, "endpointslices", "kw-c")
            await until(lambda: names() == {"pod-0"}, SETTLE_S, "pod-2 out after the 410")
            assert discovery.failing is None
        finally:
            await discovery.stop()
            await core.stop()
            for worker in workers:
                worker.stop()

    asyncio.run(main())


def test_discovery_without_rbac_says_so(api, kubeconfig, caplog):
    api.forbidden.add("endpointslices")
    cfg = live_config()

    async def main():
        core = RouterCore(cfg, metrics=RouterMetrics(cfg))
        discovery = EndpointSliceDiscovery(
            client_for(kubeconfig), core, "a", namespace=NS, service_name="kiln-worker", defaults=DiscoveryDefaults()
        )
        discovery.start()
        try:
            await until(lambda: discovery.failing is not None, SETTLE_S, "the list to fail")
            assert "denied by" in discovery.failing and "RBAC" in discovery.failing
            assert not core.ready()[0]
        finally:
            await discovery.stop()

    asyncio.run(main())


# ---- custom resources: InferenceWorkerSet and InferencePool ------------------------------------------------

CRDS = "apis/kinference.buoyant.io/v1alpha1"


def worker_set_cr(name: str, labels: dict | None = None, **spec) -> dict:
    return {
        "apiVersion": "kinference.buoyant.io/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": {"name": name, "labels": labels or {"team": "a"}, "generation": 1},
        "spec": {"profile": "p", "kvBlockSize": BS, **spec},
    }


def accepted(api: FakeApiServer, plural: str, name: str) -> dict | None:
    """The Accepted condition of a resource's status, or None."""
    obj = api.get(CRDS, NS, plural, name)
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Accepted"), None)


def test_inference_worker_sets_and_status_written_by_the_leader_only(api, kubeconfig):
    workers = [fake_worker() for _ in range(2)]
    api.put(CRDS, NS, "inferenceworkersets", worker_set_cr("qwen", modelName="m", serviceName="kw-qwen"))
    api.put(CRDS, NS, "inferenceworkersets", worker_set_cr("typo", modelName="m", serviceName="x", profile="nope"))
    api.put(CRDS, NS, "inferenceworkersets", worker_set_cr("bad", serviceName="x", kvBlockSize="16"))
    api.put(CRDS, NS, "inferenceworkersets", worker_set_cr("theirs", labels={"team": "b"}, serviceName="x"))
    put_slice(api, "kw-qwen-1", "kw-qwen", workers[0].port, ("qwen-0", True))
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {"holderIdentity": "other", "leaseDurationSeconds": 60, "renewTime": now}
    api.put(LEASES, NS, "leases", {"metadata": {"name": "kiln-router"}, "spec": lease})
    cfg = live_config(workerset=[], kubernetes={"enabled": True, "namespace": NS, "selector": "team in (a, c)"})

    async def main():
        client = client_for(kubeconfig)
        core = RouterCore.from_config(cfg, RouterMetrics(cfg))
        await core.start()
        leader = elector(kubeconfig, "me")
        status = StatusWriter(client, leader, every_s=0.1)
        watcher = WorkerSetWatcher(client, core, cfg, status, retry_s=0.1)
        status.start()
        watcher.start()
        leader.start()
        try:
            await until(lambda: watcher.listed, SETTLE_S, "the InferenceWorkerSets")
            assert set(core.sets) == {"qwen"}  # typo and bad are skipped, theirs is not selected
            names = lambda: {w.worker_id_str for w, _ in core.workers.values()}  # noqa: E731
            await until(lambda: names() == {"qwen-0"}, SETTLE_S, "qwen's worker")
            assert await picked(core, 3) == {"qwen-0"}  # modelName: served without a /v1/models poll
            await asyncio.sleep(0.5)
            assert api.status_writes == [] and not leader.is_leader  # another replica holds the Lease

            api.delete(LEASES, NS, "leases", "kiln-router")  # free: this replica leads, and writes
            await until(lambda: leader.is_leader, SETTLE_S, "leadership")
            await until(lambda: len({n for _, n in api.status_writes}) == 3, SETTLE_S, "three statuses")
            assert api.get(CRDS, NS, "inferenceworkersets", "theirs").get("status") is None
            good = api.get(CRDS, NS, "inferenceworkersets", "qwen")["status"]
            assert good["workers"] == 1 and good["aliveWorkers"] == 1 and good["observedGeneration"] == 1
            assert accepted(api, "inferenceworkersets", "qwen")["status"] == "True"
            typo = accepted(api, "inferenceworkersets", "typo")
            assert (typo["status"], typo["reason"]) == ("False", "UnknownProfile") and "'nope'" in typo["message"]
            bad = accepted(api, "inferenceworkersets", "bad")
            assert (bad["status"], bad["reason"]) == ("False", "Invalid") and "kvBlockSize" in bad["message"]

            put_slice(api, "kw-qwen-2", "kw-qwen", workers[1].port, ("qwen-1", True))  # counts follow
            await until(lambda: names() == {"qwen-0", "qwen-1"}, SETTLE_S, "qwen's second worker")
            workers_seen = lambda: api.get(CRDS, NS, "inferenceworkersets", "qwen")["status"]["workers"]  # noqa: E731
            await until(lambda: workers_seen() == 2, SETTLE_S, "2")

            # a fixed resource is taken; a deleted one goes
            api.put(CRDS, NS, "inferenceworkersets", worker_set_cr("typo", modelName="m", serviceName="kw-qwen"))
            await until(lambda: "typo" in core.sets, SETTLE_S, "the fixed resource")
            await until(lambda: accepted(api, "inferenceworkersets", "typo")["status"] == "True", SETTLE_S, "accepted")
            api.delete(CRDS, NS, "inferenceworkersets", "qwen")
            await until(lambda: "qwen" not in core.sets, SETTLE_S, "the deleted resource's set to go")
            sets_served = lambda: {e.ws.name for _, e in core.workers.values()}  # noqa: E731
            await until(lambda: sets_served() == {"typo"}, SETTLE_S, "the workers to follow the fixed resource")

            # the Lease lost: no more writes, at once
            await leader.stop(release=False)
            written = len(api.status_writes)
            put_slice(api, "kw-qwen-2", "kw-qwen", workers[1].port, ("qwen-1", False))
            await until(lambda: len(core.sets["typo"].workers) == 1, SETTLE_S, "a worker to leave")
            await asyncio.sleep(0.5)
            assert len(api.status_writes) == written
        finally:
            await leader.stop(release=False)
            await watcher.stop()
            await status.stop()
            await core.stop()
            for worker in workers:
                worker.stop()

    asyncio.run(main())


def test_inference_pools_restrict_picks(api, kubeconfig):
    pool = {"apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferencePool"}
    api.put(CRDS, NS, "inferencepools", {**pool, "metadata": {"name": "only-b"}, "spec": {"workerSets": ["b"]}})
    labelled = {"selector": {"matchLabels": {"tier": "x"}}, "targetPortName": "alt"}
    api.put(CRDS, NS, "inferencepools", {**pool, "metadata": {"name": "tier-x"}, "spec": labelled})
    api.put(CRDS, NS, "inferencepools", {**pool, "metadata": {"name": "broken"}, "spec": {"targetPortName": "http"}})

    def cfg_with(policy: bool) -> RouterConfig:
        cfg = RouterConfig.model_validate(
            {
                "listen": "127.0.0.1:0",
                "mock_mode": True,
                "profile": [{"name": "p"}],
                "workerset": [{"name": n, "profile": "p", "kv_block_size": BS} for n in ("a", "b")],
                "policy": {"enabled": policy, "namespace": NS},
            }
        )
        sets = tuple(
            ws.model_copy(update={"workers": (Worker(worker_id_str=f"{ws.name}0", worker_id_num=i, model_name="m"),)})
            for i, ws in enumerate(cfg.workerset)
        )
        return cfg.model_copy(update={"workerset": sets})

    async def pick_in(core: RouterCore, pool: str, n: int = 8) -> set[tuple[str, str]]:
        got = set()
        for i in range(n):
            r = await core.pick(PickInput(model="m", token_ids=[i, i + 1], inference_pool=pool))
            got.add((r.worker_id, r.endpoint))
        return got

    async def main():
        client = client_for(kubeconfig)
        cfg = cfg_with(policy=True)
        core = RouterCore(cfg, metrics=RouterMetrics(cfg))
        status = StatusWriter(client, None, every_s=0.1)  # no leader election: always writes
        pools = PoolWatcher(client, core, cfg, status, retry_s=0.1)
        with pytest.raises(PickError) as e:
            await pick_in(core, "only-b")
        assert e.value.kind == "unavailable" and "not listed yet" in e.value.message
        status.start()
        pools.start()
        try:
            await until(lambda: core.pools is not None, SETTLE_S, "the pools")
            assert await pick_in(core, "only-b") == {("b0", "")}
            assert {w for w, _ in await pick_in(core, "")} == {"a0"}  # mock: the first set serving m
            with pytest.raises(PickError) as e:
                await pick_in(core, "tier-x")  # no worker has the label
            assert e.value.kind == "not_found" and "InferencePool kiln/tier-x" in e.value.message
            labels = WorkerMeta({"tier": "x"}, {"http": 8000, "alt": 9000})
            pod = Worker(
                worker_id_str="pod-x", worker_id_num=7, model_name="m", pod_ip="10.0.0.9", endpoint="10.0.0.9:8000"
            )
            await core.add_worker("a", pod, labels)
            assert await pick_in(core, "tier-x") == {("pod-x", "10.0.0.9:9000")}  # the pool's target port
            assert await pick_in(core, "kiln/only-b") == {("b0", "")}
            for name, kind in (("nope", "not_found"), ("broken", "not_found")):
                with pytest.raises(PickError) as e:
                    await pick_in(core, name)
                assert e.value.kind == kind and "no InferencePool named" in e.value.message
            names = ("broken", "only-b", "tier-x")
            await until(lambda: all(accepted(api, "inferencepools", n) for n in names), SETTLE_S, "the pools' status")
            assert accepted(api, "inferencepools", "broken")["reason"] == "Invalid"
            assert accepted(api, "inferencepools", "only-b")["status"] == "True"
            await until(
                lambda: (api.get(CRDS, NS, "inferencepools", "tier-x").get("status") or {}).get("workers") == 1,
                5,
                "count",
            )
            api.delete(CRDS, NS, "inferencepools", "only-b")
            await until(lambda: ("kiln", "only-b") not in pools.pools, SETTLE_S, "the deleted pool")
            with pytest.raises(PickError):
                await pick_in(core, "only-b")
        finally:
            await pools.stop()
            await status.stop()

        off = cfg_with(policy=False)  # the pool is not looked at: load alone
        core = RouterCore(off, metrics=RouterMetrics(off))
        assert {w for w, _ in await pick_in(core, "only-b")} == {"a0"}  # as without a pool

    asyncio.run(main())


def test_router_process_with_discovery_resources_and_policy(api, kubeconfig, tmp_path):
    pool = {"apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferencePool"}
    api.put(CRDS, NS, "inferenceworkersets", worker_set_cr("qwen", modelName="m2", serviceName="kw-qwen"))
    api.put(CRDS, NS, "inferencepools", {**pool, "metadata": {"name": "q"}, "spec": {"workerSets": ["qwen"]}})
    put_slice(api, "kw-qwen-1", "kw-qwen", 8123, ("qwen-0", True))
    api.unavailable = True
    election = {"enabled": True, "lease_duration_secs": 3, "renew_grace_secs": 1, "retry_secs": 1}
    path = router_config(
        tmp_path / "r",
        kubernetes={"enabled": True, "namespace": NS},
        policy={"enabled": True, "namespace": NS},
        leader_election=election,
    )
    router = RouterProcess(path, KUBECONFIG=str(kubeconfig), POD_NAME="router")
    try:
        assert router.get("/readyz").status_code == 503  # nothing listed yet
        api.unavailable = False
        wait_until(lambda: router.get("/readyz").status_code == 200, 20, "ready")
        workers = lambda: [w["worker"] for w in router.get("/api/state").json()["workers"]]  # noqa: E731
        wait_until(lambda: "qwen-0" in workers(), 20, "the InferenceWorkerSet's worker")  # (not waited for by ready)
        pick = router.router.Pick(router_pb2.PickRequest(model="m2", token_ids=[1, 2, 3]), timeout=10)
        assert (pick.worker_id, pick.endpoint, pick.workerset) == ("qwen-0", "127.0.0.1:8123", "qwen")
        pick = router.router.Pick(router_pb2.PickRequest(model="m2", token_ids=[1], inference_pool="q"), timeout=10)
        assert pick.worker_id == "qwen-0"
        code, details = code_of(
            router.router.Pick, router_pb2.PickRequest(model="m", token_ids=[1], inference_pool="q")
        )
        assert code == grpc.StatusCode.NOT_FOUND and "InferencePool kiln/q" in details
        code, details = code_of(
            router.router.Pick, router_pb2.PickRequest(model="m", token_ids=[1], inference_pool="x")
        )
        assert code == grpc.StatusCode.NOT_FOUND and "no InferencePool named 'x'" in details
        wait_until(lambda: accepted(api, "inferenceworkersets", "qwen") is not None, 20, "the leader's status write")
        assert accepted(api, "inferencepools", "q")["status"] == "True"
    finally:
        code, output = router.stop()
    assert code == 0, output[-3000:]


def test_label_selectors():
    from kiln.router.selectors import match_expressions, parse_selector

    labels = {"team": "a", "tier": "x", "app.kubernetes.io/name": "kiln"}
    for text, want in [
        ("", True),
        ("team=a", True),
        ("team==b", False),
        ("team!=b,tier", True),
        ("!tier", False),
        ("!gpu, app.kubernetes.io/name = kiln", True),
        ("team in (a, b),tier notin (y)", True),
        ("team notin (a)", False),
    ]:
        assert parse_selector(text)(labels) is want, text
    for bad in ("team in a", "=a", "a=b=c"):
        with pytest.raises(ValueError, match="cannot read label selector term"):
            parse_selector(bad)
    expressions = [{"key": "tier", "operator": "In", "values": ["x", "y"]}, {"key": "gpu", "operator": "DoesNotExist"}]
    assert match_expressions({"matchLabels": {"team": "a"}, "matchExpressions": expressions})(labels)
    assert not match_expressions({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]})(labels)
    assert match_expressions({})(labels) and not match_expressions({"matchLabels": {"x": "1"}})(labels)
    with pytest.raises(ValueError, match="operator"):
        match_expressions({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["b"]}]})
