"""KV-aware routing against round-robin and random: four Kiln workers, one workload, one run.

Setup: 4 `python -m kiln.server` workers on loopback (the default model), each with a KV pool too
small for all 16 shared prefixes but, four together, big enough for them; KV events on. The
router (`python -m kiln.router`, default profile, metrics scraped every 200 ms) runs for the
`router` policy.

Workload: 16 tenants, each a long system prompt (deterministic text), and many users with short
distinct questions; Poisson arrivals at --rate (seeded), each a streaming chat completion of
--max-tokens tokens (greedy, ignore_eos). Every policy replays the same schedule and requests:
  router       gRPC Pick with the messages, send to the endpoint it names, then Feedback;
  round-robin  request i to worker i mod 4;
  random       a seeded uniform draw.
The workers are warmed up first (prompts unrelated to the workload: rounds until one compiles
nothing, then a rehearsal). Each policy's requests carry a cache_salt of their own, so no policy
can hit a block another one left behind: each starts with no workload prefix cached, on pools
full of blocks it cannot use. The router policy runs first, so that the router (which keys blocks
by their tokens, not by salt) never sees another policy's blocks.

Per policy: prefix-hit rate (the workers' own usage.prompt_tokens_details.cached_tokens over
prompt tokens), client-side TTFT p50/p90 (from the request's arrival, the router's Pick
included), completed requests/s and output tok/s over the run; one table with router/round-robin
and router/random ratios. Then the pick's latency: in process (RouterCore.pick: prefix match,
prediction and pick, bookkeeping included) over 64 workers holding 10,000 blocks each, and the
gRPC Pick round trip against the live router with token ids.

`--calibrate N` first sends N requests of other tenants through the router (with Feedback), so that
its measured run starts with the predictor's calibration converged rather than from the coefficients.

    python bench/router.py [--quick] [--requests N] [--rate R] [--policies router,round-robin,random]
                           [--calibrate N]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from router_index import BLOCK, DOC_BLOCKS, build

from kiln.router.config import RouterConfig, Worker
from kiln.router.core import PickInput, RouterCore
from kiln.router.metrics import RouterMetrics
from kiln.router.proto import router_pb2, router_pb2_grpc
from kiln.router.scrape import WorkerHealth

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
TENANTS = 16
POLICIES = ("router", "round-robin", "random")

# small buckets, as the tests use (few step shapes to compile), and a small KV pool (--kv-blocks)
ENGINE = {
    "KILN_ENGINE_DECODE_ROW_BUCKETS": "1,2,4,8",
    "KILN_ENGINE_PREFILL_TOKEN_BUCKETS": "32,128",
    "KILN_ENGINE_MAX_NUM_BATCHED_TOKENS": "128",
    "KILN_ENGINE_MAX_NUM_SEQS": "8",
}

WORDS = (
    "account order refund policy shipping invoice customer product warranty support ticket billing "
    "plan upgrade device network password security privacy data export report schedule delivery "
    "store return exchange discount member points balance payment card bank transfer limit fee "
    "contract service region language escalate agent manager review rating feedback survey quality "
    "always never politely briefly clearly confirm verify explain apologise offer suggest check "
    "the a to of and in for with on by before after when if unless only every each any"
).split()
TOPICS = (
    "my last order",
    "a refund",
    "my password",
    "the invoice",
    "shipping times",
    "my plan",
    "the warranty",
    "a discount code",
    "my points",
    "a late delivery",
    "the fee",
    "my card",
    "data export",
    "the app",
)
ASKS = ("Can you help with {}?", "What should I do about {}?", "I have a question about {}.", "Please explain {}.")


# ---- workload ------------------------------------------------------------------------------------


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(1000 + tenant)
    text = [f"You are the assistant of tenant {tenant} (company {rng.randrange(10**6):06d})."]
    while len(" ".join(text).split()) < words:
        text.append(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 16))).capitalize() + ".")
    return " ".join(text)


@dataclasses.dataclass(frozen=True)
class Request:
    i: int
    at: float  # arrival, seconds after the run's start
    tenant: int
    messages: tuple[tuple[str, str], ...]
    draw: int  # the random policy's worker


def workload(n: int, rate: float, seed: int, system_words: int, tenant_base: int = 0) -> list[Request]:
    rng = random.Random(seed)
    systems = [system_prompt(tenant_base + t, system_words) for t in range(TENANTS)]
    out, at = [], 0.0
    for i in range(n):
        at += rng.expovariate(rate)
        tenant = rng.randrange(TENANTS)
        user = f"(user {i}) " + rng.choice(ASKS).format(rng.choice(TOPICS))
        out.append(Request(i, at, tenant, (("system", systems[tenant]), ("user", user)), rng.randrange(WORKERS)))
    return out


def warmup_messages(tag: int, user: int, system_words: int) -> list[dict]:
    """A prompt shaped like the workload's that shares none of its prefixes."""
    return [
        {"role": "system", "content": "Warm-up. " + system_prompt(100 + tag, system_words)},
        {"role": "user", "content": f"Warm-up question {user}."},
    ]


# ---- processes -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """SIGTERM to each, then wait; SIGKILL to those still running after `timeout`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def prom(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


class KilnWorker:
    """`python -m kiln.server` publishing KV events; output to a log file."""

    def __init__(self, n: int, tmp: Path, kv_blocks: int) -> None:
        self.n = n
        self.port, self.zmq, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"worker{n}-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(
            ENGINE,
            JAX_PLATFORMS="cpu",
            KILN_SERVER_PORT=str(self.port),
            KILN_SERVER_LOG_LEVEL="info",
            KILN_ENGINE_NUM_KV_BLOCKS=str(kv_blocks),
            # a wildcard host binds (a plain host would connect); the router connects to 127.0.0.1
            KILN_ENGINE_KV_EVENTS_ENDPOINT=f"tcp://*:{self.zmq}",
            KILN_ENGINE_KV_EVENTS_REPLAY_ENDPOINT=f"tcp://127.0.0.1:{self.replay}",
            KILN_TRAIN_DATA_DIR=str(tmp / f"data{n}-{self.port}"),
        )  # no job or eval of the user's resumes
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.server"], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_healthy(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.n} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"worker {self.n} did not become healthy")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def bucket_loads(self) -> int:
        """Step buckets built while serving so far (the engine logs each; none once its step set is warm)."""
        return self.log.read_text(errors="replace").count("built step bucket")

    def entry(self, model: str) -> dict:
        return {
            "worker_id_str": f"w{self.n}",
            "worker_id_num": self.n,
            "model_name": model,
            "zmq_endpoint": f"tcp://127.0.0.1:{self.zmq}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
            "metrics_url": self.url + "/metrics",
            "http_url": self.url,
        }


def start_workers(tmp: Path, kv_blocks: int) -> list[KilnWorker]:
    """Worker 0 first (it fills the persistent compilation cache), then the others (they load from it)."""
    workers = [KilnWorker(0, tmp, kv_blocks)]
    try:
        workers[0].wait_healthy()
        workers += [KilnWorker(n, tmp, kv_blocks) for n in range(1, WORKERS)]
        for w in workers[1:]:
            w.wait_healthy()
    except BaseException:
        stop([w.proc for w in workers])
        raise
    return workers


class RouterProc:
    def __init__(self, tmp: Path, workers: list[KilnWorker], model: str, poll_ms: int, profile: list[str]) -> None:
        wfile = tmp / "router-workers.toml"
        wfile.write_text(
            "".join(
                "[[workers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in w.entry(model).items())
                for w in workers
            )
        )
        config = tmp / "router.toml"
        config.write_text(
            f'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\nmetrics_poll_ms = {poll_ms}\n'
            '[[profile]]\nname = "default"\n'
            + "".join(f"{k} = {v}\n" for k, v in (item.split("=", 1) for item in profile))  # dotted keys
            + f'[[workerset]]\nname = "kiln"\nprofile = "default"\nkv_block_size = {BLOCK}\n'
            f"[workerset.discovery]\nworkers_file = {json.dumps(str(wfile))}\n"
        )
        self.log = tmp / "router.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.router", "--config", str(config)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.grpc = self._logged(r"gRPC listening on (\S+)")
        self.admin = "http://" + self._logged(r"admin HTTP listening on http://(\S+)")

    def _logged(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited:\n{self.log.read_text()[-3000:]}")
            if m := re.search(pattern, self.log.read_text()):
                return m.group(1)
            time.sleep(0.1)
        raise RuntimeError(f"the router did not log {pattern!r}")

    def state(self) -> dict:
        return httpx.get(self.admin + "/api/state", timeout=10).json()

    def wait_synced(self, workers: list[KilnWorker], model: str, timeout: float = 60) -> None:
        """Every worker alive, scraped and ingesting. The router replays a worker's past events when
        its first live batch arrives, so each worker gets a short prompt of its own to publish one."""
        deadline = time.monotonic() + timeout
        while not all(w["alive"] and w["scrape_epoch"] > 0 for w in self.state()["workers"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router does not see the workers: {self.state()}")
            time.sleep(0.2)
        for w in workers:
            body = {"model": model, "prompt": [2000 + w.n] * (2 * BLOCK), "max_tokens": 1}
            httpx.post(w.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        while httpx.get(self.admin + "/readyz", timeout=10).status_code != 200 or not all(
            w["index_blocks"] > 0 for w in self.state()["workers"]
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not ingest the workers' KV events: {self.state()}")
            time.sleep(0.2)


# ---- requests ------------------------------------------------------------------------------------


async def stream_chat(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int, salt: str | None = None
) -> dict:
    body = {
        "cache_salt": salt,
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, usage = None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            usage = event.get("usage") or usage
    return {
        "first": first,
        "end": time.perf_counter(),
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "completion": usage["completion_tokens"],
    }


async def warm_up(workers: list[KilnWorker], model: str, args, limit: int = 2) -> int:
    """Rounds on every worker at once, until a round compiles (or loads) no step bucket on any worker,
    `limit` rounds at most. A round sends 1 to 8 requests at once, cold prompts and cache hits."""

    def counters():
        return [prom(w.metrics(), "kiln:compiled_step_buckets") for w in workers]

    async def round_on(client: httpx.AsyncClient, w: KilnWorker, n: int) -> None:
        def chat(tag: int, user: int) -> dict:
            return stream_chat(client, w.url, model, warmup_messages(tag, user, args.system_words), 8)

        async def later(delay: float, request) -> None:
            await asyncio.sleep(delay)
            await request

        a, b, c, d = (1000 * w.n + 10 * n + k for k in range(4))
        await chat(a, 0)  # cold, alone
        await asyncio.gather(chat(b, 0), chat(c, 0))  # cold, two at once
        # cache hits, with a cold prompt arriving while they decode; then 8 hits, staggered
        await asyncio.gather(*(chat(a, u) for u in range(1, 5)), later(0.3, chat(d, 0)))
        await asyncio.gather(*(later(0.1 * k, chat((b, c)[k % 2], 10 + k)) for k in range(8)))

    async with httpx.AsyncClient(timeout=900) as client:
        for n in range(1, limit + 1):
            before = counters()
            await asyncio.gather(*(round_on(client, w, n) for w in workers))
            if counters() == before:
                return n
    return limit


async def run_policy(
    policy: str,
    requests: list[Request],
    workers: list[KilnWorker],
    model: str,
    args,
    router: RouterProc | None,
    salt: str | None = None,
) -> dict:
    salt = salt or f"bench-{policy}"
    results: list[dict] = []
    picks: list[dict] = []
    channel = grpc.aio.insecure_channel(router.grpc) if router else None
    stub = router_pb2_grpc.RouterStub(channel) if channel else None
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=64)
    by_endpoint = {w.url.removeprefix("http://"): w.n for w in workers}
    outstanding = [0] * WORKERS  # requests sent to each worker and not finished

    async def one(req: Request, client: httpx.AsyncClient, t0: float) -> None:
        arrival = time.perf_counter()
        messages = [{"role": r, "content": c} for r, c in req.messages]
        pick = None
        try:
            if policy == "router":
                pick = await stub.Pick(
                    router_pb2.PickRequest(
                        model=model,
                        messages=[router_pb2.Message(role=r, content=c) for r, c in req.messages],
                        request_id=f"r{req.i}",
                        tenant=f"t{req.tenant}",
                    ),
                    timeout=60,
                )
                n = by_endpoint[pick.endpoint]
            elif policy == "sticky":  # (the rehearsal's) each tenant on one worker
                n = req.tenant % WORKERS
            else:
                n = req.i % WORKERS if policy == "round-robin" else req.draw
            sent = time.perf_counter()
            busy = (outstanding[n], min(outstanding))  # the chosen worker's requests and the idlest's
            outstanding[n] += 1
            try:
                out = await stream_chat(client, workers[n].url, model, messages, args.max_tokens, salt)
            finally:
                outstanding[n] -= 1
        except Exception as e:  # counted; the run goes on
            results.append({"failed": repr(e)})
            if pick is not None:
                await stub.Feedback(router_pb2.FeedbackRequest(request_id=pick.request_id, failed=True), timeout=30)
            return
        results.append({**out, "worker": n, "ttft": out["first"] - arrival, "busy": busy})
        if pick is not None:
            await stub.Feedback(
                router_pb2.FeedbackRequest(
                    request_id=pick.request_id, ttft_ms=(out["first"] - sent) * 1e3, e2e_ms=(out["end"] - sent) * 1e3
                ),
                timeout=30,
            )
            picks.append(
                {
                    "worker": n,
                    "reason": pick.reason,
                    "claimed": pick.cached_blocks * BLOCK,
                    "cached": out["cached"],
                    "pick_ms": (sent - arrival) * 1e3,
                    "predicted_ms": pick.predicted_ms,
                    "ttft_ms": (out["first"] - sent) * 1e3,
                }
            )

    samples: list[list[dict]] = []

    async def sample_router(client: httpx.AsyncClient) -> None:  # what the router sees, every second
        while True:
            state = (await client.get(router.admin + "/api/state", timeout=10)).json()
            keys = ("running", "waiting", "inflight", "kv_usage", "predicted_ms", "index_blocks")
            samples.append([{k: w[k] for k in keys} for w in state["workers"]])
            await asyncio.sleep(1.0)

    before = [w.metrics() for w in workers]
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sampler = asyncio.create_task(sample_router(client)) if router else None
        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            delay = t0 + req.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, client, t0)))
        await asyncio.gather(*tasks)
        if sampler is not None:
            sampler.cancel()
    if channel is not None:
        await channel.close()
    after = [w.metrics() for w in workers]
    ok = [r for r in results if "failed" not in r]
    span = max(r["end"] for r in ok) - t0 if ok else float("nan")
    ttfts = sorted(r["ttft"] * 1e3 for r in ok)
    return {
        "ok": len(ok),
        "failed": [r["failed"] for r in results if "failed" in r],
        "hit": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "ttft_p50": quantile(ttfts, 0.5),
        "ttft_p90": quantile(ttfts, 0.9),
        "ttft_p99": quantile(ttfts, 0.99),
        "rps": len(ok) / span,
        "tps": sum(r["completion"] for r in ok) / span,
        "span": span,
        "per_worker": [sum(r["worker"] == n for r in ok) for n in range(WORKERS)],
        # sent to a worker with more requests outstanding than the idlest had, by 2 or more
        "piled": sum(r["busy"][0] - r["busy"][1] >= 2 for r in ok),
        "max_outstanding": max((r["busy"][0] + 1 for r in ok), default=0),
        "compile_waits": sum(
            prom(a, "kiln:step_compile_waits_total") - prom(b, "kiln:step_compile_waits_total")
            for a, b in zip(after, before, strict=True)
        ),
        "preempted": sum(
            prom(a, "vllm:num_preemptions_total") - prom(b, "vllm:num_preemptions_total")
            for a, b in zip(after, before, strict=True)
        ),
        "picks": picks,
        "requests": ok,
        "router_samples": samples,
    }


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


async def render_all(url: str, model: str, requests: list[Request]) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=60) as client:
        out = []
        for req in requests:
            body = {"model": model, "messages": [{"role": r, "content": c} for r, c in req.messages]}
            r = await client.post(url + "/render", json=body)
            r.raise_for_status()
            out.append(r.json()["prompt_token_ids"])
        return out


def hit_ceiling(requests: list[Request], ids: list[list[int]]) -> tuple[float, float]:
    """The best hit rate possible (each tenant's shared full blocks cached from its second request on)
    and the mean length of a tenant's shared prefix in tokens."""
    first: dict[int, list[int]] = {}
    shared: dict[int, int] = {}
    for req, p in zip(requests, ids, strict=True):
        if req.tenant not in first:
            first[req.tenant], shared[req.tenant] = p, len(p)
        else:
            q = min(shared[req.tenant], len(p))
            shared[req.tenant] = next((k for k in range(q) if first[req.tenant][k] != p[k]), q)
    best, seen = 0, set()
    for req in requests:
        if req.tenant in seen:
            best += shared[req.tenant] // BLOCK * BLOCK
        seen.add(req.tenant)
    repeated = [shared[t] for t in shared if sum(r.tenant == t for r in requests) > 1]
    return best / sum(map(len, ids)), statistics.mean(repeated or [0])


async def grpc_pick_latency(router: RouterProc, model: str, ids: list[list[int]], n: int) -> list[float]:
    """Pick round trips with token ids (each followed by an untimed Feedback, so nothing stays in flight)."""
    async with grpc.aio.insecure_channel(router.grpc) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        times = []
        for k in range(n + 20):
            t = time.perf_counter()
            pick = await stub.Pick(router_pb2.PickRequest(model=model, token_ids=ids[k % len(ids)]), timeout=10)
            if k >= 20:  # the first ones warm the channel up
                times.append((time.perf_counter() - t) * 1e3)
            await stub.Feedback(router_pb2.FeedbackRequest(request_id=pick.request_id), timeout=10)
        return times


# ---- in-process pick -----------------------------------------------------------------------------


class StaticScraper:
    """Fixed, varied loads for the in-process pick (what RouterCore reads of a Scraper)."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.states = {
            w: WorkerHealth(
                w,
                f"w{w}",
                "bench",
                "m",
                True,
                running=rng.randrange(6),
                waiting=rng.randrange(3),
                kv_usage=rng.random(),
                scrape_started_at=0.0,
            )
            for w in range(n)
        }

    def state(self, num: int) -> WorkerHealth:
        return self.states[num]


def in_process_pick(workers: int, blocks: int, picks: int) -> tuple[float, list[float], list[float]]:
    """RouterCore.pick over an index of `workers` x `blocks` (bench/router_index.py's): ms per pick."""
    rng = random.Random(0)
    docs = [[rng.randrange(150_000) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(200)]
    t0 = time.perf_counter()
    index = build(workers, blocks, docs, rng)
    built = time.perf_counter() - t0
    cfg = RouterConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "profile": [{"name": "default"}],
            "workerset": [{"name": "bench", "profile": "default", "kv_block_size": BLOCK}],
        }
    )
    ws = tuple(
        Worker(worker_id_str=f"w{w}", worker_id_num=w, model_name="m", zmq_endpoint="tcp://x:1") for w in range(workers)
    )
    cfg = cfg.model_copy(update={"workerset": (cfg.workerset[0].model_copy(update={"workers": ws}),)})
    core = RouterCore(cfg, metrics=RouterMetrics(cfg), scraper=StaticScraper(workers, rng))
    core.sets["bench"].index = index
    prompts = []
    for _ in range(picks + 100):
        doc = rng.choice(docs)
        cut = rng.randrange(1, DOC_BLOCKS + 1) * BLOCK
        prompts.append(doc[:cut] + [rng.randrange(150_000) for _ in range(rng.randrange(65) * BLOCK)])

    async def go():
        wall, cpu = [], []
        for k, p in enumerate(prompts):
            t, c = time.perf_counter_ns(), time.thread_time_ns()
            result = await core.pick(PickInput(model="m", token_ids=p))
            if k >= 100:  # the first ones warm up
                cpu.append((time.thread_time_ns() - c) / 1e6)
                wall.append((time.perf_counter_ns() - t) / 1e6)
            core.feedback(result.request_id)
        return wall, cpu

    wall, cpu = asyncio.run(go())
    return built, wall, cpu


# ---- main ----------------------------------------------------------------------------------------


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def table(res: dict[str, dict]) -> str:
    rows = [
        ("prefix-hit rate", "hit", lambda v: f"{v:.1%}"),
        ("TTFT p50 (ms)", "ttft_p50", lambda v: f"{v:.0f}"),
        ("TTFT p90 (ms)", "ttft_p90", lambda v: f"{v:.0f}"),
        ("TTFT p99 (ms)", "ttft_p99", lambda v: f"{v:.0f}"),
        ("requests/s", "rps", lambda v: f"{v:.2f}"),
        ("output tok/s", "tps", lambda v: f"{v:.1f}"),
    ]
    names = list(res)
    compare = [p for p in ("round-robin", "random") if p in res and "router" in res]
    head = ["", *names, *(f"router/{p}" for p in compare)]
    body = [
        [label, *(fmt(res[p][key]) for p in names), *(ratio(res["router"][key], res[p][key]) for p in compare)]
        for label, key, fmt in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        return "| " + " | ".join(cells) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run (fewer requests, fewer picks timed)")
    ap.add_argument("--requests", type=int, help="requests per policy (default 90, --quick 30)")
    ap.add_argument("--rate", type=float, default=0.8, help="Poisson arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=380, help="words per system prompt (~1.2 tokens each)")
    ap.add_argument("--kv-blocks", type=int, default=240, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--metrics-poll-ms", type=int, default=200)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a router profile key, e.g. predictor.attention_uncached_block_ms=40 (default: the default profile)",
    )
    ap.add_argument(
        "--calibrate",
        type=int,
        default=0,
        help="requests of other tenants sent through the router (with Feedback) before its measured run, so "
        "that it runs with its calibration converged (default 0: a fresh router)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--picks", type=int, help="picks timed in process and over gRPC (default 2000, --quick 500)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the workers' and router's logs")
    args = ap.parse_args()
    n = args.requests or (30 if args.quick else 90)
    n_picks = args.picks or (500 if args.quick else 2000)
    policies = sorted(args.policies.split(","), key=lambda p: p != "router")  # the router first (see above)
    assert set(policies) <= set(POLICIES), f"policies: {POLICIES}"
    requests = workload(n, args.rate, args.seed, args.system_words)
    # a SIGTERM unwinds like Ctrl-C, so that every process started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()

    built, wall, cpu = in_process_pick(64, 10_000, n_picks)
    print(
        f"in-process pick (RouterCore.pick, 64 workers x 10,000 blocks, index built in {built:.1f} s): "
        f"p50 {quantile(wall, 0.5):.3f} ms, p99 {quantile(wall, 0.99):.3f} ms wall; "
        f"p50 {quantile(cpu, 0.5):.3f} ms, p99 {quantile(cpu, 0.99):.3f} ms thread CPU; "
        f"target p99 <= 1 ms: {'met' if quantile(wall, 0.99) <= 1.0 else 'MISSED'}",
        flush=True,
    )

    tmp = Path(tempfile.mkdtemp(prefix="kiln-router-bench-"))
    res: dict[str, dict] = {}
    rtt: list[float] = []
    workers: list[KilnWorker] = []
    router = None
    try:
        t = time.perf_counter()
        workers = start_workers(tmp, args.kv_blocks)
        up = time.perf_counter() - t
        model = httpx.get(workers[0].url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rounds = asyncio.run(warm_up(workers, model, args))
        # a rehearsal on other tenants' prompts, with the batches a run makes: sticky (as KV-aware
        # routing would place them), then round-robin
        rehearsal = workload(48, args.rate, args.seed + 1, args.system_words, tenant_base=500)
        asyncio.run(run_policy("sticky", rehearsal[:24], workers, model, args, None, "rehearsal"))
        asyncio.run(run_policy("round-robin", rehearsal[24:], workers, model, args, None, "rehearsal"))
        ids = asyncio.run(render_all(workers[0].url, model, requests))
        ceiling, shared = hit_ceiling(requests, ids)
        prefix_blocks = TENANTS * int(shared) // BLOCK
        print(
            f"{WORKERS} workers up in {up:.0f} s, warm after {rounds} rounds and a rehearsal "
            f"({time.perf_counter() - t:.0f} s in all)"
            f"\nworkload: {n} requests at {args.rate}/s, {TENANTS} tenants, prompts of "
            f"{statistics.mean(map(len, ids)):.0f} tokens ({shared:.0f} shared per tenant), {args.max_tokens} new "
            f"tokens; the {TENANTS} prefixes take {prefix_blocks} blocks, a worker's pool {args.kv_blocks} "
            f"({args.kv_blocks / prefix_blocks:.0%} of them); best possible hit rate {ceiling:.1%}",
            flush=True,
        )
        for policy in policies:
            t = time.perf_counter()
            loads = [w.bucket_loads() for w in workers]
            if policy == "router":
                router = RouterProc(tmp, workers, model, args.metrics_poll_ms, args.profile)
                router.wait_synced(workers, model)
                if args.calibrate:
                    calibration = workload(args.calibrate, args.rate, args.seed + 2, args.system_words, tenant_base=700)
                    asyncio.run(run_policy("router", calibration, workers, model, args, router, "calibration"))
                    print(f"  calibration after {args.calibrate} requests: {describe_calibration(router)}", flush=True)
            setup = time.perf_counter() - t
            res[policy] = r = asyncio.run(run_policy(policy, requests, workers, model, args, router))
            loads = sum(w.bucket_loads() for w in workers) - sum(loads)
            print(
                f"{policy}: {f'router up in {setup:.0f} s; ' if router else ''}run {r['span']:.0f} s, {r['ok']} ok, "
                f"{len(r['failed'])} failed, requests per worker {r['per_worker']}, most at once on one worker "
                f"{r['max_outstanding']}, sent to a worker 2+ requests busier than the idlest {r['piled']}; "
                f"step buckets (re)loaded during the run {loads}, steps that waited for a compile "
                f"{r['compile_waits']:.0f}, preemptions {r['preempted']:.0f}",
                flush=True,
            )
            if r["failed"]:
                print(f"  first failure: {r['failed'][0]}")
            if router is not None:
                report_router(router, r)
                rtt = asyncio.run(grpc_pick_latency(router, model, ids, n_picks // 4))
                print(
                    f"  gRPC Pick round trip (token ids, live router, {len(rtt)} picks): p50 "
                    f"{quantile(rtt, 0.5):.2f} ms, p99 {quantile(rtt, 0.99):.2f} ms",
                    flush=True,
                )
                stop([router.proc], 30)
                router = None
    finally:
        stop([router.proc] if router is not None else [], 30)
        stop([w.proc for w in workers])
        if args.keep_logs:
            (tmp / "results.json").write_text(json.dumps(res))
            print(f"logs and per-request results: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{table(res)}")
    print(
        f"hit rate: cached_tokens / prompt_tokens as the workers report them; TTFT from arrival (the router's "
        f"Pick included) to the first content token; requests/s and tok/s over the run (first arrival to last "
        f"completion). {WORKERS} workers share {os.cpu_count()} CPU cores; "
        f"wall time {time.perf_counter() - started:.0f} s"
    )
    print(
        f"in-process pick p50 {quantile(wall, 0.5):.3f} ms, p99 {quantile(wall, 0.99):.3f} ms; gRPC Pick round "
        f"trip p50 {quantile(rtt, 0.5):.2f} ms, p99 {quantile(rtt, 0.99):.2f} ms"
    )


def describe_calibration(router: RouterProc) -> str:
    c = router.state()["worker_sets"][0]["calibration"]
    return (
        f"{'active' if c['active'] else 'not active'} after {c['observations']} TTFTs: queue x{c['queue_scale']:.2f}, "
        f"prefill x{c['prefill_scale']:.2f}, {c['batch_ms']:.0f} ms per request in the batch, offset "
        f"{c['offset_ms']:.0f} ms"
    )


def report_router(router: RouterProc, r: dict) -> None:
    """What the router did: its reasons, its index against what the workers found cached, its predictions,
    and the busiest it saw each worker."""
    picks, samples = r["picks"], r["router_samples"]
    reasons: dict[str, int] = {}
    for p in picks:
        reasons[p["reason"]] = reasons.get(p["reason"], 0) + 1
    claimed = sum(p["claimed"] for p in picks)
    cached = sum(p["cached"] for p in picks)
    over = sum(p["claimed"] > p["cached"] for p in picks)
    err = [abs(p["ttft_ms"] - p["predicted_ms"]) for p in picks]
    pick_ms = sorted(p["pick_ms"] for p in picks)
    metrics = httpx.get(router.admin + "/metrics", timeout=10).text
    state = router.state()
    print(
        f"  router: reasons {reasons}; cached tokens the index claimed on the picked worker {claimed}, the "
        f"workers found {cached} ({over} picks claimed more than found); |TTFT - predicted| mean "
        f"{statistics.mean(err) if err else float('nan'):.0f} ms; Pick with messages (rendered by a worker) "
        f"p50 {quantile(pick_ms, 0.5):.1f} ms, p99 {quantile(pick_ms, 0.99):.1f} ms"
    )
    print(
        f"  router index blocks per worker {[w['index_blocks'] for w in state['workers']]}; ingest "
        + ", ".join(
            f"{k} {prom(metrics, f'kiln_router_ingest_{k}_total'):.0f}"
            for k in ("batches", "events", "malformed", "ignored", "orphans", "gaps", "restarts")
        )
        + f"; tokenize failures {prom(metrics, 'kiln_router_tokenize_failures_total'):.0f}"
    )
    busiest = [max((s[n]["running"] + s[n]["waiting"] for s in samples), default=0) for n in range(WORKERS)]
    inflight = [max((s[n]["inflight"] for s in samples), default=0) for n in range(WORKERS)]
    print(
        f"  the router's view, sampled every second: most running + waiting per worker {busiest}, most in "
        f"flight {inflight}; calibration at the end: {describe_calibration(router)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
