"""Sweeps: `pdtopo launch -m` benchmarks every job's deployment and summarizes the sweep.

The slow test runs a real 2-job sweep (1p1d_cpu at two request rates, tiny model, short
bench) and checks both jobs' metrics.json, the summary (Markdown, CSV, PNG) and that no
process of either job is left. The fast tests check the summary of hand-written job dirs
(a failed job shows with its error) and the CPU core budget of PD vs colocated plans.
"""

from __future__ import annotations

import csv
import json
import time

import pytest

from pdtopo.bench.sweep import collect, write_summary
from pdtopo.config.compose import compose_config
from pdtopo.launcher.plan.expand import expand_plan
from tests.support.e2e import deployment_overrides, port_block, processes_of_run, run_pdtopo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHORT_BENCH = ["model=tiny_llama", "model.num_layers=1",
               "bench.num_requests=6", "bench.input_len=16",
               "bench.output_len=4", "bench.warmup_requests=1", "bench.progress=false",
               "engine.num_pages=128", "engine.max_model_len=256"]


@pytest.mark.slow
def test_two_job_sweep_end_to_end(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_pdtopo(["launch", "-m", "topology=1p1d_cpu", "bench.request_rate=2,4",
                      *SHORT_BENCH, *deployment_overrides(port_block(40)),
                      f"hydra.sweep.dir={sweep}"], timeout=600)
    out = res.stdout + res.stderr
    try:
        assert res.returncode == 0, out[-5000:]
        for job, rate in (("0", 2), ("1", 4)):
            m = json.loads((sweep / job / "metrics.json").read_text())
            assert f"bench.request_rate={rate}" in m["overrides"]
            assert m["settings"]["request_rate"] == rate
            st = m["stats"]
            assert st["requests"] == {"total": 6, "completed": 6, "failed": 0}, st["errors"]
            assert st["output_tokens"] == 6 * 4
            for key in ("ttft_ms", "e2e_ms"):
                assert 0 < st[key]["p50"] <= st[key]["p99"] < 60_000
            assert st["request_throughput"] > 0 and st["goodput"]["requests"] <= 6
            assert m["launch_to_healthy_s"] > 0
            assert json.loads((sweep / job / "job.json").read_text())["status"] == "ok"
        md = (sweep / "summary.md").read_text()
        assert "bench.request_rate=2" in md and "bench.request_rate=4" in md
        rows = list(csv.DictReader((sweep / "summary.csv").open()))
        assert [r["status"] for r in rows] == ["ok", "ok"]
        assert all(float(r["req/s"]) > 0 for r in rows)
        png = (sweep / "summary.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 1000
        assert "sweep summary" in out
        # no line per bench request from the HTTP client (httpx logs them at INFO)
        assert "HTTP Request:" not in out, [ln for ln in out.splitlines() if "HTTP Req" in ln][:3]
        for job in ("0", "1"):  # nor per heartbeat in the P and D logs
            for log in (sweep / job / "logs").glob("*_0.log"):
                assert "HTTP Request:" not in log.read_text(errors="replace"), log
    finally:
        time.sleep(0.5)
        for job in ("0", "1"):
            left = processes_of_run(sweep / job)
            assert left == [], f"processes of sweep job {job} still alive: {left}"


def _job(d, status, overrides, error=None, stats=None):
    d.mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({"status": status, "error": error,
                                            "topology": "1p1d_cpu", "overrides": overrides,
                                            "launch_to_healthy_s": 5.0}))
    if stats is not None:
        (d / "metrics.json").write_text(json.dumps({"stats": stats}))


def _stats(rps, ttft):
    dist = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft * 2}
    return {"request_throughput": rps, "output_token_throughput": rps * 10,
            "ttft_ms": dist, "itl_ms": dist, "tpot_ms": dist, "e2e_ms": dist,
            "goodput": {"rps": rps, "fraction": 1.0}, "requests": {"failed": 0, "total": 4}}


def test_summary_reports_failed_jobs_with_their_error(tmp_path):
    _job(tmp_path / "0", "ok", ["topology=1p1d_cpu", "bench.request_rate=2"],
         stats=_stats(2.0, 10.0))
    _job(tmp_path / "1", "ok", ["topology=colocated_cpu", "bench.request_rate=2"],
         stats=_stats(2.1, 8.0))
    _job(tmp_path / "2", "failed", ["topology=1p1d_cpu", "bench.request_rate=4"],
         error="launch: decode_0 is FATAL")
    rows = write_summary(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert rows[0]["swept"] == "bench.request_rate=2 topology=1p1d_cpu"
    assert rows[1]["config"] == "topology=colocated_cpu"  # plot line per topology
    md = (tmp_path / "summary.md").read_text()
    assert "decode_0 is FATAL" in md and md.count("\n| ") == 4
    assert (tmp_path / "summary.png").read_bytes().startswith(PNG_MAGIC)
    assert collect(tmp_path)[2]["req/s"] is None


@pytest.mark.parametrize("cpus", [[0, 1], list(range(8)), [2, 3, 5, 7]])
def test_pd_and_colocated_get_the_same_core_budget(cpus):
    pd = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu"]), cpus=cpus)
    colo = expand_plan(compose_config(["model=tiny_llama", "topology=colocated_cpu"]), cpus=cpus)
    p, d = (next(x.cpu_affinity for x in pd.processes if x.role == r)
            for r in ("prefill", "decode"))
    (c,) = [x.cpu_affinity for x in colo.processes if x.role == "colocated"]
    assert set(p).isdisjoint(d)  # P and D never share a core when there are enough
    assert sorted(p + d) == sorted(c) == sorted(cpus)
