"""A launched 1P1D (the Rust router) seen from outside: concurrent requests each carry D's
PD timeline (every stage present, non-negative, D's stages adding up to D's TTFT); a real
Prometheus server scrapes it through the run dir's prometheus.yml and PromQL over its HTTP API
sees D's KV transfer bytes, one hand-off per request sent and the router's request count;
`pdtopo bench` prints the TTFT breakdown with the proxy/network rest; under traffic
`pdtopo top --once` prints a row per program with non-zero req/s."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import threading
import time

import httpx
import pytest

from pdtopo.bench.stats import BREAKDOWN
from pdtopo.ports import free_port
from pdtopo.runtime.disagg.observability import D_STAGES
from tests.support.ci import require_tool
from tests.support.constants import TWO_LAYERS
from tests.support.e2e import (
    Deployment,
    deployment_overrides,
    generate,
    port_block,
    run_pdtopo,
    wait_healthy,
)

pytestmark = pytest.mark.slow
PROMETHEUS_HINT = "apt-get install -y prometheus (Debian package; .ci/run installs it)"

REQUESTS = 6


def promql(url: str, query: str) -> float | None:
    body = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10).json()
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_query(url: str, query: str, want, timeout: float = 60.0) -> float | None:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = promql(url, query)
        if value is not None and want(value):
            return value
        time.sleep(0.5)
    return value


def test_prometheus_scrapes_pd_metrics_and_top_shows_traffic(tmp_path_factory):
    prometheus = require_tool("prometheus", PROMETHEUS_HINT)  # before any launch
    run_dir = tmp_path_factory.mktemp("prom") / "run"
    dep = Deployment(run_dir, [*TWO_LAYERS, "topology=1p1d_cpu",
                               "launcher.prometheus_scrape_interval_s=1",
                               *deployment_overrides(port_block(40))]).launch()
    port = free_port()
    prom = subprocess.Popen(
        [prometheus, f"--config.file={run_dir / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path_factory.mktemp('tsdb')}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def one(i: int) -> dict:
            return generate(dep.proxy_url, {"text": f"prometheus request {i} " * (1 + i % 3),
                                            "sampling_params": {"max_new_tokens": 4,
                                                                "temperature": 0}})

        with cf.ThreadPoolExecutor(REQUESTS) as ex:  # concurrent: a small load
            outs = list(ex.map(one, range(REQUESTS)))
        for out in outs:
            assert len(out["output_ids"]) == 4
            tl = out["meta_info"]["pd_timeline"]
            for stage in ("p_queue", "p_prefill", "p_send", "transit", *D_STAGES, "d_ttft"):
                assert stage in tl, (stage, tl)
            for stage in ("p_queue", "p_prefill", "p_send", *D_STAGES):
                assert tl[stage] >= 0, (stage, tl)
            assert abs(sum(tl[k] for k in D_STAGES) - tl["d_ttft"]) <= 1.0, tl
            # transit (D's wait for ready minus P's stages) may be negative: the router may
            # hand the request to P well before D gets its copy
            assert tl["p_prefill"] > 0 and tl["transit"] == pytest.approx(
                tl["d_wait_ready"] - tl["p_queue"] - tl["p_prefill"] - tl["p_send"], abs=0.01)
            assert tl["d_transfer"] > 0 and tl["d_ttft"] < out["meta_info"]["e2e_latency"] * 1e3
        wait_healthy(url, 90, prom, path="/-/ready")  # its API answers 503 until then
        up = wait_query(url, 'count(up{job=~"pdtopo-.*"} == 1)', lambda v: v == 3)
        assert up == 3, f"targets up: {up}; {httpx.get(f'{url}/api/v1/targets').text[:2000]}"
        moved = wait_query(url, 'sum(pdtopo:kv_transfer_bytes_total{role="decode"})',
                           lambda v: v > 0)
        assert moved and moved > 0
        handoffs = wait_query(url, 'sum(pdtopo:handoff_seconds_count{role="decode"})',
                              lambda v: v >= REQUESTS)
        assert handoffs == REQUESTS  # one hand-off per PD request, nothing else
        transfers = promql(url, 'sum(pdtopo:kv_transfer_seconds_count{role="decode"})')
        assert transfers == REQUESTS
        routed = wait_query(url, 'sum(smg_http_requests_total{job="pdtopo-router"})',
                            lambda v: v >= REQUESTS)
        assert routed is not None and routed >= REQUESTS, routed
        failures = promql(url, "sum(pdtopo:pd_failures_total)")
        assert failures == 0
        for name in ("prefill_0", "decode_0"):  # on loopback the side channel stays plain
            state = httpx.get(f"{dep.url(name)}/pdtopo/state", timeout=10).json()
            assert state["pd_side_channel_curve"] is False

        metrics_file = run_dir / "bench.json"
        bench = run_pdtopo(["bench", dep.proxy_url, "--output", str(metrics_file),
                            "bench.num_requests=6", "bench.warmup_requests=0",
                            "bench.input_len=32", "bench.output_len=4",
                            "bench.max_concurrency=2"], timeout=300)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "TTFT by stage" in bench.stdout and "proxy_network" in bench.stdout, bench.stdout
        breakdown = json.loads(metrics_file.read_text())["stats"]["ttft_breakdown_ms"]
        assert list(breakdown)[:len(BREAKDOWN)] == list(BREAKDOWN)
        assert breakdown["proxy_network"]["p50"] >= 0 and breakdown["d_transfer"]["p50"] > 0

        stop = threading.Event()

        def traffic() -> None:
            n = 0
            while not stop.is_set():
                generate(dep.proxy_url, {"text": f"top {n}", "sampling_params":
                                         {"max_new_tokens": 4, "temperature": 0}})
                n += 1

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        try:
            time.sleep(1)
            res = run_pdtopo(["top", str(run_dir), "--once", "--interval", "3"], timeout=60)
        finally:
            stop.set()
            thread.join(60)
        assert res.returncode == 0, res.stdout + res.stderr
        lines = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
                 for line in res.stdout.splitlines() if line.count("│") >= 10}
        for name in ("prefill_0", "decode_0", "proxy"):
            assert name in lines, res.stdout
            assert float(lines[name][3]) > 0, (name, res.stdout)  # req/s
        assert lines["decode_0"][2] == "RUNNING", res.stdout
    finally:
        prom.terminate()
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
        dep.stop_and_check()
