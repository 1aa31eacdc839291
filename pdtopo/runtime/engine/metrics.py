"""Prometheus metrics of one server process (sglang-style names plus pdtopo's own).

One `EngineMetrics` per process, on its own `CollectorRegistry` (several servers may live in one
test process). The scheduler thread observes latencies and sets gauges after each step
(prometheus-client metrics are thread-safe); `GET /metrics` renders `render()`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from pdtopo.runtime.engine.attention_fallback import AttentionPath

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
HOST_COUNTERS = ("hits", "to_host", "to_device")  # the host tier's totals set_host_tier follows


class BatchHistogram:
    """A histogram the scheduler observes a step's rows at a time (`observe_many`: one NumPy
    bucketing and one lock per step instead of a prometheus-client call per token), exposed
    as a custom collector in the same text format as a prometheus-client Histogram (the
    `_bucket`, `_count` and `_sum` series)."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str],
                 buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.documentation, self.labels = name, documentation, dict(labels)
        self.bounds = np.array([*buckets, float("inf")], dtype=np.float64)
        self._counts = np.zeros(len(self.bounds), dtype=np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        a = np.fromiter(values, dtype=np.float64)
        if not a.size:
            return
        # a value lands in the first bucket whose upper bound (le) is >= it
        counts = np.bincount(np.searchsorted(self.bounds, a, side="left"),
                             minlength=len(self.bounds))
        total = float(a.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()),
                          [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative,
                                                                    strict=True)], total)
        yield family

    def describe(self) -> Iterable[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))


class EngineMetrics:
    def __init__(self, model_name: str, role: str = "colocated"):
        self.registry = CollectorRegistry()
        lab = {"model_name": model_name}
        reg = self.registry
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token",
                              labelnames=list(lab), buckets=_LATENCY_BUCKETS,
                              registry=reg).labels(**lab)
        self.itl = BatchHistogram("sglang:inter_token_latency_seconds", "Inter-token latency",
                                  lab, _ITL_BUCKETS, reg)
        self.tpot = BatchHistogram("sglang:time_per_output_token_seconds",
                                   "Time per output token", lab, _ITL_BUCKETS, reg)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency",
                             labelnames=list(lab), buckets=_LATENCY_BUCKETS,
                             registry=reg).labels(**lab)
        self.num_running = Gauge("sglang:num_running_reqs", "Requests in the decode batch",
                                 labelnames=list(lab), registry=reg).labels(**lab)
        self.num_queue = Gauge("sglang:num_queue_reqs", "Requests waiting",
                               labelnames=list(lab), registry=reg).labels(**lab)
        self.gen_throughput = Gauge("sglang:gen_throughput", "Generation throughput (token/s)",
                                    labelnames=list(lab), registry=reg).labels(**lab)
        self.token_usage = Gauge("sglang:token_usage", "Fraction of KV pool pages requests hold (pages only the prefix cache holds count as free)",
                                 labelnames=list(lab), registry=reg).labels(**lab)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed",
                                     labelnames=list(lab), registry=reg).labels(**lab)
        self.generation_tokens = Counter("sglang:generation_tokens", "Output tokens generated",
                                         labelnames=list(lab), registry=reg).labels(**lab)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate",
                                    "Prompt tokens served from the prefix cache / all prompt "
                                    "tokens looked up (since start)",
                                    labelnames=list(lab), registry=reg).labels(**lab)
        self.cached_tokens = Counter("pdtopo:prompt_tokens_cached",
                                     "Prompt tokens whose KV came from the prefix cache",
                                     registry=reg)
        self.computed_tokens = Counter("pdtopo:prompt_tokens_computed",
                                       "Prompt tokens prefilled (computed)", registry=reg)
        self.tree_pages = Gauge("pdtopo:prefix_cache_pages", "KV pages held by the prefix cache",
                                registry=reg)
        self.evictable_pages = Gauge(
            "pdtopo:prefix_cache_evictable_pages",
            "KV pages only the prefix cache holds (freed on demand; not in sglang:token_usage)",
            registry=reg)
        self.host_pages = Gauge("pdtopo:host_kv_pages",
                                "KV pages the prefix cache's host tier holds", registry=reg)
        self.host_capacity = Gauge("pdtopo:host_kv_capacity_pages",
                                   "Pages the host tier can hold (engine.host_kv_pages)",
                                   registry=reg)
        self.host_hits = Counter("pdtopo:host_kv_hit_pages",
                                 "Prefix-cache pages loaded back from the host tier",
                                 registry=reg)
        self.host_bytes = Counter("pdtopo:host_kv_bytes", "KV bytes the host tier moved",
                                  labelnames=["direction"], registry=reg)
        self._host_seen = dict.fromkeys(HOST_COUNTERS, 0)
        self.free_pages = Gauge("pdtopo:free_pages", "Free KV pool pages", registry=reg)
        self.total_pages = Gauge("pdtopo:total_pages", "Usable KV pool pages", registry=reg)
        self.preemptions = Counter("pdtopo:preemptions", "Requests preempted (recomputed)",
                                   registry=reg)
        self.requests = Counter("pdtopo:requests", "Finished requests by outcome",
                                labelnames=["role", "finish"], registry=reg)
        self.migrations = Counter(
            "pdtopo:migrations", "Running requests moved between D instances: direction "
            "out|in, result moved|kept|refused", ["direction", "result"], registry=reg)
        self.migration_bytes = Counter("pdtopo:migration_bytes",
                                       "KV bytes of the requests moved away from this D",
                                       registry=reg)
        self.migration_seconds = Histogram(
            "pdtopo:migration_seconds", "A move, from the export at a step boundary to the "
            "target's done", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=reg)
        self.attention_info = Gauge(
            "pdtopo:attention_info",
            "The attention path serving (1): impl, the engine.attention_impl asked for, and why "
            "auto fell back from the TPU kernel (empty if it did not)",
            labelnames=["impl", "requested", "fallback_reason"], registry=reg)
        self._role = role

    def set_cache_hits(self, cached: int, looked_up: int) -> None:
        """sglang:cache_hit_rate from the prompt tokens served by the cache and all looked up."""
        self.cache_hit_rate.set(cached / looked_up if looked_up else 0.0)

    def set_host_tier(self, stats: dict) -> None:
        """The host tier's gauges, and its counters moved by what grew since the last call
        (`stats` holds the totals since start, see Scheduler.publish_stats)."""
        self.host_pages.set(stats["host_kv_pages"])
        self.host_capacity.set(stats["host_kv_capacity"])
        now = {"hits": stats["host_hit_pages"], "to_host": stats["host_bytes_to_host"],
               "to_device": stats["host_bytes_to_device"]}
        seen = self._host_seen
        self.host_hits.inc(max(0, now["hits"] - seen["hits"]))
        for direction in ("to_host", "to_device"):
            self.host_bytes.labels(direction=direction).inc(max(0, now[direction] - seen[direction]))
        self._host_seen = now

    def set_attention(self, paths: Sequence[AttentionPath]) -> None:
        """One `pdtopo:attention_info` series per distinct attention path of this process's
        runners (several only in local mode)."""
        self.attention_info.clear()
        for p in paths:
            self.attention_info.labels(impl=p.impl, requested=p.requested,
                                       fallback_reason=p.fallback_reason or "").set(1)

    def request_finished(self, finish_type: str) -> None:
        self.requests.labels(role=self._role, finish=finish_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
