"""The router core's bookkeeping in process: requests in flight, observations, body budgets and
tenant labels, with a stand-in scraper so that scrape timing is the test's to choose; and workers
joining and leaving at run time, with the real ingest and scraper."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from kiln.engine.kv_events import KVEventPublisher
from kiln.kv_wire import AllBlocksCleared, BlockStored
from kiln.router.bodies import BodyBudget, BodyRejected
from kiln.router.bookkeeping import InFlight, Observation, Observations
from kiln.router.config import RouterConfig, Worker
from kiln.router.core import RouterCore, derive_worker_id_num
from kiln.router.ingest import KVIngest
from kiln.router.kv_index import block_keys
from kiln.router.metrics import RouterMetrics, tenant_labeller
from kiln.router.scrape import Scraper, WorkerHealth
from kiln.router.types import PickError, PickInput

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
    assert inflight.end("b", now=2.5) and not inflight.end("b", now=2.6)
    assert inflight.count(0) == 0 and inflight.leading_blocks(0, keys, 0) == 0
    assert inflight.finished(0) == 0  # "b" ended in flight: no scrape counted it
    # "a" was counted by the scrape that began at 1.5; it ends at 3.0, which that scrape cannot know
    assert inflight.end("a", now=3.0) and inflight.finished(0) == 1
    inflight.settle(0, scrape_started_at=2.9)  # a scrape that began before the end still counts it
    assert inflight.finished(0) == 1
    inflight.settle(0, scrape_started_at=3.1)  # one that began after it saw it gone
    assert inflight.finished(0) == 0 and not inflight.end("a", now=4.0)
    inflight.add("c", 1, keys, now=1.0)
    inflight.add("c", 2, keys[:1], now=5.0)  # a reused id moves
    assert inflight.count(1) == 0 and inflight.count(2) == 1
    assert inflight.expire(sent_before=6.0) == 1 and len(inflight) == 0
    inflight.add("d", 3, keys, now=7.0)
    inflight.settle(3, scrape_started_at=8.0)
    inflight.end("d", now=9.0)
    assert inflight.finished(3) == 1 and inflight.drop_worker(3) == 0 and inflight.finished(3) == 0


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


# ---- workers that come and go, with the real ingest, scraper and tokenization -----------------------------


def test_workers_added_and_removed_at_run_time():
    pubs = [KVEventPublisher("tcp://127.0.0.1:*") for _ in range(2)]
    cfg = config()
    cfg = cfg.model_copy(update={"workerset": (cfg.workerset[0].model_copy(update={"workers": ()}),)})
    prompt = list(range(3 * BS))

    def worker(i: int) -> Worker:
        num = derive_worker_id_num(f"kiln/pod-{i}")
        return Worker(worker_id_str=f"pod-{i}", worker_id_num=num, model_name="m", zmq_endpoint=pubs[i].endpoint)

    async def until(predicate, what: str) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    async def main():
        core = RouterCore.from_config(cfg, RouterMetrics(cfg))
        assert isinstance(core.ingests["a"], KVIngest) and isinstance(core.scraper, Scraper)
        await core.start()
        try:
            with pytest.raises(PickError) as e:
                await core.pick(PickInput(model="m", token_ids=prompt))
            assert e.value.kind == "not_found"
            w0, w1 = worker(0), worker(1)
            await core.add_worker("a", w0)
            await core.add_worker("a", w1)
            assert set(core.state()["workers"][i]["worker"] for i in range(2)) == {"pod-0", "pod-1"}
            assert core.state()["worker_sets"][0]["workers"] == 2
            ingest = core.ingests["a"]
            while ingest.stats(w0.worker_id_num).last_seq is None:  # (a SUB joining late misses messages)
                pubs[0].publish([AllBlocksCleared()])
                await asyncio.sleep(0.02)
            pubs[0].publish([BlockStored([1, 2, 3], None, prompt, BS)])
            await until(lambda: core.sets["a"].index.blocks_of(w0.worker_id_num) == 3, "w0's blocks")
            first = await core.pick(PickInput(model="m", token_ids=prompt))
            assert (first.worker_id, first.cached_blocks) == ("pod-0", 3)
            assert core.inflight.count(w0.worker_id_num) == 1

            assert await core.remove_worker(w0.worker_id_num) and not await core.remove_worker(w0.worker_id_num)
            assert core.inflight.count(w0.worker_id_num) == 0 and core.sets["a"].index.blocks_of(w0.worker_id_num) == 0
            assert w0.worker_id_num not in core.ingests["a"].status() and w0.worker_id_num not in core.scraper.states()
            assert core.feedback(first.request_id, ttft_ms=100.0)  # feedback for a worker that left is still taken
            picks = {(await core.pick(PickInput(model="m", token_ids=prompt))).worker_id for _ in range(5)}
            assert picks == {"pod-1"}

            with pytest.raises(ValueError, match="taken"):  # ids are unique across worker sets
                await core.add_worker_set(cfg.workerset[0].model_copy(update={"name": "b", "workers": (w1,)}))
            assert "b" not in core.sets
            await core.remove_worker_set("a")
            assert not core.workers and not core.ingests and core.state()["worker_sets"] == []
        finally:
            await core.stop()
            for pub in pubs:
                pub.close()

    asyncio.run(main())


def test_derived_worker_ids_are_stable_and_step_past_taken_ones():
    num = derive_worker_id_num("kiln/pod-0")
    assert num == derive_worker_id_num("kiln/pod-0") >= 1 << 40 and num != derive_worker_id_num("kiln/pod-1")
    assert derive_worker_id_num("kiln/pod-0", {num}) == num + 1
    assert derive_worker_id_num("kiln/pod-0", {num, num + 1}) == num + 2


def test_feedback_calibrates_the_worker_sets_predictor():
    """TTFTs fed back where a queued request costs 3x queue_ms_per_entry: once MIN_OBSERVATIONS came, the
    worker holding a long prefix behind one queued request loses the pick to an idle worker without it."""
    from kiln.router.calibration import MIN_OBSERVATIONS

    core, scraper = core_with(config())
    p = core.config.profile[0].predictor
    prefix = list(range(400))  # 100 blocks: 2 s of prefill at 20 ms a block
    core.sets["a"].index.store(0, list(range(1, 101)), None, prefix)

    def load(waiting: dict[int, int]) -> None:  # full batches (no running penalty)
        for n, w in waiting.items():
            scraper.states[n] = dataclasses.replace(scraper.states[n], running=5, waiting=w)

    load({0: 1, 1: 0, 2: 0})
    first = pick(core, prefix)
    assert first.worker_id == "w0"  # uncalibrated: the prefix outweighs the queue
    routed = core.metrics.render().decode()  # the routed traffic's cache hits, as the picks predicted them
    assert f'kiln_router_pick_cached_blocks_total{{worker="w0",workerset="a"}} {float(first.cached_blocks)}' in routed
    assert f'kiln_router_pick_prompt_blocks_total{{worker="w0",workerset="a"}} {float(first.prompt_blocks)}' in routed
    assert first.cached_blocks == 100 and first.prompt_blocks == 100
    assert core.feedback(first.request_id, failed=True)  # (a failed request: nothing to calibrate on)
    rng = random.Random(0)
    for i in range(MIN_OBSERVATIONS + 20):
        waiting = rng.randrange(4)
        load({n: waiting for n in range(3)})
        tokens = prefix[: 4 * rng.randrange(10, 101)] if i % 3 == 0 else [5000 + i] * 4 * rng.randrange(10, 101)
        r = pick(core, tokens, tenant="acme")
        per_block = p.attention_uncached_block_ms + p.attention_uncached_per_every_block_ms * r.prompt_blocks
        ttft = p.base_ms + 3 * p.queue_ms_per_entry * waiting + (r.prompt_blocks - r.cached_blocks) * per_block
        assert core.feedback(r.request_id, ttft_ms=ttft, e2e_ms=ttft + 1000.0)
    view = core.state()["worker_sets"][0]["calibration"]
    assert view["active"] and view["observations"] == MIN_OBSERVATIONS + 20
    assert view["queue_scale"] == pytest.approx(3.0, abs=0.1) and view["prefill_scale"] == pytest.approx(1.0, abs=0.1)
    assert core.snapshot()["worker_sets"][0]["calibration"] == view
    load({0: 1, 1: 0, 2: 0})
    calibrated = pick(core, prefix)
    assert calibrated.worker_id in ("w1", "w2") and calibrated.cached_blocks == 0
    assert any(w["e2e_ms"] is not None for w in core.state()["workers"])
    exported = RouterMetrics(core.config, core.snapshot).render().decode()  # (as /metrics reads the state)
    samples = {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in exported.splitlines()
        if not line.startswith("#")
    }
    assert samples['kiln_router_calibration_scale{term="queue",workerset="a"}'] == view["queue_scale"]
    assert samples['kiln_router_calibration_scale{term="prefill",workerset="a"}'] == view["prefill_scale"]
    assert samples['kiln_router_calibration_offset_ms{workerset="a"}'] == view["offset_ms"]
    assert samples['kiln_router_calibration_batch_ms{workerset="a"}'] == view["batch_ms"]
    assert samples['kiln_router_calibration_observations_total{workerset="a"}'] == MIN_OBSERVATIONS + 20
