"""What the PD path reports about itself: its Prometheus metrics (`PDMetrics`) and the
timeline of one request that D returns in `meta_info.pd_timeline` (`decode_timeline`).

Metrics: on the server's own registry (beside the engine's `sglang:` names), observed by
the P and D mixins on the scheduler thread.

Every duration is measured inside one process (monotonic clock), never as a difference of two
hosts' clocks:

  D  pdtopo:kv_transfer_seconds        pull start -> pulled KV in hand (the wire time)
     pdtopo:kv_transfer_bytes_total    bytes pulled from P
     pdtopo:kv_transfer_pages_total    pages pulled from P
     pdtopo:kv_pull_queue_seconds      P's `ready` and D's pages both there -> pull start
     pdtopo:handoff_seconds            P's `ready` received -> the request joins D's decode
                                       batch with P's first token (pull queue, pull, scatter,
                                       wait for a decode slot)
     pdtopo:bootstrap_lookup_seconds   one lookup of a P at the bootstrap server
  P  pdtopo:prefill_to_ready_seconds   P's prefill done -> `ready` sent (D's `want` may
                                       arrive after the prefill)
     pdtopo:kv_wait_for_pull_seconds   `ready` sent -> D's `done` (P holds the KV meanwhile)
     pdtopo:held_kv_bytes              bytes of packed KV copies P holds for D's pull now
     pdtopo:held_kv_device_bytes       of those, bytes in device memory (0 with
                                       disaggregation.d2h_staging: staged in host memory)
     pdtopo:held_kv_pages              the same in pages (what the budget counts)
     pdtopo:max_held_kv_pages          the budget, disaggregation.max_held_kv_pages
     pdtopo:held_kv_waiting_requests   requests P holds back because the copies of the
                                       admitted ones would fill the budget
  both
     pdtopo:pd_failures_total{reason}  rooms that ended in failure, by reason
     pdtopo:pd_rooms_in_flight         rooms between arrival and the end of their transfer
     pdtopo:side_channel_dropped_messages_total  malformed or unexpected ZMQ messages dropped

Timeline: the PD stages of one request, as D reports them in `meta_info.pd_timeline`
(milliseconds).

D composes it when the request joins its decode batch, from P's stages (seconds on P's clock,
carried by `ready`.p_stages) and its own receiver's stage times (D's monotonic clock). No
duration is a difference of two processes' clocks:

    p_queue        P: arrival -> first prefill chunk scheduled
    p_prefill      P: first chunk -> prefill done (the first token sampled)
    p_send         P: prefill done -> `ready` sent (KV registered; waiting for D's want)
    d_wait_ready   D: arrival -> `ready` received (P's three stages run inside it)
    transit        d_wait_ready - (p_queue + p_prefill + p_send): the router's skew between
                   sending to P and to D, plus the side channel's delivery (negative when P
                   got the request before D)
    d_pull_queue   D: `ready` -> pull start (waiting for pages or the pull executor)
    d_transfer     D: pull start -> KV in hand
    d_scatter      D: KV in hand -> written into the pool, `done` sent
    d_first_token  D: scattered -> the request joins the decode batch with P's first token
    d_ttft         D: arrival -> first token; equals d_wait_ready + d_pull_queue +
                   d_transfer + d_scatter + d_first_token
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                    5.0, 10.0, 30.0)
# failure reasons (the label values of pdtopo:pd_failures_total), from the status a room's
# failure carries
FAILURE_REASONS = {504: "timeout", 503: "peer_gone", 500: "mismatch", 502: "transfer_error",
                   400: "refused"}


def failure_reason(status: int | None) -> str:
    return FAILURE_REASONS.get(int(status or 502), "other")


class _DroppedMessages:
    """Collector: the side channel's own drop count, read at scrape time."""

    def __init__(self, dropped: Callable[[], int]) -> None:
        self._dropped = dropped

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("pdtopo:side_channel_dropped_messages",
                                     "Side-channel messages dropped (malformed, oversized, "
                                     "for an unknown room or the wrong role)")
        family.add_metric([], float(self._dropped()))
        yield family


class PDMetrics:
    def __init__(self, registry: CollectorRegistry, dropped: Callable[[], int]) -> None:
        reg = registry
        self.transfer_seconds = Histogram(
            "pdtopo:kv_transfer_seconds", "D: KV pull duration (start -> data in hand)",
            buckets=TRANSFER_BUCKETS, registry=reg)
        self.transfer_bytes = Counter("pdtopo:kv_transfer_bytes", "D: KV bytes pulled from P",
                                      registry=reg)
        self.transfer_pages = Counter("pdtopo:kv_transfer_pages", "D: KV pages pulled from P",
                                      registry=reg)
        self.pull_queue_seconds = Histogram(
            "pdtopo:kv_pull_queue_seconds", "D: ready and pages both there -> pull start",
            buckets=TRANSFER_BUCKETS, registry=reg)
        self.handoff_seconds = Histogram(
            "pdtopo:handoff_seconds", "D: P's ready received -> the request joins the decode "
            "batch with P's first token", buckets=TRANSFER_BUCKETS, registry=reg)
        self.lookup_seconds = Histogram(
            "pdtopo:bootstrap_lookup_seconds", "D: one lookup of a P at the bootstrap server",
            buckets=TRANSFER_BUCKETS, registry=reg)
        self.prefill_to_ready_seconds = Histogram(
            "pdtopo:prefill_to_ready_seconds", "P: prefill done -> ready sent to D",
            buckets=TRANSFER_BUCKETS, registry=reg)
        self.wait_for_pull_seconds = Histogram(
            "pdtopo:kv_wait_for_pull_seconds", "P: ready sent -> D's done (KV held for D)",
            buckets=TRANSFER_BUCKETS, registry=reg)
        self.held_kv_bytes = Gauge("pdtopo:held_kv_bytes",
                                   "P: bytes of packed KV copies waiting for D's pull",
                                   registry=reg)
        self.held_kv_device_bytes = Gauge(
            "pdtopo:held_kv_device_bytes",
            "P: of the held KV copies' bytes, those in device memory (0 with d2h_staging)",
            registry=reg)
        self.held_kv_pages = Gauge("pdtopo:held_kv_pages",
                                   "P: pages of packed KV copies waiting for D's pull",
                                   registry=reg)
        self.max_held_kv_pages = Gauge("pdtopo:max_held_kv_pages",
                                       "P: the budget of held KV copies "
                                       "(disaggregation.max_held_kv_pages)", registry=reg)
        self.held_kv_waiting = Gauge("pdtopo:held_kv_waiting_requests",
                                     "P: requests not started because held KV copies would "
                                     "exceed the budget", registry=reg)
        self.failures = Counter("pdtopo:pd_failures", "PD rooms that failed, by reason",
                                labelnames=["reason"], registry=reg)
        for reason in sorted(set(FAILURE_REASONS.values())):
            self.failures.labels(reason=reason)  # every reason is exported, 0 until it happens
        self.rooms_in_flight = Gauge("pdtopo:pd_rooms_in_flight",
                                     "PD rooms between arrival and the end of their transfer",
                                     registry=reg)
        reg.register(_DroppedMessages(dropped))

    def failed(self, status: int | None) -> None:
        self.failures.labels(reason=failure_reason(status)).inc()


# ----------------------------------------------------------------------------- timeline

D_STAGES = ("d_wait_ready", "d_pull_queue", "d_transfer", "d_scatter", "d_first_token")
P_KEYS = {"queue": "p_queue", "prefill": "p_prefill", "send": "p_send"}


def decode_timeline(arrival: float, times: dict[str, float], p_stages: dict[str, float],
                    first_token: float) -> dict[str, float] | None:
    """The timeline in ms, or None when a stage time is missing (e.g. no pull happened)."""
    needed = ("ready", "pull_start", "pull_end", "scattered")
    if any(k not in times for k in needed):
        return None
    points = [arrival, times["ready"], times["pull_start"], times["pull_end"],
              times["scattered"], first_token]
    ms = {name: (b - a) * 1e3 for name, a, b in zip(D_STAGES, points[:-1], points[1:],
                                                    strict=True)}
    out = {P_KEYS[k]: v * 1e3 for k, v in p_stages.items() if k in P_KEYS}
    out.update(ms)
    if len(out) == len(P_KEYS) + len(D_STAGES):
        out["transit"] = ms["d_wait_ready"] - sum(out[k] for k in P_KEYS.values())
    out["d_ttft"] = (first_token - arrival) * 1e3
    return {k: round(v, 3) for k, v in out.items()}
