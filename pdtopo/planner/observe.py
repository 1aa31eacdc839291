"""What the planner sees of one interval: every P and D instance's /metrics, two scrapes apart.

    older = parse_metrics(text_a, at=t0)        # one scrape of one server (Prometheus text)
    newer = parse_metrics(text_b, at=t1)
    inst = observe_instance("prefill_0", "prefill", older, newer)
    obs = Observation(at=t1, interval_s=t1 - t0, instances=(inst, ...))

The metrics are the servers' own (pdtopo/runtime/engine/metrics.py): counters
`sglang:prompt_tokens_total`, `sglang:generation_tokens_total`, `pdtopo:requests_total`; gauges
`sglang:num_queue_reqs`, `sglang:num_running_reqs`, `pdtopo:free_pages`, `pdtopo:total_pages`;
histograms `sglang:time_to_first_token_seconds`, `sglang:inter_token_latency_seconds`. Rates
and percentiles come from the difference of the two scrapes (the last window, not the time
since start). The mean wait in the queue is `sglang:queue_time_seconds`'s over the window
when a server exports that histogram, and otherwise Little's law: requests queued / requests
finished per second. Percentiles are in milliseconds under bench's names (p50, p90, p99).
Pure: the caller fetches the text (the simulator builds observations directly).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PERCENTILES = (50, 90, 99)  # as pdtopo.bench.stats names them
PROMPT_TOKENS = "sglang:prompt_tokens_total"
GENERATION_TOKENS = "sglang:generation_tokens_total"
REQUESTS = "pdtopo:requests_total"
QUEUE = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
FREE_PAGES = "pdtopo:free_pages"
TOTAL_PAGES = "pdtopo:total_pages"
TTFT = "sglang:time_to_first_token_seconds"
ITL = "sglang:inter_token_latency_seconds"
QUEUE_TIME = "sglang:queue_time_seconds"  # sglang's name; read when a server exports it
Buckets = dict[float, float]  # upper bound (le) -> cumulative count


@dataclass(frozen=True)
class MetricsSample:
    """One scrape of one server: cumulative counters, gauges and histogram buckets (summed
    over label sets)."""

    at: float
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests: float = 0.0
    queue: float = 0.0
    running: float = 0.0
    free_pages: float | None = None
    total_pages: float | None = None
    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    queue_time_sum: float | None = None
    queue_time_count: float | None = None


def parse_metrics(text: str, at: float) -> MetricsSample:
    """A server's /metrics text (Prometheus exposition) as a sample taken at `at` (seconds,
    the caller's monotonic clock). ValueError on text the parser refuses."""
    totals: dict[str, float] = {}
    buckets: dict[str, Buckets] = {TTFT: {}, ITL: {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") and s.name[:-7] in buckets:
                le = float(s.labels["le"])
                hist = buckets[s.name[:-7]]
                hist[le] = hist.get(le, 0.0) + float(s.value)
            else:
                totals[s.name] = totals.get(s.name, 0.0) + float(s.value)
    return MetricsSample(
        at=at, prompt_tokens=totals.get(PROMPT_TOKENS, 0.0),
        generation_tokens=totals.get(GENERATION_TOKENS, 0.0),
        requests=totals.get(REQUESTS, 0.0), queue=totals.get(QUEUE, 0.0),
        running=totals.get(RUNNING, 0.0), free_pages=totals.get(FREE_PAGES),
        total_pages=totals.get(TOTAL_PAGES), ttft=buckets[TTFT], itl=buckets[ITL],
        queue_time_sum=totals.get(f"{QUEUE_TIME}_sum"),
        queue_time_count=totals.get(f"{QUEUE_TIME}_count"))


def quantile(q: float, older: Buckets, newer: Buckets) -> float | None:
    """The q-quantile of the observations between two cumulative bucket snapshots (linear
    within a bucket, as Prometheus' histogram_quantile); None without observations."""
    bounds = sorted(newer)
    counts = [newer[b] - older.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if math.isinf(bound):
                return lower  # in the +Inf bucket: the highest finite bound
            width = cum - below
            return lower + (bound - lower) * ((rank - below) / width if width else 1.0)
        lower, below = bound, cum
    return lower


def percentiles_ms(older: Buckets, newer: Buckets) -> dict[str, float | None]:
    """p50 / p90 / p99 of a histogram's window, in ms (None without observations)."""
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        v = quantile(p / 100, older, newer)
        out[f"p{p}"] = None if v is None else v * 1e3
    return out


@dataclass(frozen=True)
class InstanceObservation:
    """One instance over one window. Rates per second; latencies in ms by percentile name."""

    name: str
    role: str                    # prefill | decode
    queue_depth: float           # requests waiting at the end of the window
    waiting_s: float | None      # their mean wait (see the module docstring)
    prompt_tps: float            # prompt tokens processed per second
    decode_tps: float            # output tokens generated per second
    requests_per_s: float        # requests finished per second
    running: float               # requests in the batch at the end of the window
    free_pages: float | None = None
    total_pages: float | None = None
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)
    busy: bool = False           # requests were waiting at both ends of the window

    def latency(self, kind: str, percentile: int) -> float | None:
        """`kind` ttft | itl at `percentile` (50, 90, 99), ms."""
        return (self.ttft_ms if kind == "ttft" else self.itl_ms).get(f"p{percentile}")


def observe_instance(name: str, role: str, older: MetricsSample, newer: MetricsSample
                     ) -> InstanceObservation:
    """The window between two scrapes of one server (counter resets read as no change)."""
    dt = newer.at - older.at
    if dt <= 0:
        raise ValueError(f"{name}: the newer scrape ({newer.at}) is not after the older "
                         f"({older.at})")

    def rate(a: float, b: float) -> float:
        return max(0.0, b - a) / dt

    requests_per_s = rate(older.requests, newer.requests)
    waiting: float | None = None
    if newer.queue_time_count is not None and older.queue_time_count is not None \
            and newer.queue_time_count > older.queue_time_count:
        waiting = ((newer.queue_time_sum or 0.0) - (older.queue_time_sum or 0.0)) \
            / (newer.queue_time_count - older.queue_time_count)
    elif requests_per_s > 0:
        waiting = newer.queue / requests_per_s
    return InstanceObservation(
        name=name, role=role, queue_depth=newer.queue, waiting_s=waiting,
        prompt_tps=rate(older.prompt_tokens, newer.prompt_tokens),
        decode_tps=rate(older.generation_tokens, newer.generation_tokens),
        requests_per_s=requests_per_s, running=newer.running,
        free_pages=newer.free_pages, total_pages=newer.total_pages,
        ttft_ms=percentiles_ms(older.ttft, newer.ttft),
        itl_ms=percentiles_ms(older.itl, newer.itl),
        busy=older.queue > 0 and newer.queue > 0)


@dataclass(frozen=True)
class Observation:
    """Every P and D instance over one interval ending at `at`."""

    at: float
    interval_s: float
    instances: tuple[InstanceObservation, ...]

    def of(self, role: str) -> tuple[InstanceObservation, ...]:
        return tuple(i for i in self.instances if i.role == role)

    def total(self, role: str, attr: str) -> float:
        return sum(getattr(i, attr) for i in self.of(role))

    def worst(self, role: str, kind: str, percentile: int) -> float | None:
        """The highest `kind` latency percentile among the role's instances (ms)."""
        values = [v for i in self.of(role) if (v := i.latency(kind, percentile)) is not None]
        return max(values) if values else None

    def to_dict(self) -> dict:
        return asdict(self)
