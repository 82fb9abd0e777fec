"""The router core's bookkeeping in process: requests in flight, observations, body budgets and
tenant labels, with a stand-in scraper so that scrape timing is the test's to choose."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kiln.router.bodies import BodyBudget, BodyRejected
from kiln.router.bookkeeping import InFlight, Observation, Observations
from kiln.router.config import RouterConfig, Worker
from kiln.router.core import PickError, PickInput, RouterCore
from kiln.router.kv_index import block_keys
from kiln.router.metrics import RouterMetrics, tenant_labeller
from kiln.router.scrape import WorkerHealth

BS = 4


def config(**top) -> RouterConfig:
    """Three workers of model m in worker set a (attached as loading the workers file would)."""
    cfg = RouterConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "profile": [{"name": "p", "predictor": {"attention_uncached_block_ms": 20.0}}],
            "workerset": [{"name": "a", "profile": "p", "kv_block_size": BS}],
            **top,
        }
    )
    workers = tuple(
        Worker(worker_id_str=f"w{i}", worker_id_num=i, model_name="m", zmq_endpoint="tcp://x:1") for i in range(3)
    )
    return cfg.model_copy(update={"workerset": (cfg.workerset[0].model_copy(update={"workers": workers}),)})


class FakeScraper:
    """Every worker alive and idle until told otherwise."""

    def __init__(self, nums) -> None:
        self.states = {n: WorkerHealth(n, f"w{n}", "a", "m", True) for n in nums}

    def state(self, num: int) -> WorkerHealth:
        return self.states[num]

    def scraped(self, num: int) -> None:
        """A scrape that began now has completed."""
        old = self.states[num]
        self.states[num] = dataclasses.replace(old, scrape_started_at=time.monotonic(), epoch=old.epoch + 1)

    def kill(self, num: int) -> None:
        self.states[num] = dataclasses.replace(self.states[num], alive=False)


def core_with(cfg: RouterConfig) -> tuple[RouterCore, FakeScraper]:
    scraper = FakeScraper(range(3))
    return RouterCore(cfg, metrics=RouterMetrics(cfg), scraper=scraper), scraper


def pick(core: RouterCore, tokens, **kw):
    return asyncio.run(core.pick(PickInput(model="m", token_ids=tokens, **kw)))


def test_requests_in_flight_spread_load_until_a_scrape_counts_them():
    core, scraper = core_with(config())
    cold = list(range(1000, 1040))
    first = pick(core, cold)
    second = pick(core, cold)  # the first is in flight on its worker: a running penalty there
    assert first.worker_id != second.worker_id
    assert core.inflight.count(first.worker_id_num) == 1
    scraper.scraped(first.worker_id_num)  # a scrape begun after the pick has completed: it counts it
    third = pick(core, list(range(2000, 2040)))
    assert core.inflight.count(first.worker_id_num) == 0
    assert third.worker_id != second.worker_id  # the second is still in flight
    assert core.feedback(second.request_id, ttft_ms=500.0)
    assert core.inflight.count(second.worker_id_num) == 0
    assert not core.feedback(second.request_id)


def test_a_prefix_in_flight_counts_as_cached():
    core, _ = core_with(config())
    long = list(range(400))  # 100 blocks: 2 s of prefill, far more than one request's running penalty
    first = pick(core, long)
    again = pick(core, long + [1, 2, 3, 4])
    assert again.worker_id == first.worker_id and again.cached_blocks == 0  # held: none; in flight: all
    off = config(
        profile=[
            {"name": "p", "predictor": {"attention_uncached_block_ms": 20.0}, "picker": {"inflight_tracking": False}}
        ]
    )
    core, _ = core_with(off)
    first = pick(core, long)
    assert pick(core, long).worker_id != first.worker_id


def test_dead_workers_and_unknown_models():
    core, scraper = core_with(config())
    for n in range(3):
        scraper.kill(n)
    with pytest.raises(PickError) as e:
        pick(core, [1, 2, 3, 4])
    assert e.value.kind == "unavailable" and "w0 dead, w1 dead, w2 dead" in e.value.message
    with pytest.raises(PickError) as e:
        asyncio.run(core.pick(PickInput(model="other", token_ids=[1])))
    assert e.value.kind == "not_found"
    with pytest.raises(PickError) as e:
        asyncio.run(core.pick(PickInput(model="m")))
    assert e.value.kind == "invalid"


def test_in_flight_bookkeeping():
    inflight = InFlight()
    keys = block_keys(list(range(16)), BS)
    inflight.add("a", 0, keys[:2], now=1.0)
    inflight.add("b", 0, keys, now=2.0)
    assert inflight.count(0) == 2 and inflight.leading_blocks(0, keys, 0) == 4
    assert inflight.leading_blocks(0, keys, 3) == 1 and inflight.leading_blocks(1, keys, 0) == 0
    inflight.settle(0, scrape_started_at=1.5)  # counted "a" only
    assert inflight.count(0) == 1 and inflight.leading_blocks(0, keys, 0) == 4
    assert inflight.end("b") and not inflight.end("b")
    assert inflight.count(0) == 0 and inflight.leading_blocks(0, keys, 0) == 0
    inflight.add("c", 1, keys, now=1.0)
    inflight.add("c", 2, keys[:1], now=5.0)  # a reused id moves
    assert inflight.count(1) == 0 and inflight.count(2) == 1
    assert inflight.expire(sent_before=6.0) == 1 and len(inflight) == 0


def test_observations_expire():
    held = Observations(ttl_s=10)
    for i, at in enumerate((0.0, 5.0, 9.0)):
        held.add(Observation(f"r{i}", 0, "w0", "a", 100.0, at))
    assert [o.request_id for o in held.expire(now=15.5)] == ["r0", "r1"]
    assert held.pop("r2") is not None and held.pop("r2") is None


def test_body_budget():
    budget = BodyBudget(max_total_bytes=10, max_request_bytes=6)
    with budget.hold() as a:
        a.add(b"12345")
        with pytest.raises(BodyRejected) as e:
            a.add(b"67")
        assert e.value.reason == "too_large"
        with budget.hold() as b:
            with pytest.raises(BodyRejected) as e:
                b.add(b"123456")
            assert e.value.reason == "budget"
            b.add(b"12345")
            assert (budget.bytes, budget.count) == (10, 2)
        assert (budget.bytes, budget.count) == (5, 1)
    assert (budget.bytes, budget.count) == (0, 0)


def test_tenant_labels():
    assert tenant_labeller("none") is None
    assert tenant_labeller("all")("acme") == "acme" and tenant_labeller("all")("") == "unknown"
    listed = tenant_labeller(("acme", "beta"))
    assert [listed(t) for t in ("acme", "beta", "zeta", "")] == ["acme", "beta", "other", "other"]
