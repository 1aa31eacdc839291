"""Benchmark reports: the metrics JSON file and a one-screen rich table.

`write_json(metrics, path)` writes strict JSON; `metrics_table(metrics)` renders the latency
distributions (TTFT, ITL, TPOT, E2E: mean/p50/p90/p99 in ms), throughput, goodput and errors.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"))


def write_json(metrics: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n")
    return path


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def metrics_table(metrics: dict, title: str | None = None) -> Group:
    s = metrics["stats"]
    lat = Table(title=title or f"pdtopo bench {metrics.get('url', '')}", title_justify="left")
    lat.add_column("latency (ms)")
    for col in ("mean", "p50", "p90", "p99"):
        lat.add_column(col, justify="right")
    for key, label in LATENCIES:
        d = s[key]
        lat.add_row(label, *(fmt(d.get(c)) for c in ("mean", "p50", "p90", "p99")))
    req, gp = s["requests"], s["goodput"]
    slo = gp["slo"]
    lines = [
        f"requests {req['completed']}/{req['total']} ok, {req['failed']} failed"
        + (f" ({', '.join(f'{k}: {v}' for k, v in s['errors'].items())})" if s["errors"] else "")
        + f"   duration {fmt(s['duration_s'], 2)} s",
        f"throughput {fmt(s['request_throughput'], 2)} req/s, "
        f"{fmt(s['output_token_throughput'])} out tok/s, "
        f"{fmt(s['total_token_throughput'])} total tok/s",
        f"goodput {fmt(gp['rps'], 2)} req/s ({fmt((gp['fraction'] or 0) * 100, 0)}% within "
        f"TTFT <= {slo['ttft_ms']} ms, ITL p99 <= {slo['itl_ms']} ms)",
    ]
    if s.get("cached_tokens"):
        lines.append(f"prefix cache {fmt((s['cached_token_ratio'] or 0) * 100, 0)}% of prompt "
                     f"tokens cached ({s['cached_tokens']:,} of {s['input_tokens']:,})")
    if metrics.get("launch_to_healthy_s") is not None:
        lines.append(f"launch to healthy {metrics['launch_to_healthy_s']:.1f} s")
    style = "red" if req["failed"] else ""
    parts = [lat, *(Text(line, style=style if i == 0 else "") for i, line in enumerate(lines))]
    if s.get("ttft_breakdown_ms"):
        parts.append(breakdown_table(s["ttft_breakdown_ms"]))
    if s.get("by_tag"):
        parts.append(tag_table(s["by_tag"]))
    return Group(*parts)


def breakdown_table(breakdown: dict) -> Table:
    """Where a PD request's time to first token went (D's pd_timeline, plus the client's rest)."""
    n = int(breakdown.get("requests", {}).get("p50") or 0)
    t = Table(title=f"TTFT by stage (ms, {n} PD requests)", title_justify="left")
    for col in ("stage", "p50", "p99"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for stage, d in breakdown.items():
        if stage != "requests":
            t.add_row(stage, fmt(d.get("p50"), 2), fmt(d.get("p99"), 2))
    return t


def tag_table(by_tag: dict) -> Table:
    """TTFT and cached tokens per request class (per turn index for a multiturn workload)."""
    t = Table(title="by class (multiturn: turn index)", title_justify="left")
    for col in ("class", "requests", "TTFT p50", "TTFT p99", "E2E p50", "cached %"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for tag, st in sorted(by_tag.items()):
        t.add_row(tag, str(st["requests"]["completed"]), fmt(st["ttft_ms"]["p50"]),
                  fmt(st["ttft_ms"]["p99"]), fmt(st["e2e_ms"]["p50"]),
                  fmt((st["cached_token_ratio"] or 0) * 100, 0))
    return t
