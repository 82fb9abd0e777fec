"""The router's worker scraping (load from /metrics, models and engine from /v1/models, liveness) and
its prompt tokenization (render, local, compare), against small real HTTP servers on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kiln.router.config import RouterConfig, load_router_config
from kiln.router.scrape import KV_USAGE, RUNNING, WAITING, ScrapeError, Scraper, detect_engine, parse_metrics
from kiln.router.tokenization import (
    InvalidBody,
    ModelNotFound,
    Tokenization,
    TokenizationError,
    TokenizeConfigError,
    Unavailable,
    first_difference,
    render_limits,
)

# ---- a fake worker: a real HTTP server with canned answers ---------------------------------------


class FakeWorker:
    """Serves `routes[path]`: (status, content type, body) or a function of the request JSON giving one.

    Records each request as (method, path, JSON body or None, client port). `stop()` and `start()`
    take it down and bring it back on the same port.
    """

    def __init__(self, keep_alive: bool = False, delay_s: float = 0.0) -> None:
        self.routes: dict[str, object] = {}
        self.requests: list[tuple[str, str, object, int]] = []
        self.keep_alive, self.delay_s = keep_alive, delay_s
        self.port = 0
        self.server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if worker.keep_alive else "HTTP/1.0"

            def log_message(self, *args):
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                worker.requests.append((method, self.path, body, self.client_address[1]))
                time.sleep(worker.delay_s)
                route = worker.routes.get(self.path, (404, "text/plain", b"not found"))
                status, ctype, payload = route(body) if callable(route) else route
                if not isinstance(payload, bytes):
                    payload = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def paths(self, method: str = "POST") -> list[str]:
        return [p for m, p, _, _ in self.requests if m == method]


@pytest.fixture
def fake_workers():
    made: list[FakeWorker] = []

    def make(**kwargs) -> FakeWorker:
        made.append(FakeWorker(**kwargs))
        return made[-1]

    yield make
    for worker in made:
        worker.stop()


def write_config(
    tmp_path: Path,
    sets: list[dict],
    *,
    tokenize: str = "",
    poll_ms: int = 1000,
    models_secs: int = 30,
) -> RouterConfig:
    """sets: {name, mode, workers: [worker dicts], render_url?}; every worker gets its set's profile."""
    lines = [
        f'listen = "127.0.0.1:0"\nmock_mode = true\nmetrics_poll_ms = {poll_ms}\nmodels_refresh_secs = {models_secs}'
    ]
    for s in sets:
        workers_file = tmp_path / f"workers-{s['name']}.toml"
        entries = []
        for w in s["workers"]:
            entries.append("[[workers]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in w.items()))
        workers_file.write_text("\n\n".join(entries) + "\n")
        lines.append(f'[[profile]]\nname = "{s["name"]}"\ntokenize.mode = "{s.get("mode", "render")}"')
        ws = f'[[workerset]]\nname = "{s["name"]}"\nprofile = "{s["name"]}"\nkv_block_size = 16\n'
        ws += f'discovery.workers_file = "{workers_file.name}"'
        if s.get("render_url"):
            ws += f'\nrender_url = "{s["render_url"]}"'
        lines.append(ws)
    if tokenize:
        lines.append("[tokenize]\n" + tokenize)
    path = tmp_path / "router.toml"
    path.write_text("\n\n".join(lines) + "\n")
    return load_router_config(path)


def worker(num: int, model: str = "m", fake: FakeWorker | None = None, metrics: str | None = "/metrics") -> dict:
    w = {"worker_id_str": f"w{num}", "worker_id_num": num, "model_name": model}
    if fake is not None:
        w["http_url"] = fake.url
        if metrics is not None:
            w["metrics_url"] = fake.url + metrics
    return w


async def scraped(config: RouterConfig, *nums: int, models: bool = True) -> Scraper:
    scraper = Scraper(config)
    for num in nums:
        await scraper.scrape_now(num, models=models)
    return scraper


# ---- metrics pages ---------------------------------------------------------------------------------


class _KilnLike:
    """Kiln's own exposition: vllm:* and kiln:* gauges, one model_name label each."""

    def __init__(self, model: str, running: float, waiting: float, usage: float) -> None:
        self.values = {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage_perc": usage}
        self.model = model

    def collect(self):
        for prefix in ("vllm", "kiln"):
            for name, value in self.values.items():
                family = GaugeMetricFamily(f"{prefix}:{name}", name, labels=["model_name"])
                family.add_metric([self.model], value)
                yield family


def kiln_page(model: str = "m", running: float = 2, waiting: float = 1, usage: float = 0.25) -> bytes:
    registry = CollectorRegistry()
    registry.register(_KilnLike(model, running, waiting, usage))
    return generate_latest(registry)


VLLM_PAGE = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="other"} 40.0
vllm:num_requests_running 99.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="other"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="other"} 0.99
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""


def test_parse_metrics_reads_the_load_of_the_workers_model_only():
    kiln = parse_metrics(kiln_page("m", 2, 1, 0.25).decode(), "m")
    assert (kiln.running, kiln.waiting, kiln.kv_usage, kiln.missing) == (2, 1, 0.25, ())
    vllm = parse_metrics(VLLM_PAGE.decode(), "m")  # engines summed (requests) and averaged (usage)
    assert (vllm.running, vllm.waiting, vllm.kv_usage, vllm.missing) == (5, 1, 0.375, ())
    other = parse_metrics(VLLM_PAGE.decode(), "other")
    assert (other.running, other.waiting, other.kv_usage) == (40, 7, 0.99)
    unknown = parse_metrics(VLLM_PAGE.decode(), "not-served")  # unlabelled samples are not this model's either
    assert (unknown.running, unknown.waiting, unknown.kv_usage) == (0, 0, 0.0)
    assert unknown.missing == (RUNNING, WAITING, KV_USAGE)


def test_parse_metrics_reads_the_prefill_counters():
    page = (
        "# TYPE vllm:request_prefill_time_seconds histogram\n"
        'vllm:request_prefill_time_seconds_bucket{le="+Inf",model_name="m"} 12\n'
        'vllm:request_prefill_time_seconds_count{model_name="m"} 12\n'
        'vllm:request_prefill_time_seconds_sum{model_name="m"} 3.5\n'
        'vllm:request_prefill_time_seconds_sum{model_name="other"} 99\n'
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{model_name="m"} 5000\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 1200\n'
    )
    sample = parse_metrics(page, "m")
    counters = (sample.prefill.seconds, sample.prefill.prefills, sample.prefill.prompt_tokens,
                sample.prefill.cached_tokens)
    assert counters == (3.5, 12, 5000, 1200)
    assert parse_metrics(kiln_page("m", 2, 1, 0.25).decode(), "m").prefill.prefills == 0  # absent: 0


def test_parse_metrics_edge_cases():
    legacy = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_running{model_name="m"} NaN\n'
    sample = parse_metrics(legacy, "m")  # vLLM v0's usage gauge; NaN is skipped
    assert (sample.running, sample.kv_usage, sample.missing) == (0, 0.5, (RUNNING, WAITING))
    assert parse_metrics('vllm:kv_cache_usage_perc{model_name="m"} 3.5\n', "m").kv_usage == 1.0  # clamped
    for garbage in ("<html><body>hi</body></html>", "garbage here", '{"error": "x"}', 'a{model_name="m" 1', "a1",
                    'vllm:num_requests_running{model_name="m"} 1\n<html>'):  # a bad line after good ones
        with pytest.raises(ScrapeError, match="unparseable"):
            parse_metrics(garbage, "m")


def test_parse_metrics_reads_every_spelling_of_the_text_format_among_a_workers_histograms():
    """Only the gauges and counters it reads go through the full parser; the rest of a page (a Kiln
    worker's histograms here, most of its lines) is checked for the format's shape only."""
    from types import SimpleNamespace

    from kiln.engine.metrics import EngineMetrics

    engine = EngineMetrics("m")
    for prefill_s in (0.5, 1.5):
        engine.record_finished(SimpleNamespace(metrics={"ttft_s": prefill_s + 0.1, "prefill_s": prefill_s,
                                                        "decode_s": 0.3, "e2e_s": 2.0}, usage={"completion_tokens": 4},
                                               finish_reason="stop"))
    page = engine.render().decode() + (
        'vllm:num_requests_running {model_name="m"} 2 1700000000000\n'  # a space before the labels, a timestamp
        'vllm:num_requests_running{note="a} \\"b\\"",model_name="m",} 3\n'  # a brace and quotes in a value
        '  vllm:num_requests_waiting{model_name="m"}4\n'  # indented, no space before the value
        'vllm:kv_cache_usage_perc{model_name="m"} 5e-1\n'
        'vllm:kv_cache_usage_perc{model_name="m"} +Inf\n'  # not finite: skipped
    )
    sample = parse_metrics(page, "m")
    assert (sample.running, sample.waiting, sample.kv_usage, sample.missing) == (5, 4, 0.5, ())
    assert (sample.prefill.seconds, sample.prefill.prefills) == (2.0, 2)


def test_detect_engine():
    assert detect_engine([{"id": "m", "owned_by": "kiln"}]) == "kiln"
    assert detect_engine([{"id": "m", "owned_by": "vllm"}]) == "vllm"
    assert detect_engine([{"id": "m", "owned_by": "sglang"}]) == "sglang"
    assert detect_engine([{"id": "m", "owned_by": "organization-owner"}, {"id": "x", "owned_by": "llamacpp"}]) == (
        "llama.cpp"
    )
    assert detect_engine([{"id": "m", "owned_by": "someone"}]) == "unknown"
    assert detect_engine([]) == "unknown"


# ---- scraping real servers ----------------------------------------------------------------------


def models_answer(*ids: str, owned_by: str = "kiln") -> tuple[int, str, dict]:
    return 200, "application/json", {"object": "list", "data": [{"id": i, "owned_by": owned_by} for i in ids]}


def test_the_scraper_reads_each_workers_load_models_and_engine(tmp_path, fake_workers):
    kiln, vllm = fake_workers(), fake_workers()
    kiln.routes["/metrics"] = (200, "text/plain; version=0.0.4; charset=utf-8", kiln_page("m", 3, 2, 0.5))
    kiln.routes["/v1/models"] = models_answer("m", "my-adapter")
    vllm.routes["/metrics"] = (200, "text/plain; version=0.0.4", VLLM_PAGE)
    vllm.routes["/v1/models"] = models_answer("other", owned_by="vllm")
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", kiln), worker(1, "other", vllm)]}])

    async def main():
        scraper = await scraped(config, 0, 1)
        try:
            return scraper.state(0), scraper.state(1), scraper.states()
        finally:
            await scraper.stop()

    before = time.monotonic()
    k, v, states = asyncio.run(main())
    assert (k.running, k.waiting, k.kv_usage, k.epoch, k.failures, k.alive) == (3, 2, 0.5, 1, 0, True)
    assert before <= k.scrape_started_at <= k.scraped_at <= time.monotonic()
    assert (k.engine, k.models, k.worker_set, k.worker_id_str) == ("kiln", ("m", "my-adapter"), "a", "w0")
    assert k.serves("my-adapter") and not k.serves("other")
    assert (v.running, v.waiting, v.kv_usage, v.engine, v.models) == (40, 7, 0.99, "vllm", ("other",))
    assert set(states) == {0, 1}
    assert ("GET", "/metrics") in [(m, p) for m, p, _, _ in kiln.requests]


def test_without_metrics_url_the_load_stays_zero_and_the_worker_alive(tmp_path, fake_workers):
    fake = fake_workers()
    fake.routes["/v1/models"] = models_answer("m")
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", fake, metrics=None), worker(1)]}])

    async def main():
        scraper = await scraped(config, 0, 1)
        try:
            return scraper.state(0), scraper.state(1)
        finally:
            await scraper.stop()

    with_http, bare = asyncio.run(main())
    for state in (with_http, bare):
        assert (state.running, state.waiting, state.kv_usage, state.epoch, state.alive) == (0, 0, 0.0, 0, True)
        assert not state.has_metrics
    assert with_http.engine == "kiln" and bare.engine == "unknown"
    assert fake.paths("GET") == ["/v1/models"]


def test_a_dead_worker_is_noticed_after_three_failures_and_revives(tmp_path, fake_workers, caplog):
    fake = fake_workers()
    fake.routes["/metrics"] = (200, "text/plain", kiln_page())
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", fake)]}])

    async def main():
        scraper = Scraper(config)
        seen = []
        try:
            await scraper.scrape_now(0, models=False)
            seen.append(scraper.state(0))
            fake.stop()
            for _ in range(3):
                await scraper.scrape_now(0, models=False)
                seen.append(scraper.state(0))
            fake.start()
            await scraper.scrape_now(0, models=False)
            seen.append(scraper.state(0))
        finally:
            await scraper.stop()
        return seen

    with caplog.at_level(logging.INFO, logger="kiln.router.scrape"):
        seen = asyncio.run(main())
    assert [(s.alive, s.failures, s.epoch) for s in seen] == [
        (True, 0, 1),
        (True, 1, 1),
        (True, 2, 1),
        (False, 3, 1),
        (True, 0, 2),
    ]
    assert seen[3].running == 2  # the last good load is kept
    assert seen[1].last_error and "Connect" in seen[1].last_error
    messages = [r.getMessage() for r in caplog.records]
    assert sum("metrics scrape failed" in m for m in messages) == 1  # once per state change, not per scrape
    assert sum("dead after 3 consecutive scrapes failed" in m for m in messages) == 1
    assert sum("alive again" in m for m in messages) == 1


@pytest.mark.parametrize(
    "route, error",
    [
        ((200, "text/plain", b"<html>oops</html>"), "unparseable"),
        ((200, "application/json", b'{"a": 1}'), "not text"),
        ((200, "text/plain", b"\xff\xfe\x00garbage"), "not UTF-8"),
        ((500, "text/plain", b"boom"), "HTTP 500"),
        ((404, "text/plain", b"no"), "HTTP 404"),
    ],
)
def test_bad_metrics_count_as_failures_and_never_raise(tmp_path, fake_workers, route, error):
    fake = fake_workers()
    fake.routes["/metrics"] = route
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", fake)]}])

    async def main():
        scraper = Scraper(config)
        try:
            for _ in range(3):
                await scraper.scrape_now(0, models=False)
            return scraper.state(0)
        finally:
            await scraper.stop()

    state = asyncio.run(main())
    assert (state.failures, state.scrapes_failed, state.epoch, state.alive) == (3, 3, 0, False)
    assert error in state.last_error


def test_a_timeout_is_a_failure(tmp_path, fake_workers):
    fake = fake_workers(delay_s=1.5)  # longer than the 1 s floor of the scrape timeout
    fake.routes["/metrics"] = (200, "text/plain", kiln_page())
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", fake)]}], poll_ms=100)

    async def main():
        scraper = Scraper(config)
        try:
            await scraper.scrape_now(0, models=False)
            return scraper.state(0)
        finally:
            await scraper.stop()

    state = asyncio.run(main())
    assert state.failures == 1 and "timed out" in state.last_error


def test_models_poll_liveness(tmp_path, fake_workers):
    fake = fake_workers()
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", fake, metrics=None)]}])

    async def main():
        scraper = Scraper(config)
        seen = []
        try:
            for route in [(401, "application/json", {"error": {"message": "no key"}})] * 3:
                fake.routes["/v1/models"] = route  # answered: the worker is up
                await scraper.scrape_now(0)
            seen.append(scraper.state(0))
            fake.routes["/v1/models"] = (200, "application/json", {"not": "a list"})
            for _ in range(3):
                await scraper.scrape_now(0)
            seen.append(scraper.state(0))
            fake.routes["/v1/models"] = models_answer("m", owned_by="sglang")
            await scraper.scrape_now(0)
            seen.append(scraper.state(0))
        finally:
            await scraper.stop()
        return seen

    answered, broken, back = asyncio.run(main())
    assert (answered.alive, answered.models_failures, answered.models_error) == (True, 0, "HTTP 401")
    assert (broken.alive, broken.models_failures) == (False, 3)
    assert "not an OpenAI model list" in broken.models_error
    assert (back.alive, back.models_failures, back.engine, back.models) == (True, 0, "sglang", ("m",))


def test_the_periodic_tasks_scrape_until_stopped(tmp_path, fake_workers):
    fake = fake_workers()
    fake.routes["/metrics"] = (200, "text/plain", kiln_page())
    fake.routes["/v1/models"] = models_answer("m")
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0, "m", fake)]}], poll_ms=20)

    async def main():
        scraper = Scraper(config)
        scraper.start()
        deadline = time.monotonic() + 5
        while scraper.state(0).epoch < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await scraper.stop()
        stopped = scraper.state(0).epoch
        await asyncio.sleep(0.1)
        return stopped, scraper.state(0)

    stopped, state = asyncio.run(main())
    assert stopped >= 4 and state.epoch == stopped  # nothing scrapes after stop()
    assert state.engine == "kiln" and fake.paths("GET").count("/v1/models") == 1  # models: every 30 s


def test_workers_added_at_run_time_are_scraped(tmp_path, fake_workers):
    fake = fake_workers()
    fake.routes["/metrics"] = (200, "text/plain", kiln_page("late", 4, 0, 0.1))
    config = write_config(tmp_path, [{"name": "a", "workers": [worker(0)]}], poll_ms=20)
    late = (
        config.workerset[0]
        .workers[0]
        .model_copy(
            update={
                "worker_id_num": 7,
                "worker_id_str": "w7",
                "model_name": "late",
                "metrics_url": fake.url + "/metrics",
            }
        )
    )

    async def main():
        scraper = Scraper(config)
        scraper.start()
        scraper.add_worker(late, "a")
        deadline = time.monotonic() + 5
        while scraper.state(7).epoch < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        state = scraper.state(7)
        await scraper.remove_worker(7)
        await scraper.stop()
        return state, scraper.states()

    state, states = asyncio.run(main())
    assert (state.running, state.worker_set) == (4, "a") and set(states) == {0}


# ---- tokenization -------------------------------------------------------------------------------

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(model_dir: Path, template: str | None = TEMPLATE) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS)
    tok.train_from_iterator(["hello world", "how are you today", "fine thanks and you"], trainer)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    if template is not None:
        config["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def ids_of(tok: Tokenizer, *tokens: str) -> list[int]:
    return [tok.token_to_id(t) for t in tokens]


CHAT = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]}


def render_echo(body: dict) -> tuple[int, str, dict]:
    """A /render that answers with deterministic ids: the prompt's own, or one per message character."""
    if "messages" in body:
        ids = [len(m.get("content") or "") for m in body["messages"]]
    else:
        ids = body["prompt"] if isinstance(body["prompt"], list) else [ord(c) for c in body["prompt"]]
    return 200, "application/json", {"model": body["model"], "prompt_token_ids": ids, "count": len(ids)}


def test_render_mode_posts_the_prompt_fields_to_live_workers_in_turn(tmp_path, fake_workers):
    a, b, c = fake_workers(), fake_workers(), fake_workers()
    for fake in (a, b, c):
        fake.routes["/render"] = render_echo
        fake.routes["/metrics"] = (200, "text/plain", kiln_page())
    config = write_config(
        tmp_path, [{"name": "s", "workers": [worker(0, "m", a), worker(1, "m", b), worker(2, "m", c)]}]
    )

    async def main():
        scraper = Scraper(config)
        tokenization = Tokenization(config, scraper)
        try:
            await tokenization.start()
            body = {**CHAT, "temperature": 0.5, "tools": [{"type": "function"}], "add_generation_prompt": False}
            first = await tokenization.prompt_token_ids("s", "m", body)
            rest = [await tokenization.prompt_token_ids(None, "m", {"prompt": "hi"}) for _ in range(2)]
            c.stop()  # c fails: the next worker takes over
            after_stop = [await tokenization.prompt_token_ids("s", "m", {"prompt": [5, 6]}) for _ in range(3)]
            for _ in range(3):  # b is dead for the scraper: never tried
                b.stop()
                await scraper.scrape_now(1, models=False)
            b.start()
            dead_skipped = [await tokenization.prompt_token_ids("s", "m", {"prompt": [7]}) for _ in range(2)]
            return first, rest, after_stop, dead_skipped
        finally:
            await tokenization.aclose()
            await scraper.stop()

    first, rest, after_stop, dead_skipped = asyncio.run(main())
    assert first == [1] and rest == [[104, 105]] * 2 and after_stop == [[5, 6]] * 3 and dead_skipped == [[7]] * 2
    sent = a.requests[0][2]  # only what /render reads, and the model routed to
    assert sent == {
        "model": "m",
        "messages": CHAT["messages"],
        "tools": [{"type": "function"}],
        "add_generation_prompt": False,
    }
    # in turn: a, b, c; with c down: a, b, then a after c failed; with b dead too: a, then a after c failed
    assert [len(f.paths()) for f in (a, b, c)] == [1 + 2 + 2, 2, 1]


def test_render_url_is_used_instead_of_the_workers(tmp_path, fake_workers):
    renderer, w = fake_workers(), fake_workers()
    renderer.routes["/v1/render"] = render_echo
    config = write_config(
        tmp_path, [{"name": "s", "workers": [worker(0, "m", w)], "render_url": renderer.url + "/v1/render"}]
    )

    async def main():
        tokenization = Tokenization(config)
        try:
            await tokenization.start()
            return await tokenization.prompt_token_ids("s", "m", {"prompt": [1, 2, 3]})
        finally:
            await tokenization.aclose()

    assert asyncio.run(main()) == [1, 2, 3]
    assert renderer.paths() == ["/v1/render"] and w.requests == []


def test_tokenization_errors_carry_a_kind(tmp_path, fake_workers):
    up, down = fake_workers(), fake_workers()
    up.routes["/render"] = (400, "application/json", {"error": {"message": "messages must not be empty"}})
    up.routes["/metrics"] = (200, "text/plain", kiln_page())
    up.routes["/v1/models"] = models_answer("m", "adapter-1")
    down.stop()
    config = write_config(
        tmp_path,
        [
            {"name": "up", "workers": [worker(0, "m", up)]},
            {"name": "down", "workers": [worker(1, "d", down)]},
            {"name": "empty", "workers": []},
        ],
    )

    async def attempt(tokenization, worker_set, model, body):
        try:
            await tokenization.prompt_token_ids(worker_set, model, body)
        except TokenizationError as e:
            return type(e), e.kind, str(e)
        raise AssertionError("no error")

    async def main():
        scraper = await scraped(config, 0)
        tokenization = Tokenization(config, scraper)
        try:
            await tokenization.start()
            return [
                await attempt(tokenization, None, "nobody-serves-this", CHAT),
                await attempt(tokenization, "up", "d", CHAT),
                await attempt(tokenization, "nope", "m", CHAT),
                await attempt(tokenization, "down", "d", CHAT),
                await attempt(tokenization, "empty", "m", CHAT),
                await attempt(tokenization, "up", "m", CHAT),
                await attempt(tokenization, "up", "adapter-1", CHAT),  # an adapter the worker lists is served
                await attempt(tokenization, "up", "m", {"prompt": ["a", "b"]}),
                await attempt(tokenization, "up", "m", {"max_tokens": 3}),
                await attempt(tokenization, "up", "m", ["not", "an", "object"]),
            ]
        finally:
            await tokenization.aclose()
            await scraper.stop()

    results = asyncio.run(main())
    kinds = [(cls, kind) for cls, kind, _ in results]
    assert kinds == [
        (ModelNotFound, "not_found"),
        (ModelNotFound, "not_found"),
        (ModelNotFound, "not_found"),
        (Unavailable, "unavailable"),
        (Unavailable, "unavailable"),
        (InvalidBody, "invalid"),
        (InvalidBody, "invalid"),
        (InvalidBody, "invalid"),
        (InvalidBody, "invalid"),
        (InvalidBody, "invalid"),
    ]
    assert "nobody-serves-this" in results[0][2] and "ConnectError" in results[3][2]
    assert "messages must not be empty" in results[5][2] and "batch of 2 prompts" in results[7][2]


def test_local_mode_tokenizes_with_the_mounted_tokenizer_and_template(tmp_path):
    tok = write_tokenizer(tmp_path / "models" / "org" / "m")
    write_tokenizer(tmp_path / "models" / "plain", template=None)
    config = write_config(
        tmp_path,
        [
            {"name": "s", "mode": "local", "workers": [worker(0, "org/m")]},
            {"name": "p", "mode": "local", "workers": [worker(1, "plain")]},
        ],
        tokenize='local.mount_dir = "models"',
    )

    async def main():
        tokenization = Tokenization(config)
        try:
            await tokenization.start()
            assert set(tokenization._local) == {"org/m", "plain"}  # warmed up at registration
            again = await tokenization.warm("org/m")
            assert again is tokenization._local["org/m"]
            chat = await tokenization.prompt_token_ids("s", "org/m", CHAT)
            no_prompt = await tokenization.prompt_token_ids("s", "org/m", {**CHAT, "add_generation_prompt": False})
            text = await tokenization.prompt_token_ids("s", "org/m", {"prompt": "how are you"})
            ids = await tokenization.prompt_token_ids(None, "org/m", {"prompt": [[9, 8]]})
            plain = await tokenization.prompt_token_ids("p", "plain", {"prompt": "hello"})
            errors = []
            for ws, model, body in [
                ("p", "plain", CHAT),
                ("s", "org/m", {"messages": [{"role": "tool", "content": ""}]}),
            ]:
                with pytest.raises(InvalidBody) as e:
                    await tokenization.prompt_token_ids(ws, model, body)
                errors.append(str(e.value))
            return chat, no_prompt, text, ids, plain, errors
        finally:
            await tokenization.aclose()

    chat, no_prompt, text, ids, plain, errors = asyncio.run(main())
    assert chat == ids_of(tok, "<s>", "<|user|>", "hello", "world", "<|assistant|>")
    assert no_prompt == chat[:-1]
    assert text == ids_of(tok, "<s>", "how", "are", "you")  # add_bos_token
    assert ids == [9, 8]
    assert plain == ids_of(tok, "<s>", "hello")
    assert "no chat template" in errors[0] and "unknown role tool" in errors[1]


def test_local_mode_needs_a_mount_dir_and_loads_on_demand_without_warmup(tmp_path):
    no_mount = write_config(tmp_path, [{"name": "s", "mode": "compare", "workers": [worker(0)]}])

    async def register(config):
        tokenization = Tokenization(config)
        try:
            await tokenization.start()
            return tokenization
        finally:
            await tokenization.aclose()

    with pytest.raises(TokenizeConfigError, match="needs tokenize.local.mount_dir"):
        asyncio.run(register(no_mount))
    missing = write_config(
        tmp_path, [{"name": "s", "mode": "local", "workers": [worker(0)]}], tokenize='local.mount_dir = "models"'
    )
    with pytest.raises(TokenizeConfigError, match="cannot load tokenizer"):
        asyncio.run(register(missing))  # warmup finds no tokenizer.json: fatal at registration

    lazy = write_config(
        tmp_path,
        [{"name": "s", "mode": "local", "workers": [worker(0)]}],
        tokenize='local.mount_dir = "models"\nlocal.warmup = false',
    )

    async def main():
        tokenization = await register(lazy)
        assert tokenization._local == {}
        with pytest.raises(Unavailable, match="cannot load tokenizer"):
            await tokenization.prompt_token_ids("s", "m", {"prompt": "hello"})
        tok = write_tokenizer(tmp_path / "models" / "m")
        return tok, await tokenization.prompt_token_ids("s", "m", {"prompt": "hello"})

    tok, ids = asyncio.run(main())
    assert ids == ids_of(tok, "<s>", "hello")


def test_compare_mode_returns_the_render_and_counts_mismatches(tmp_path, fake_workers, caplog):
    tok = write_tokenizer(tmp_path / "models" / "m")
    fake = fake_workers()
    agree = ids_of(tok, "<s>", "<|user|>", "hello", "world", "<|assistant|>")
    config = write_config(
        tmp_path,
        [{"name": "s", "mode": "compare", "workers": [worker(0, "m", fake)]}],
        tokenize='local.mount_dir = "models"',
    )

    async def main():
        tokenization = Tokenization(config)
        try:
            await tokenization.start()
            fake.routes["/render"] = (200, "application/json", {"prompt_token_ids": agree})
            same = await tokenization.prompt_token_ids("s", "m", CHAT)
            counts = dict(tokenization.mismatches)
            fake.routes["/render"] = (200, "application/json", {"prompt_token_ids": [*agree[:3], 0, 0]})
            differ = [await tokenization.prompt_token_ids("s", "m", CHAT) for _ in range(2)]
            return same, counts, differ, dict(tokenization.mismatches)
        finally:
            await tokenization.aclose()

    with caplog.at_level(logging.WARNING, logger="kiln.router.tokenization"):
        same, before, differ, after = asyncio.run(main())
    assert same == agree and before == {}
    assert differ == [[*agree[:3], 0, 0]] * 2  # the worker's own ids win
    assert after == {("s", "m"): 2}
    lines = [r.getMessage() for r in caplog.records if "differs from /render" in r.getMessage()]
    assert len(lines) == 1 and "at position 3" in lines[0]  # rate-limited: one line for two mismatches
    assert first_difference([1, 2], [1, 2]) is None and first_difference([1, 2], [1, 2, 3]) == 2


def test_render_pool_limits(tmp_path, fake_workers):
    unset = write_config(tmp_path, [{"name": "s", "workers": [worker(0)]}])
    assert (render_limits(unset).max_keepalive_connections, render_limits(unset).max_connections) == (None, None)
    hosts = [
        {"http_url": "http://10.0.0.1:8000"},
        {"http_url": "http://10.0.0.2:8000"},
        {"http_url": "http://10.0.0.2:8000/"},
    ]
    two_hosts = write_config(
        tmp_path,
        [{"name": "s", "workers": [{**worker(i), **h} for i, h in enumerate(hosts)]}],
        tokenize="pool_max_idle_per_host = 4",
    )
    assert (render_limits(two_hosts).max_keepalive_connections, render_limits(two_hosts).max_connections) == (8, None)

    # Applied: after a burst of 4 concurrent renders, one connection stays open for the next burst.
    fake = fake_workers(keep_alive=True, delay_s=0.2)
    fake.routes["/render"] = render_echo

    def new_connections_in_second_burst(per_host: str) -> int:
        config = write_config(tmp_path, [{"name": "s", "workers": [worker(0, "m", fake)]}], tokenize=per_host)

        async def main():
            tokenization = Tokenization(config)
            try:
                await tokenization.start()
                for _ in range(2):
                    await asyncio.gather(*(tokenization.prompt_token_ids("s", "m", {"prompt": [1]}) for _ in range(4)))
            finally:
                await tokenization.aclose()

        fake.requests.clear()
        asyncio.run(main())
        ports = [port for _, _, _, port in fake.requests]
        return len(set(ports[4:]) - set(ports[:4]))

    assert new_connections_in_second_burst("pool_max_idle_per_host = 1") == 3
    assert new_connections_in_second_burst("") == 0


def test_the_router_modules_import_no_model_code():
    code = (
        "import sys\n"
        "import kiln.router.scrape, kiln.router.tokenization\n"
        "heavy = ('jax', 'kiln.engine', 'kiln.models', 'kiln.server', 'kiln.train', 'kiln.eval')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'jax' or m.startswith(heavy))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
