"""`pdtopo tune topology=1p1d_cpu tune.chips=2` over real deployments, on a tiny workload.
The first tune is killed (SIGKILL) while it benches its second candidate; the rerun stops the
deployment the killed tune left running, replays what was stored and finishes: the four
candidates (colocated tp=1 and tp=2, 2x colocated tp=1 behind the router, 1P1D) each
launched, searched and stopped, the ranking, summary files, best topology file and its diff
written. A third run repeats nothing, and the best topology file launches with
`pdtopo launch --config-dir TUNE_DIR topology=best` and serves."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from pdtopo.bench.run import url_of_plan
from tests.support.e2e import (
    REPO_ROOT,
    Deployment,
    deployment_overrides,
    generate,
    port_block,
    processes_of_run,
    run_pdtopo,
)

pytestmark = pytest.mark.slow

SLUGS = {"colocated-tp1", "colocated-tp2", "dp2-tp1", "pd-1p1-1d1"}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    tune_dir = root / "tune"
    overrides = ["topology=1p1d_cpu", "tune.chips=2", "model=tiny_llama", "model.num_layers=1",
                 *deployment_overrides(port_block(40)), f"tune.dir={tune_dir}",
                 "tune.max_runs_per_candidate=2", "tune.start_rate=4",
                 "bench.num_requests=8", "bench.warmup_requests=1", "bench.input_len=16",
                 "bench.output_len=4", "bench.max_concurrency=4", "bench.slo.ttft_ms=5000",
                 "bench.slo.itl_ms=1000"]
    killed = subprocess.Popen([sys.executable, "-m", "pdtopo.cli", "tune", *overrides],
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = [], time.monotonic() + 900
    assert killed.stdout is not None
    for line in killed.stdout:  # kill it in the middle of the second candidate's search
        seen.append(line)
        if "[2/4]" in line and "req/s -> goodput" in line or time.monotonic() > deadline:
            break
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert any("[2/4]" in line for line in seen), "".join(seen)
    first = run_pdtopo(["tune", *overrides], timeout=1200)
    yield tune_dir, overrides, first, "".join(seen)
    assert not processes_of_run(tune_dir), "a candidate's deployment outlived pdtopo tune"


def test_the_rerun_after_a_kill_resumes_and_cleans_up(tuned):
    _, _, first, killed_out = tuned
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    # the killed tune's deployment (candidate 2) was still running: stopped first
    assert "left running by an interrupted tune" in first.stdout, first.stdout
    done_before = [line.strip() for line in killed_out.splitlines() if "req/s -> goodput" in line]
    resumed = [line.strip() for line in first.stdout.splitlines() if "req/s -> goodput" in line]
    for line in done_before:  # every run the killed tune finished is replayed, not repeated
        assert f"{line} (stored)" in resumed, (line, first.stdout)
    assert any("(stored)" not in line for line in resumed)  # and the rest was measured


def test_every_candidate_is_ranked_and_the_files_are_written(tuned):
    tune_dir, _, first, _ = tuned
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "4 of 4 candidates for 2 chips" in first.stdout
    with (tune_dir / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["slug"] for r in rows} == SLUGS
    for r in rows:  # every candidate launched and was measured
        assert r["status"] in ("ok", "no rate within the SLOs"), r
        assert 1 <= int(r["runs"]) <= 2 and float(r["launch_s"]) > 0, r
    ranked = [r for r in rows if r["rank"]]
    assert ranked and [int(r["rank"]) for r in ranked] == list(range(1, len(ranked) + 1))
    per_unit = [float(r["goodput_per_unit"]) for r in ranked]
    assert per_unit == sorted(per_unit, reverse=True)
    for name in ("summary.md", "summary.png", "topology/best.yaml", "best.diff.md"):
        assert (tune_dir / name).is_file(), name
    assert ranked[0]["label"] in (tune_dir / "summary.md").read_text()
    for slug in SLUGS:  # one stored run per rate tried
        stored = list((tune_dir / "runs").glob(f"{slug}-*/rate_*.json"))
        assert stored, slug


def test_a_rerun_resumes_from_the_stored_runs(tuned):
    tune_dir, overrides, first, _ = tuned
    again = run_pdtopo(["tune", *overrides], timeout=600)
    assert again.returncode == 0, again.stdout[-4000:]
    measured = [line for line in again.stdout.splitlines() if "req/s -> goodput" in line]
    assert measured and all("(stored)" in line for line in measured), again.stdout
    assert len(measured) == sum(1 for line in first.stdout.splitlines()
                                if "req/s -> goodput" in line)


def test_the_best_topology_launches_and_serves(tuned, tmp_path):
    tune_dir, _, _, _ = tuned
    dep = Deployment(tmp_path / "best", ["--config-dir", str(tune_dir), "topology=best",
                                         "model=tiny_llama", "model.num_layers=1",
                                         *deployment_overrides(port_block(40))]).launch()
    try:
        assert dep.plan["topology"] == "1p1d_cpu_tuned"
        out = generate(url_of_plan(dep.plan), {"text": "hello", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}})
        assert len(out["output_ids"]) == 4
    finally:
        dep.stop_and_check()
