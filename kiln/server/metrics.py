"""Prometheus metrics: kiln:* names plus the vllm:* names KV-aware routers scrape."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads the engine's live stats at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.live_stats()
        label = [self.model_name]
        gauges = {
            "num_requests_running": ("Requests in the running batch", s["running"]),
            "num_requests_waiting": ("Requests waiting to be scheduled", s["waiting"]),
            "kv_cache_usage_perc": ("KV-cache block usage (1 = full)", s["kv_usage"]),
        }
        # vLLM's adapter gauge: labels carry the adapter names, the value is the scrape time
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        info.add_metric([str(s["lora_slots_total"]), ",".join(s["waiting_adapters"]), ",".join(s["running_adapters"])],
                        time.time())
        yield info
        for name, doc, value in (("lora_slots_used", "LoRA slots holding an adapter", s["lora_slots_used"]),
                                 ("lora_slots_total", "LoRA slots on the accelerator", s["lora_slots_total"]),
                                 ("requests_waiting_for_adapter_slot", "Requests waiting for their adapter to get a slot",
                                  s["waiting_for_adapter_slot"])):
            g = GaugeMetricFamily(f"kiln:{name}", doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        c = CounterMetricFamily("kiln:writer_operations", "Accelerator writer operations (adapter transitions, ...)",
                                labels=["model_name"])
        c.add_metric(label, s["writer_operations"])
        yield c
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s["prefix_queries"]),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", s["prefix_hits"]),
            "prompt_tokens": ("Prompt tokens processed", s["prompt_tokens"]),
            "generation_tokens": ("Tokens generated", s["generation_tokens"]),
            "num_preemptions": ("Requests preempted for recompute", s["preemptions"]),
        }
        for prefix in ("vllm", "kiln"):
            for name, (doc, value) in gauges.items():
                g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
                g.add_metric(label, value)
                yield g
            for name, (doc, value) in counters.items():
                c = CounterMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
                c.add_metric(label, value)
                yield c


class Metrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        self.histograms = {}
        for prefix in ("vllm", "kiln"):
            self.histograms[prefix] = {
                "ttft": Histogram(f"{prefix}:time_to_first_token_seconds", "Time to first token", ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry),
                "itl": Histogram(f"{prefix}:inter_token_latency_seconds", "Time between output tokens", ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry),
                "e2e": Histogram(f"{prefix}:e2e_request_latency_seconds", "End-to-end request latency", ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry),
                "queued": Histogram(f"{prefix}:request_queue_time_seconds", "Time waiting before the first step", ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry),
            }
            self.histograms[prefix]["success"] = Counter(f"{prefix}:request_success", "Finished requests", ["model_name", "finished_reason"], registry=self.registry)

    def observe(self, metrics: dict | None, completion_tokens: int, finish_reason: str) -> None:
        for h in self.histograms.values():
            h["success"].labels(self.model_name, finish_reason).inc()
            if not metrics:
                continue
            for key, name in (("ttft_s", "ttft"), ("e2e_s", "e2e"), ("queued_s", "queued")):
                if metrics.get(key) is not None:
                    h[name].labels(self.model_name).observe(metrics[key])
            if metrics.get("decode_s") is not None and completion_tokens > 1:
                h["itl"].labels(self.model_name).observe(metrics["decode_s"] / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
