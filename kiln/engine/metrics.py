"""Prometheus metrics: kiln:* names plus the vllm:* names KV-aware routers scrape.

Gauges and counters are read from the engine's published snapshot at scrape time; request
histograms are recorded by the engine when a request ends, whatever ended it (a client
that disconnected is counted too).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.engine.request import Delta

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)
PREFIXES = ("vllm", "kiln")
RECENT_REQUESTS = 1024  # finished requests kept for exact recent percentiles (the console)


class _SnapshotCollector:
    """Reads the engine's live state at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str):
        self.snapshot = snapshot
        self.model_name = model_name

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        s = self.snapshot()
        # vLLM's adapter gauge: the labels carry the adapter names, the value is the scrape time
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        info.add_metric([str(s["lora_slots_total"]), ",".join(s["waiting_adapters"]),
                         ",".join(s["running_adapters"])], time.time())
        yield info
        for name, doc, key in (("lora_slots_used", "LoRA slots holding an adapter", "lora_slots_used"),
                               ("lora_slots_total", "LoRA slots on the accelerator", "lora_slots_total"),
                               ("requests_waiting_for_adapter_slot", "Requests waiting for their adapter to get a slot",
                                "waiting_for_adapter_slot")):
            yield self._family(GaugeMetricFamily, f"kiln:{name}", doc, s[key])
        yield self._family(CounterMetricFamily, "kiln:writer_operations",
                           "Accelerator writer operations (adapter transitions, ...)", s["writer_operations"])
        # their rates are the share of time writers, and training slices among them, held the accelerator
        yield self._family(CounterMetricFamily, "kiln:writer_hold_seconds",
                           "Time writer operations held the accelerator (training slices, adapter loads, ...)",
                           s["writer_hold_s"])
        yield self._family(CounterMetricFamily, "kiln:training_slice_seconds",
                           "Time training slices held the accelerator", s["training_slice_s"])
        yield self._family(GaugeMetricFamily, "kiln:compiled_step_buckets",
                           "Step executables built or loaded (forward buckets and samplers)", s["compiled_steps"])
        yield self._family(GaugeMetricFamily, "kiln:step_executables",
                           "Step executables in the engine's bounded set", s["step_set_size"])
        yield self._family(CounterMetricFamily, "kiln:step_compile_waits",
                           "Steps that waited for their executable to compile (none once the set is warm)",
                           s["compile_waits"])
        yield self._family(CounterMetricFamily, "kiln:engine_steps", "Jitted steps executed", s["steps"])
        yield self._family(CounterMetricFamily, "kiln:engine_steps_ahead",
                           "Steps dispatched while the step before them still ran (async scheduling)",
                           s["steps_ahead"])
        yield self._family(CounterMetricFamily, "kiln:step_failures",
                           "Batches whose step failed (their requests ended with an error)", s["step_failures"])
        yield self._family(GaugeMetricFamily, "kiln:device_lost",
                           "1 once the accelerator is lost (every request fails until a restart)",
                           int(s["device_lost"] is not None))
        yield self._family(GaugeMetricFamily, "kiln:route_quarantined",
                           "1 once an accelerator failure took the backend route out of service (XLA serves until "
                           "a restart)", int(s["route_quarantined"] is not None))
        gauges = (("num_requests_running", "Requests in the running batch", "running"),
                  ("num_requests_waiting", "Requests waiting to be scheduled", "waiting"),
                  ("kv_cache_usage_perc", "KV-cache block usage (1 = full)", "kv_usage"))
        counters = (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_queries"),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_hits"),
                    ("prompt_tokens", "Prompt tokens processed", "prompt_tokens"),
                    ("generation_tokens", "Tokens generated", "generation_tokens"),
                    ("num_preemptions", "Requests preempted for recompute", "preemptions"))
        for prefix in PREFIXES:
            for name, doc, key in gauges:
                yield self._family(GaugeMetricFamily, f"{prefix}:{name}", doc, s[key])
            for name, doc, key in counters:
                yield self._family(CounterMetricFamily, f"{prefix}:{name}", doc, s[key])


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._histograms = []
        for prefix in PREFIXES:
            def histogram(name, doc, prefix=prefix):
                return Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry).labels(model_name)

            self._histograms.append({
                "ttft_s": histogram("time_to_first_token_seconds", "Time to first token"),
                "itl": histogram("inter_token_latency_seconds", "Time between output tokens"),
                "e2e_s": histogram("e2e_request_latency_seconds", "End-to-end request latency"),
                "queued_s": histogram("request_queue_time_seconds", "Time waiting before the first step"),
                "prefill_s": histogram("request_prefill_time_seconds", "Time from the first step to the prompt's end"),
                "success": Counter(f"{prefix}:request_success", "Finished requests", ["model_name", "finished_reason"],
                                   registry=self.registry),
            })
        # (end time, TTFT, mean ITL, end-to-end) of the latest finished requests: the histograms'
        # buckets are too coarse for a live p50/p99, and a window shows now rather than since start
        self._recent: deque[tuple[float, float | None, float | None, float | None]] = deque(maxlen=RECENT_REQUESTS)

    def attach(self, snapshot: Callable[[], dict]) -> None:
        """Gauges and counters come from `snapshot()` (the engine's published state) at scrape time."""
        self.registry.register(_SnapshotCollector(snapshot, self.model_name))

    def record_finished(self, final: Delta) -> None:
        """Called by the engine for every request's final delta."""
        phases, tokens = final.metrics or {}, (final.usage or {}).get("completion_tokens", 0)
        for h in self._histograms:
            h["success"].labels(self.model_name, final.finish_reason).inc()
            for key in ("ttft_s", "e2e_s", "queued_s", "prefill_s"):
                if phases.get(key) is not None:
                    h[key].observe(phases[key])
            if phases.get("decode_s") is not None and tokens > 1:
                h["itl"].observe(phases["decode_s"] / (tokens - 1))
        itl = phases["decode_s"] / (tokens - 1) if phases.get("decode_s") is not None and tokens > 1 else None
        self._recent.append((time.time(), phases.get("ttft_s"), itl, phases.get("e2e_s")))

    def recent_latencies(self, window_s: float = 60.0) -> dict:
        """Percentiles (p50, p90, p99, in seconds) of TTFT, mean inter-token latency and end-to-end
        latency over the requests that finished in the last `window_s` seconds, and their count."""
        since = time.time() - window_s
        recent = [r for r in list(self._recent) if r[0] >= since]
        out: dict = {"window_s": window_s, "requests": len(recent)}
        for i, key in enumerate(("ttft_s", "itl_s", "e2e_s"), start=1):
            values = [r[i] for r in recent if r[i] is not None]
            out[key] = ({f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)} if values else None)
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
