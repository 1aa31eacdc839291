"""Monitoring files from a plan (prometheus.yml, the Grafana dashboard) and `pdtopo top`'s
window arithmetic (rates and quantiles from two samples), without processes."""

from __future__ import annotations

import json

import pytest
import yaml

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.top import parse, quantile, rows
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.render.monitoring import render_dashboard, render_prometheus, scrape_targets


def _plan(*overrides):
    return expand_plan(compose_config(["model=tiny_llama", *overrides]), run_dir="/run",
                       python="py", cpus=[0, 1])


def test_prometheus_config_scrapes_every_server_and_the_router():
    plan = _plan("topology=2p2d_cpu")
    doc = yaml.safe_load(render_prometheus(plan, 2))
    assert doc["global"]["scrape_interval"] == "2s"
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    servers = {g["labels"]["program"]: g["targets"] for g in jobs["pdtopo-servers"]
               ["static_configs"]}
    assert servers == {p.name: [f"{p.address}:{p.ports['http']}"] for p in plan.processes
                       if p.role in ("prefill", "decode")}
    router = jobs["pdtopo-router"]["static_configs"][0]
    proxy = plan.by_name()["proxy"]
    assert router["targets"] == [f"{proxy.address}:{proxy.ports['prometheus']}"]
    assert router["labels"]["role"] == "proxy"


def test_followers_and_minilb_have_no_targets():
    mp = _plan("topology=1p1d_cpu_mp")
    names = [t.labels["program"] for t in scrape_targets(mp)]
    assert names == ["prefill_0_p0", "decode_0_p0", "proxy"]  # leaders serve /metrics
    mini = _plan("topology=1p1d_cpu", "proxy=mini_lb")
    assert [t.job for t in scrape_targets(mini)] == ["pdtopo-servers"] * 2


def test_dashboard_is_valid_json_with_the_asked_panels():
    doc = json.loads(render_dashboard(_plan("topology=1p1d_cpu")))
    text = json.dumps(doc)
    for needle in ("sglang:time_to_first_token_seconds_bucket", "inter_token_latency",
                   "pdtopo:kv_transfer_bytes_total", "pdtopo:handoff_seconds_bucket",
                   "sglang:num_queue_reqs", "pdtopo:free_pages", "pdtopo:pd_failures_total",
                   "smg_http_requests_total", "pdtopo:host_kv_pages",
                   "pdtopo:host_kv_hit_pages_total", "pdtopo:host_kv_bytes_total",
                   "pdtopo:held_kv_device_bytes"):
        assert needle in text, needle
    assert len({p["gridPos"]["y"] * 100 + p["gridPos"]["x"] for p in doc["panels"]}) == \
        len(doc["panels"])  # no two panels on top of each other


def test_quantile_over_a_window():
    older = {0.01: 5.0, 0.1: 5.0, 1.0: 5.0, float("inf"): 5.0}
    newer = {0.01: 5.0, 0.1: 15.0, 1.0: 25.0, float("inf"): 25.0}  # 10 in (0.01, 0.1], 10 above
    assert quantile(0.5, older, newer) == pytest.approx(0.1)
    assert quantile(0.25, older, newer) == pytest.approx(0.055)
    assert quantile(0.99, older, newer) == pytest.approx(0.1 + 0.9 * 0.98)
    assert quantile(0.5, newer, newer) is None  # nothing observed in the window


METRICS = """# TYPE pdtopo:requests counter
pdtopo:requests_total{{finish="length",role="decode"}} {req}
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m"}} 3
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="m"}} 1
# TYPE pdtopo:total_pages gauge
pdtopo:total_pages 100
# TYPE pdtopo:free_pages gauge
pdtopo:free_pages 60
# TYPE pdtopo:kv_transfer_bytes counter
pdtopo:kv_transfer_bytes_total {moved}
# TYPE pdtopo:host_kv_pages gauge
pdtopo:host_kv_pages 12
# TYPE pdtopo:host_kv_capacity_pages gauge
pdtopo:host_kv_capacity_pages {host}
# TYPE pdtopo:host_kv_hit_pages counter
pdtopo:host_kv_hit_pages_total {hits}
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.01",model_name="m"}} {fast}
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {fast}
sglang:time_to_first_token_seconds_count{{model_name="m"}} {fast}
sglang:time_to_first_token_seconds_sum{{model_name="m"}} 0.01
"""


def test_rows_from_two_samples():
    plan = _plan("topology=1p1d_cpu", "proxy=mini_lb")
    older = {n: parse(METRICS.format(req=10, moved=0, fast=4, host=64, hits=0), at=100.0)
             for n in ("prefill_0", "decode_0")}
    newer = {"prefill_0": parse(METRICS.format(req=30, moved=4e9, fast=8, host=64, hits=10),
                                at=102.0)}
    got = {r.program: r for r in rows(plan, {"prefill_0": "RUNNING"}, older, newer)}
    p = got["prefill_0"]
    assert (p.state, p.req_s, p.running, p.queued, p.pages) == ("RUNNING", 10.0, 3, 1, "40/100")
    assert p.transfer_gbps == pytest.approx(2.0)
    assert p.ttft_p50 == pytest.approx(0.005) and p.ttft_p99 == pytest.approx(0.0099)
    assert (p.host_pages, p.host_hits_s) == ("12/64", 5.0)
    assert got["decode_0"].error == "no sample"
    off = parse(METRICS.format(req=30, moved=4e9, fast=8, host=0, hits=0), at=102.0)
    (no_tier,) = [r for r in rows(plan, {}, older, {"prefill_0": off}) if r.program == "prefill_0"]
    assert (no_tier.host_pages, no_tier.host_hits_s) == ("-", None)
