"""server/grafana/kiln.json, the fleet's Grafana dashboard: it parses, imports into any Grafana (its
panels query the `$datasource` variable), covers what the console asks for, and every metric and label
it queries is one a live server's or a live router's `/metrics` exposes, so that renaming a metric
fails here rather than leaving an empty panel.

The live half starts one tiny-model server with KV events on and a router in live mode over it (a
static workers file), picks through the router, sends the chat completion to the worker it picked and
reports it back with Feedback (twice, the second a prefix-cache hit), then reads both `/metrics`."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from router.test_router_server import RouterProcess, stop_fleet, wait_until, write_config
from server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "server" / "grafana" / "kiln.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# labels Prometheus adds to every series it scrapes (the target's), not on /metrics
TARGET_LABELS = {"instance", "job"}
AGGREGATIONS = {"sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values", "limitk", "limit_ratio"}
KEYWORDS = AGGREGATIONS | {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                           "unless", "offset", "atan2", "inf", "nan"}
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")
LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(\s*\()?")
SAMPLE_LABEL = re.compile(r'([a-zA-Z_]\w*)="(?:[^"\\]|\\.)*"')

# what the console asks for -> a name some panel must query
TOPICS = {
    "throughput": "vllm:generation_tokens_total",
    "TTFT percentiles": "vllm:time_to_first_token_seconds_bucket",
    "ITL percentiles": "vllm:inter_token_latency_seconds_bucket",
    "KV usage": "vllm:kv_cache_usage_perc",
    "prefix-hit rate (hits)": "vllm:prefix_cache_hits_total",
    "prefix-hit rate (queries)": "vllm:prefix_cache_queries_total",
    "training ownership share": "kiln:training_slice_seconds_total",
    "writer ownership share": "kiln:writer_hold_seconds_total",
    "router cache-hit rate (cached blocks)": "kiln_router_pick_cached_blocks_total",
    "router cache-hit rate (prompt blocks)": "kiln_router_pick_prompt_blocks_total",
    "router pick latency": "kiln_router_pick_seconds_bucket",
    "router picks per worker": "kiln_router_picks_total",
    "router prefix index": "kiln_router_worker_index_blocks",
}


class Query:
    """The metric names one PromQL expression selects, and the label names it matches or groups on
    (`{metric: {labels its matchers name}}` and the labels of its by/without/on/ignoring/group clauses)."""

    def __init__(self, expr: str):
        self.expr = expr
        text = STRING.sub('""', expr)  # (a label value may hold anything)
        text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery selectors: [$__rate_interval], [5m:1m]
        self.matched: dict[str, set[str]] = {}
        for m in MATCHERS.finditer(text):
            labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(2)))
            if m.group(1) is None:  # {__name__="..."}: not used by the dashboard, and not checked here
                raise AssertionError(f"a selector without a metric name: {expr}")
            self.matched.setdefault(m.group(1), set()).update(labels)
        text = MATCHERS.sub(lambda m: m.group(1) or "", text)
        self.grouped = {label for m in LABEL_LIST.finditer(text) for label in re.findall(r"\w+", m.group(2))}
        text = LABEL_LIST.sub(" ", text)
        self.metrics: set[str] = set()
        for m in IDENTIFIER.finditer(text):
            name, call = m.group(1), m.group(2)
            if call or name.lower() in KEYWORDS:  # a function, an aggregation, an operator
                continue
            self.metrics.add(name)
        for name in self.metrics:
            self.matched.setdefault(name, set())


def label_values(query: str) -> tuple[Query | None, str]:
    """A `label_values([metric{...},] label)` variable query: the selector (as a Query) and the label."""
    m = re.fullmatch(r"\s*label_values\((?:(.+),)?\s*(\w+)\s*\)\s*", query)
    assert m, f"not a label_values query: {query!r}"
    return (Query(m.group(1)) if m.group(1) else None), m.group(2)


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(dashboard: dict) -> list[tuple[str, Query]]:
    """(where, Query) of every panel target and every query variable."""
    out = [(f"panel {p['id']} ({p['title']}) target {t['refId']}", Query(t["expr"]))
           for p in panels(dashboard) for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            selector, _ = label_values(q)
            if selector is not None:
                out.append((f"variable {v['name']}", selector))
    return out


# ---- the dashboard itself ---------------------------------------------------------------------------


def test_the_query_reader():
    q = Query('histogram_quantile(0.99, sum by (instance, le) (rate(vllm:time_to_first_token_seconds_bucket'
              '{model_name=~"$model_name", instance=~"a,b}"}[$__rate_interval])))')
    assert q.metrics == {"vllm:time_to_first_token_seconds_bucket"}
    assert q.matched == {"vllm:time_to_first_token_seconds_bucket": {"model_name", "instance"}}
    assert q.grouped == {"instance", "le"}
    q = Query("sum(rate(a_total[5m])) by (x) / on (y) group_left (z) max without (w) (b) + 1e3 * c offset 5m")
    assert q.metrics == {"a_total", "b", "c"} and q.grouped == {"x", "y", "z", "w"}
    selector, label = label_values('label_values(kiln_router_worker_alive{workerset=~"$workerset"}, worker)')
    assert selector.metrics == {"kiln_router_worker_alive"} and label == "worker"


def test_the_dashboard_parses_and_imports_into_any_grafana():
    d = load()
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    taken: set[tuple[int, int]] = set()
    for p in panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {p['id']} ({p['title']}) overlaps another"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}, p["type"]
        assert p["datasource"] == DATASOURCE, f"panel {p['id']} ({p['title']}) must query $datasource"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip() and "legendFormat" in t, (p["title"], t)
    used_variables = {v for _, expr in exprs(d) for v in re.findall(r"\$(\w+)", expr)} - {"__rate_interval"}
    assert used_variables <= set(variables), used_variables - set(variables)


def exprs(d: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(d) for t in p.get("targets", [])]


def test_the_dashboard_covers_what_the_console_asks_for():
    d = load()
    names = {name for _, q in queries(d) for name in q.metrics}
    missing = {topic: name for topic, name in TOPICS.items() if name not in names}
    assert not missing, missing
    # per worker: the workers' panels split by instance, the router's by worker
    by_worker = {t["expr"] for p in panels(d) for t in p.get("targets", [])
                 if re.search(r"by \([^)]*\b(instance|worker)\b", t["expr"])}
    for name in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:prefix_cache_hits_total",
                 "kiln:training_slice_seconds_total", "kiln_router_picks_total"):
        assert any(name in e for e in by_worker), f"no per-worker panel over {name}"


# ---- against a live server and router ---------------------------------------------------------------


def exposed(text: str) -> dict[str, set[str] | None]:
    """name -> the label names of its samples (None when only its # TYPE line shows it) of a /metrics
    page; a histogram family x is queried as x_bucket, x_sum and x_count."""
    names: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            for n in [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name]:
                names.setdefault(n, None)
        elif line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][\w:]*", line).group()
            labels = set(SAMPLE_LABEL.findall(line[len(name):].rpartition("}")[0]))
            names[name] = (names.get(name) or set()) | labels
    return names


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory, tiny_model, kiln_cache):
    """The names (and their labels) that a live server's and a live router's /metrics expose, after two
    chat completions, each picked by the router, sent to the worker and reported back with Feedback."""

    from kiln.router.proto import router_pb2

    zmq, replay = free_port(), free_port()
    server = ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME="tiny-llama",
                           KILN_ENGINE_KV_EVENTS_ENDPOINT=f"tcp://*:{zmq}",  # (a wildcard host binds)
                           KILN_ENGINE_KV_EVENTS_REPLAY_ENDPOINT=f"tcp://*:{replay}")
    router = None
    try:
        config = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "metrics_poll_ms": 100,
                  "models_refresh_secs": 1, "profile": [{"name": "p"}],
                  "workerset": [{"name": "a", "profile": "p", "kv_block_size": 16}]}
        worker = {"worker_id_str": "w0", "worker_id_num": 0, "model_name": "tiny-llama",
                  "zmq_endpoint": f"tcp://127.0.0.1:{zmq}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                  "metrics_url": server.url + "/metrics", "http_url": server.url}
        router = RouterProcess(write_config(tmp_path_factory.mktemp("grafana-router"), config, {"a": [worker]}))

        def worker_state():
            state = router.get("/api/state").json()
            return next((w for w in state["workers"] if w["worker"] == "w0" and w["alive"]
                         and "tiny-llama" in w["models"]), None)

        wait_until(worker_state, 60, "the router to scrape the worker and list its model")
        messages = [{"role": "user", "content": "hello there, how are you today?"}]
        for _ in range(2):  # the second sends the same prompt: a prefix-cache hit on the worker
            picked = router.router.Pick(router_pb2.PickRequest(
                model="tiny-llama", messages=[router_pb2.Message(**m) for m in messages]), timeout=60)
            assert picked.worker_id == "w0" and picked.endpoint == f"127.0.0.1:{server.port}", picked
            started = time.monotonic()
            reply = httpx.post(f"http://{picked.endpoint}/v1/chat/completions", timeout=120, json={
                "model": "tiny-llama", "messages": messages, "max_tokens": 4, "temperature": 0})
            took_ms = (time.monotonic() - started) * 1e3
            assert reply.status_code == 200, reply.text
            assert router.router.Feedback(router_pb2.FeedbackRequest(
                request_id=picked.request_id, ttft_ms=took_ms, e2e_ms=took_ms), timeout=20).known
        # the KV events of the completion reach the router's index
        try:
            wait_until(lambda: (worker_state() or {}).get("index_blocks"), 30, "the worker's KV events")
        except AssertionError:
            raise AssertionError(f"no KV events reached the router: {worker_state()}\n{router.output[-3000:]}\n"
                                 f"{''.join(server._output)[-3000:]}") from None
        pages = {"server": httpx.get(server.url + "/metrics", timeout=30).text,
                 "router": router.get("/metrics").text}
    finally:
        stop_fleet(router, [server])
    return {side: exposed(text) for side, text in pages.items()}


def test_every_metric_the_dashboard_queries_is_exposed(live_metrics):
    server, router = live_metrics["server"], live_metrics["router"]
    assert "vllm:time_to_first_token_seconds_bucket" in server and "kiln_router_pick_seconds_bucket" in router
    known = {**server, **router}
    missing, bad_labels = [], []
    for where, q in queries(load()):
        sampled = set()
        for name in sorted(q.metrics):
            side = router if name.startswith("kiln_router_") else server
            if name not in side:
                missing.append(f"{where}: {name}")
                continue
            labels = side[name]
            if labels is None:  # no sample to read its labels from (no pick failure happened)
                continue
            sampled |= labels
            if unknown := q.matched[name] - labels - TARGET_LABELS:
                bad_labels.append(f"{where}: {name} has no label {sorted(unknown)} (it has {sorted(labels)})")
        if sampled and all(known.get(n) is not None for n in q.metrics):
            if unknown := q.grouped - sampled - TARGET_LABELS:
                bad_labels.append(f"{where}: groups by {sorted(unknown)}, which none of {sorted(q.metrics)} has")
    problems = (["queried but not on /metrics:", *missing] if missing else []) + (
        ["labels that are not on /metrics:", *bad_labels] if bad_labels else [])
    assert not problems, "\n".join(problems)


def test_the_variables_read_labels_that_exist(live_metrics):
    known = {**live_metrics["server"], **live_metrics["router"]}
    for v in load()["templating"]["list"]:
        if v["type"] != "query":
            continue
        selector, label = label_values(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
        assert selector is not None, v["name"]
        for name in selector.metrics:
            assert known.get(name) is not None, f"variable {v['name']}: {name} has no sample"
            assert label in known[name] | TARGET_LABELS, f"variable {v['name']}: {name} has no label {label}"
