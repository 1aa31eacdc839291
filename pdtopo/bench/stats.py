"""Serving statistics from per-request load-generator results.

`summarize(results, duration_s, slo)` -> plain dict (JSON-ready):
- TTFT: send -> first output token; E2E: send -> end of stream;
- ITL: gaps between successive output tokens; when one stream chunk carries k tokens, the gap
  since the previous chunk is split evenly over the k tokens (k-1 tokens of the first chunk
  count as 0 gaps);
- TPOT: per request (E2E - TTFT) / (output tokens - 1);
- mean / p50 / p90 / p99 (linear interpolation) of each, in milliseconds, over completed
  requests (ITL over all their gaps);
- request, input/output/total token throughput over the run's wall time;
- goodput: completed requests with TTFT <= slo.ttft_ms and own ITL p99 <= slo.itl_ms, per
  second and as a fraction of all requests; error counts by kind;
- prefix cache: prompt tokens the servers reported as cached (meta_info.cached_tokens) and
  their ratio to all prompt tokens of completed requests.
Requests carrying a tag (e.g. a mixed workload) are summarized per tag as well.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pdtopo.bench.loadgen import RequestResult
from pdtopo.bench.settings import Slo

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and percentiles in ms (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "count": 0}
    ms = [v * 1e3 for v in values_s]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms)}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    out["count"] = len(ms)
    return out


def request_itls(r: RequestResult) -> list[float]:
    """Inter-token gaps (s) of one request, chunk gaps split evenly over the chunk's tokens."""
    if len(r.token_times) < 2:
        return []
    groups: list[list[float]] = []
    for t in r.token_times:
        if groups and groups[-1][0] == t:
            groups[-1].append(t)
        else:
            groups.append([t])
    gaps = [0.0] * (len(groups[0]) - 1)
    for prev, cur in zip(groups, groups[1:]):  # noqa: B905
        gaps.extend([(cur[0] - prev[0]) / len(cur)] * len(cur))
    return gaps


def ttft(r: RequestResult) -> float:
    return r.token_times[0] - r.start


def good(r: RequestResult, slo: Slo) -> bool:
    if not r.ok or not r.token_times:
        return False
    if slo.ttft_ms is not None and ttft(r) * 1e3 > slo.ttft_ms:
        return False
    itls = request_itls(r)
    return not (slo.itl_ms is not None and itls and percentile(itls, 99) * 1e3 > slo.itl_ms)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo,
              by_tag: bool = True) -> dict:
    done = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    in_tokens = sum((r.prompt_tokens if r.prompt_tokens is not None else r.input_len or 0)
                    for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    itls = [g for r in done for g in request_itls(r)]
    tpots = [(r.end - r.token_times[0]) / (r.output_tokens - 1)
             for r in done if r.output_tokens > 1]
    n_good = sum(good(r, slo) for r in results)
    dur = duration_s if duration_s > 0 else math.nan
    out = {
        "requests": {"total": len(results), "completed": len(done),
                     "failed": len(results) - len(done)},
        "errors": dict(sorted(errors.items())),
        "error_examples": {k: next(r.error_detail for r in results if r.error == k)
                           for k in errors},
        "duration_s": duration_s,
        "request_throughput": len(done) / dur,
        "input_token_throughput": in_tokens / dur,
        "output_token_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": cached,
        "cached_token_ratio": cached / in_tokens if in_tokens else math.nan,
        "ttft_ms": distribution([ttft(r) for r in done]),
        "itl_ms": distribution(itls),
        "tpot_ms": distribution(tpots),
        "e2e_ms": distribution([r.end - r.start for r in done]),
        "ttft_breakdown_ms": ttft_breakdown(done),
        "goodput": {"requests": n_good, "rps": n_good / dur,
                    "fraction": n_good / len(results) if results else math.nan,
                    "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms}},
    }
    tags = sorted({r.tag for r in results if r.tag})
    if tags and by_tag:
        out["by_tag"] = {t: summarize([r for r in results if r.tag == t], duration_s, slo,
                                      by_tag=False) for t in tags}
    return _finite(out)


# the stages of a PD request's time to first token, in order (pdtopo/runtime/disagg/
# observability.py), then what the client waited beyond D's own TTFT
BREAKDOWN = ("p_queue", "p_prefill", "p_send", "transit", "d_pull_queue", "d_transfer",
             "d_scatter", "d_first_token", "d_ttft", "proxy_network")


def ttft_breakdown(done: Sequence[RequestResult]) -> dict[str, dict[str, float | None]] | None:
    """p50/p99 per TTFT stage over the requests whose server reported a PD timeline, with
    `proxy_network` = the client's TTFT - D's own (the router, HTTP and the client); None for
    servers without one (colocated)."""
    timed = [r for r in done if r.timeline and r.token_times]
    if not timed:
        return None
    out = {}
    for stage in BREAKDOWN:
        if stage == "proxy_network":
            ms = [ttft(r) * 1e3 - r.timeline["d_ttft"] for r in timed if "d_ttft" in r.timeline]
        else:
            ms = [r.timeline[stage] for r in timed if stage in r.timeline]
        out[stage] = {"p50": percentile(ms, 50) if ms else None,
                      "p99": percentile(ms, 99) if ms else None}
    out["requests"] = {"p50": float(len(timed)), "p99": None}
    return out


def _finite(obj):
    """NaN/inf -> None so the JSON is strict."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
