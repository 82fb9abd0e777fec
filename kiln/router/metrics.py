"""The router's Prometheus metrics, in a registry of its own (served on the admin `/metrics`).

Counters and histograms of events (picks, feedback, rejected bodies) are updated as they happen.
Figures the router already keeps elsewhere (each worker's scraped load, ingest counters, index
sizes, tokenization mismatches, buffered bodies) are read when `/metrics` is scraped, through a
collector over a `snapshot` callable, so that nothing is counted twice.

`[metrics] tenant_labels` decides whether the pick and failure counters and the observed latency
histograms (`ttft_ms`, `e2e_ms`) carry a `tenant` label:
`none`: no such label; `all`: each tenant its own (an empty tenant is `unknown`); a list: those
tenants their own, every other one (an empty one included) `other`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.router.config import RouterConfig

PREFIX = "kiln_router_"
# Observed TTFT minus predicted latency, in ms: negative when the worker was faster than predicted.
ERROR_BUCKETS_MS = (-5000, -2000, -1000, -500, -200, -100, -50, 0, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# Observed time to first token and end-to-end latency, in ms, from Feedback.
LATENCY_BUCKETS_MS = (25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200, 102400, 204800)
PICK_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# ingest counter -> metric name (without the prefix and _total)
INGEST_COUNTERS = {
    "batches": "ingest_batches",
    "events": "ingest_events",
    "malformed": "ingest_malformed",
    "ignored": "ingest_ignored",
    "orphans": "ingest_orphans",
    "gaps": "ingest_gaps",
    "restarts": "ingest_restarts",
}


def tenant_labeller(setting: str | tuple[str, ...]) -> Callable[[str], str] | None:
    """The tenant -> label function of a `tenant_labels` setting; None when there is no tenant label."""
    if setting == "none":
        return None
    if setting == "all":
        return lambda tenant: tenant or "unknown"
    listed = frozenset(setting)
    return lambda tenant: tenant if tenant in listed else "other"


class RouterMetrics:
    """Every metric the router exports; `snapshot()` gives the figures read at scrape time (_StateCollector)."""

    def __init__(self, config: RouterConfig, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_label = tenant_labeller(config.metrics.tenant_labels)
        tenant = ("tenant",) if self.tenant_label is not None else ()
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.picks = counter(
            "picks", "Workers picked, by worker set, worker and reason", ("workerset", "worker", "reason", *tenant)
        )
        # the prefix blocks each pick found cached on its worker, and the blocks its prompt has: their
        # rates' ratio is the cache-hit rate of routed traffic as the router predicted it
        self.pick_cached_blocks = counter(
            "pick_cached_blocks", "Prompt blocks the picked worker held in its prefix cache, by worker set and worker",
            ("workerset", "worker", *tenant),
        )
        self.pick_prompt_blocks = counter(
            "pick_prompt_blocks", "Prompt blocks of picked requests, by worker set and worker",
            ("workerset", "worker", *tenant),
        )
        self.pick_failures = counter(
            "pick_failures", "Pick and PushBody calls answered with an error, by gRPC status code", ("code", *tenant)
        )
        self.pick_seconds = histogram("pick_seconds", "Time to pick a worker (tokenizing included)", (), PICK_BUCKETS_S)
        # Signed, so the buckets show a bias; Prometheus keeps no _sum of a histogram with negative
        # buckets, so the absolute error has its own (its _sum / _count is the mean absolute error).
        self.prediction_error = histogram(
            "prediction_error_ms",
            "Observed time to first token minus the predicted latency, from Feedback",
            ("workerset",),
            ERROR_BUCKETS_MS,
        )
        self.prediction_abs_error = histogram(
            "prediction_abs_error_ms",
            "Absolute difference of observed time to first token and predicted latency, from Feedback",
            ("workerset",),
            tuple(b for b in ERROR_BUCKETS_MS if b > 0),
        )
        per_worker = ("workerset", "worker", *tenant)
        self.ttft = histogram(
            "ttft_ms", "Observed time to first token, from Feedback, by worker set and worker", per_worker,
            LATENCY_BUCKETS_MS,
        )
        self.e2e = histogram(
            "e2e_ms",
            "Observed end-to-end latency (request sent to last token), from Feedback, by worker set and worker",
            per_worker,
            LATENCY_BUCKETS_MS,
        )
        self.feedback = counter(
            "feedback", "Feedback calls: ok, failed (the request failed) or unknown (no pick held)", ("outcome",)
        )
        self.tokenize_failures = counter(
            "tokenize_failures", "Prompts that could not be tokenized and were routed on load alone", ("workerset",)
        )
        self.body_rejections = counter(
            "body_rejections", "Streamed bodies refused: too_large, budget, idle, ttl or invalid", ("reason",)
        )
        if snapshot is not None:
            r.register(_StateCollector(snapshot))

    def tenant_labels(self, tenant: str) -> dict[str, str]:
        return {"tenant": self.tenant_label(tenant)} if self.tenant_label is not None else {}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges and counters read from the router's state when /metrics is scraped.

    The snapshot: {"workers": [{workerset, worker, alive, evicted, running, waiting, kv_usage, inflight,
    index_blocks, ingest: {counter: value} | None}], "worker_sets": [{name, index_blocks, calibration}],
    "tokenize": {"mismatches": {(set, model): n}, "local_failures": {(set, model): n}},
    "bodies": {"bytes": n, "count": n}, "observations": n, "leader": bool | None}.
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # (generated on every collect; nothing to check at registration)

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        wl = ("workerset", "worker")
        gauges = {
            name: GaugeMetricFamily(PREFIX + "worker_" + name, doc, labels=wl)
            for name, doc in (
                ("alive", "1 if the worker's scrapes succeed, else 0"),
                ("evicted", "1 if the worker's KV events are ignored (block size mismatch), else 0"),
                ("running", "Requests running on the worker, as last scraped"),
                ("waiting", "Requests waiting on the worker, as last scraped"),
                ("kv_usage", "KV cache usage of the worker, a fraction, as last scraped"),
                ("inflight", "Requests sent to the worker that its last scrape cannot have counted"),
                ("index_blocks", "KV blocks the prefix index holds for the worker"),
            )
        }
        counters = {
            key: CounterMetricFamily(PREFIX + name, f"KV event ingest: {key}", labels=wl)
            for key, name in INGEST_COUNTERS.items()
        }
        replays = CounterMetricFamily(PREFIX + "ingest_replays", "KV event replays, by result", labels=(*wl, "result"))
        for w in s["workers"]:
            labels = [w["workerset"], w["worker"]]
            for name, family in gauges.items():
                family.add_metric(labels, float(w[name]))  # (booleans as 0 or 1)
            if (ingest := w.get("ingest")) is not None:
                for key, family in counters.items():
                    family.add_metric(labels, ingest[key])
                replays.add_metric([*labels, "ok"], ingest["replays_ok"])
                replays.add_metric([*labels, "failed"], ingest["replays_failed"])
        yield from gauges.values()
        yield from counters.values()
        yield replays

        blocks = GaugeMetricFamily(
            PREFIX + "index_blocks", "Distinct KV blocks in the worker set's prefix index", labels=("workerset",)
        )
        scales = GaugeMetricFamily(
            PREFIX + "calibration_scale",
            "Factor the predictor's queue or prefill term is scaled by, fitted from Feedback (1 until fitted)",
            labels=("workerset", "term"),
        )
        offsets = GaugeMetricFamily(
            PREFIX + "calibration_offset_ms",
            "Milliseconds the calibration adds to every prediction, fitted from Feedback (0 until fitted)",
            labels=("workerset",),
        )
        per_batch = GaugeMetricFamily(
            PREFIX + "calibration_batch_ms",
            "Milliseconds the calibration charges a prediction per request in the batch it joins (0 until fitted)",
            labels=("workerset",),
        )
        observed = CounterMetricFamily(
            PREFIX + "calibration_observations",
            "Time to first token observations the worker set's calibration has taken",
            labels=("workerset",),
        )
        for ws in s["worker_sets"]:
            blocks.add_metric([ws["name"]], ws["index_blocks"])
            if (c := ws.get("calibration")) is not None:
                scales.add_metric([ws["name"], "queue"], c["queue_scale"])
                scales.add_metric([ws["name"], "prefill"], c["prefill_scale"])
                offsets.add_metric([ws["name"]], c["offset_ms"])
                per_batch.add_metric([ws["name"]], c["batch_ms"])
                observed.add_metric([ws["name"]], c["observations"])
        yield blocks
        yield scales
        yield offsets
        yield per_batch
        yield observed

        for key, doc in (
            ("mismatches", "Prompts whose local tokenization differed from /render (compare mode)"),
            ("local_failures", "Prompts local tokenization failed on where /render did not (compare mode)"),
        ):
            family = CounterMetricFamily(PREFIX + "tokenize_" + key, doc, labels=("workerset", "model"))
            for (ws, model), n in s["tokenize"][key].items():
                family.add_metric([ws, model], n)
            yield family

        yield GaugeMetricFamily(
            PREFIX + "body_bytes_buffered", "Bytes of streamed request bodies held now", value=s["bodies"]["bytes"]
        )
        yield GaugeMetricFamily(
            PREFIX + "bodies_buffered", "Streamed request bodies being received now", value=s["bodies"]["count"]
        )
        yield GaugeMetricFamily(
            PREFIX + "observations", "Picks held waiting for their Feedback", value=s["observations"]
        )
        if s.get("leader") is not None:  # only with [leader_election]
            yield GaugeMetricFamily(
                PREFIX + "leader", "1 if this replica holds the leader election Lease, else 0", value=float(s["leader"])
            )
