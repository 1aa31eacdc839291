"""What Prometheus and Grafana need to watch a deployment, from its plan (pure).

    scrape_targets(plan) -> [Target]             every P/D/colocated/local server's /metrics
                                                 (instance leaders) and the router's
                                                 prometheus port
    render_prometheus(plan, interval_s) -> str   RUN/prometheus.yml (`prometheus
                                                 --config.file=RUN/prometheus.yml`)
    render_dashboard(plan) -> str                RUN/grafana-dashboard.json (import it; its
                                                 data source is a variable)

Each target carries `program`, `role` and `topology` labels, so queries can split by role
(`sglang:time_to_first_token_seconds` of `role="decode"` is what PD clients wait for).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import yaml

from pdtopo.launcher.plan.expand import Plan

SERVER_ROLES = ("prefill", "decode", "colocated", "local")
SERVER_JOB = "pdtopo-servers"
ROUTER_JOB = "pdtopo-router"


@dataclass(frozen=True)
class Target:
    job: str
    address: str   # host:port
    labels: dict[str, str]


def scrape_targets(plan: Plan) -> list[Target]:
    out = []
    for p in plan.processes:
        labels = {"program": p.name, "role": p.role, "topology": plan.topology}
        if p.role in SERVER_ROLES and p.leader and "http" in p.ports:
            out.append(Target(SERVER_JOB, f"{p.address}:{p.ports['http']}", labels))
        elif p.role == "proxy" and "prometheus" in p.ports:
            out.append(Target(ROUTER_JOB, f"{p.address}:{p.ports['prometheus']}", labels))
    return out


def render_prometheus(plan: Plan, interval_s: float) -> str:
    jobs: dict[str, list[dict]] = {}
    for t in scrape_targets(plan):
        jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": dict(t.labels)})
    interval = f"{interval_s:g}s"
    doc = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                            "static_configs": groups} for job, groups in jobs.items()],
    }
    head = (f"# Prometheus scrape config of pdtopo deployment {plan.topology} (generated from "
            "plan.json).\n# prometheus --config.file=prometheus.yml\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def _q(quantile: float, metric: str, selector: str = "") -> str:
    return (f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket{selector}"
            "[1m])))")


# (title, unit, [(legend, PromQL)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Time to first token (D: what PD clients wait for)", "s", [
        ("p50", _q(0.5, "sglang:time_to_first_token_seconds", '{role=~"decode|colocated|local"}')),
        ("p99", _q(0.99, "sglang:time_to_first_token_seconds",
                   '{role=~"decode|colocated|local"}'))]),
    ("Inter-token latency", "s", [
        ("p50", _q(0.5, "sglang:inter_token_latency_seconds")),
        ("p99", _q(0.99, "sglang:inter_token_latency_seconds"))]),
    ("Output tokens per second", "none", [
        ("{{program}}", "rate(sglang:generation_tokens_total[1m])")]),
    ("Router requests per second", "reqps", [
        ("router", f'sum(rate(smg_http_requests_total{{job="{ROUTER_JOB}"}}[1m]))')]),
    ("KV transfer throughput (D pulls)", "Bps", [
        ("{{program}}", "rate(pdtopo:kv_transfer_bytes_total[1m])")]),
    ("KV transfer and hand-off latency", "s", [
        ("transfer p50", _q(0.5, "pdtopo:kv_transfer_seconds")),
        ("transfer p99", _q(0.99, "pdtopo:kv_transfer_seconds")),
        ("hand-off p50", _q(0.5, "pdtopo:handoff_seconds")),
        ("hand-off p99", _q(0.99, "pdtopo:handoff_seconds"))]),
    ("Queued and running requests", "none", [
        ("queued {{program}}", "sglang:num_queue_reqs"),
        ("running {{program}}", "sglang:num_running_reqs"),
        ("PD rooms {{program}}", "pdtopo:pd_rooms_in_flight")]),
    ("KV pages used", "none", [
        ("{{program}}", "pdtopo:total_pages - pdtopo:free_pages")]),
    ("PD failures by reason (per second)", "none", [
        ("{{reason}} {{program}}", "rate(pdtopo:pd_failures_total[5m])")]),
    ("Prefix cache hit rate", "percentunit", [
        ("{{program}}", "sglang:cache_hit_rate")]),
    ("Host KV tier: pages held and loaded back (engine.host_kv_pages)", "none", [
        ("held {{program}}", "pdtopo:host_kv_pages"),
        ("capacity {{program}}", "pdtopo:host_kv_capacity_pages"),
        ("loaded back per s {{program}}", "rate(pdtopo:host_kv_hit_pages_total[1m])")]),
    ("Host KV tier: bytes moved (per second)", "Bps", [
        ("{{direction}} {{program}}", "rate(pdtopo:host_kv_bytes_total[1m])")]),
    ("KV copies P holds for D's pull (mode B: none on the device)", "bytes", [
        ("all {{program}}", "pdtopo:held_kv_bytes"),
        ("on the device {{program}}", "pdtopo:held_kv_device_bytes")]),
]


def render_dashboard(plan: Plan) -> str:
    panels = []
    for i, (title, unit, queries) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend}
                        for k, (legend, expr) in enumerate(queries)],
        })
    doc = {
        "title": f"pdtopo {plan.topology}",
        "uid": f"pdtopo-{plan.topology}"[:40],
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }
    return json.dumps(doc, indent=2) + "\n"
