"""`pdtopo tune`: every candidate launched, searched for its highest rate within the SLOs, and
stopped; then the report (pdtopo.tune.report).

    code = tune(overrides, console)

One deployment per candidate serves all its bench runs (a launch costs tens of seconds and
warms the compilation cache; what one run leaves behind that could help the next, the prefix
cache, is flushed on every server before each run, so every rate sees the same cold cache).
It is launched only when a rate is missing from the store, so a rerun after Ctrl-C or a crash
goes straight to the first unfinished step; a deployment a killed tune left running is stopped
first. A candidate that fails to launch is recorded with its error and skipped.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
from omegaconf import DictConfig
from rich.console import Console

from pdtopo.bench.deployments import DetachedDeployment, run_cli
from pdtopo.bench.run import run_bench, url_of_plan, wait_serving
from pdtopo.bench.settings import BenchSettings
from pdtopo.config.compose import compose_config
from pdtopo.config.run_conf import proxy_api_key
from pdtopo.config.run_files import TOKEN_FILE, holds_deployment
from pdtopo.config.schema import typed_proxy, typed_topology
from pdtopo.launcher.operate.hosts import host_cpus
from pdtopo.launcher.operate.preflight import check_model
from pdtopo.launcher.plan.tpu_env import accelerator_spec
from pdtopo.tune import report
from pdtopo.tune.candidates import (
    SERVING,
    Checked,
    budget_of,
    candidate_overrides,
    check_candidates,
)
from pdtopo.tune.outcome import Outcome
from pdtopo.tune.search import find_max_rate
from pdtopo.tune.settings import TuneSettings
from pdtopo.tune.store import ResultStore, run_key

# what a rate's record keeps of the bench stats; with the workload's lengths beside them they
# are also the per-instance capacity profile the live planner reads (pdtopo/planner/profile.py)
STATS_KEPT = ("requests", "request_throughput", "input_token_throughput",
              "output_token_throughput", "ttft_ms", "itl_ms", "e2e_ms", "goodput")


class LaunchFailed(RuntimeError):
    """The candidate's deployment did not come up, or never served a request."""


class Deployed:
    """The candidate's deployment, launched on first use and stopped by `close()`."""

    def __init__(self, run_dir: Path, overrides: list[str], cfg: DictConfig) -> None:
        self.run_dir, self.overrides, self.cfg = run_dir, overrides, cfg
        self.dep: DetachedDeployment | None = None
        self.url = ""
        self.api_key: str | None = None
        self.launch_s = 0.0

    def ensure(self) -> None:
        if self.dep is not None:
            return
        if holds_deployment(self.run_dir):  # a killed tune's deployment: stop it first
            run_cli(["stop", str(self.run_dir)], timeout=180)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        dep = DetachedDeployment(self.run_dir, self.overrides)
        self.dep = dep
        try:
            dep.launch()
            self.url = url_of_plan(dep.plan)
            self.api_key = proxy_api_key(self.run_dir, typed_proxy(self.cfg))
            wait_serving(self.url, api_key=self.api_key)
        except (RuntimeError, TimeoutError, OSError, ValueError,
                subprocess.SubprocessError) as exc:
            raise LaunchFailed(str(exc)) from exc
        self.launch_s = time.perf_counter() - t0

    def flush(self, con: Console) -> None:
        """Empty every server's prefix cache (the same cold start for every run)."""
        assert self.dep is not None
        token = (self.run_dir / TOKEN_FILE).read_text().strip()
        for proc in self.dep.plan["processes"]:
            if proc["role"] not in SERVING or proc.get("leader", True) is False:
                continue
            url = f"http://{proc['address']}:{proc['ports']['http']}/flush_cache"
            try:
                httpx.post(url, headers={"Authorization": f"Bearer {token}"},
                           timeout=30).raise_for_status()
            except httpx.HTTPError as exc:
                con.print(f"  [yellow]warning:[/] could not flush {proc['name']}'s cache: {exc}",
                    soft_wrap=True)

    def close(self) -> None:
        if self.dep is not None and holds_deployment(self.run_dir):
            self.dep.stop()


def _measure(out: Outcome, deployed: Deployed, bench: BenchSettings, store: ResultStore,
             con: Console, where: str):
    cand = out.checked.candidate

    def measure(rate: float) -> float:
        record = store.rate(cand, out.key, rate)
        cached = record is not None
        if record is None:
            deployed.ensure()
            deployed.flush(con)
            metrics = run_bench(deployed.url, replace(bench, request_rate=rate, progress=False),
                                api_key=deployed.api_key)
            stats = metrics["stats"]
            record = {"rate": rate, "goodput": (stats.get("goodput") or {}).get("fraction") or 0.0,
                      "stats": {k: stats.get(k) for k in STATS_KEPT},
                      "workload": {"input_len": bench.input_len, "output_len": bench.output_len},
                      "at": time.time()}
            store.save_rate(cand, out.key, rate, record)
        out.records[rate] = record
        g = float(record["goodput"])
        con.print(f"  {where} {cand.label}: {rate:g} req/s -> goodput {g:.1%}"
                  f"{' (stored)' if cached else ''}", soft_wrap=True)
        return g

    return measure


def stop_leftovers(root: Path, con: Console) -> None:
    """Stop the deployments a killed tune left running (they hold the ports every candidate
    uses)."""
    for run_dir in sorted((root / "deployments").glob("*")):
        if holds_deployment(run_dir) and (run_dir / "supervisord.pid").exists():
            con.print(f"stopping {run_dir}, left running by an interrupted tune", soft_wrap=True)
            run_cli(["stop", str(run_dir)], timeout=180)


def tune_candidate(out: Outcome, s: TuneSettings, bench: BenchSettings, store: ResultStore,
                   overrides: list[str], con: Console, where: str) -> None:
    cand = out.checked.candidate
    assert out.checked.cfg is not None
    launched = store.launch(cand, out.key)
    if launched and launched.get("error"):
        out.error = launched["error"]
        con.print(f"  {where} {cand.label}: skipped, its launch failed before "
                  f"({store.dir(cand, out.key) / 'launch.json'})", soft_wrap=True)
        return
    deployed = Deployed(Path(s.dir).resolve() / "deployments" / cand.slug,
                        [*overrides, *cand.overrides], out.checked.cfg)
    try:
        out.search = find_max_rate(_measure(out, deployed, bench, store, con, where), s)
    except LaunchFailed as exc:
        out.error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        store.save_launch(cand, out.key, {"error": out.error, "detail": str(exc)[-4000:]})
        con.print(f"  {where} {cand.label}: [red]launch failed[/]: {out.error}", soft_wrap=True)
        return
    finally:
        deployed.close()
    if deployed.dep is not None:
        store.save_launch(cand, out.key, {"launch_s": deployed.launch_s})
    out.launch_s = (store.launch(cand, out.key) or {}).get("launch_s")


def dry_run_lines(checked: list[Checked], budget: int) -> list[str]:
    """The candidates, their programs' chips and TPU environment, or why the planner (or the
    model pre-flight) refused them."""
    lines = [f"pdtopo tune: {len(checked)} candidates for {budget} chips (dry run: nothing "
             "started)"]
    for k, c in enumerate(checked, 1):
        cand = c.candidate
        head = f"{k:3d}. {cand.slug}: {cand.label} ({cand.chips} chips"
        if c.plan is None:
            lines.append(f"{head}) refused: {c.error}")
            continue
        lines.append(f"{head}, charged {c.units} units)")
        for p in c.plan.processes:
            env = " ".join(f"{k}={v}" for k, v in p.env.items()
                           if k.startswith(("TPU_", "CLOUD_TPU")))
            where = f"chips {p.chips}" if p.role in SERVING else f"port {p.ports.get('http')}"
            lines.append(f"       {p.name:<14} {where}{'  ' + env if env else ''}")
    return lines


def tune(overrides: list[str], con: Console) -> int:
    cfg = compose_config(overrides)
    s = TuneSettings.from_config(cfg.get("tune"))
    bench = BenchSettings.from_config(cfg.get("bench"))
    topo = typed_topology(cfg)
    acc = accelerator_spec(topo.accelerator, topo.platform)
    budget = budget_of(topo, acc, s.chips)
    cpus = host_cpus()
    checked: list[Checked] = []
    for cand in candidate_overrides(topo, acc, budget, s.kinds):  # until enough valid ones
        if sum(c.plan is not None for c in checked) >= s.max_candidates \
                or len(checked) >= 4 * s.max_candidates:
            break
        checked += check_candidates([cand], lambda extra: compose_config([*overrides, *extra]),
                                    cpus, lambda c, p: check_model(c, p, strict=True))
    if s.dry_run:
        for line in dry_run_lines(checked, budget):
            con.print(line, markup=False, highlight=False, soft_wrap=True)
        return 0
    root = Path(s.dir).resolve()  # deployments launch from the project root: no relative path
    store = ResultStore(root)
    stop_leftovers(root, con)
    valid = [c for c in checked if c.plan is not None]
    con.print(f"pdtopo tune: {len(valid)} of {len(checked)} candidates for {budget} chips of "
              f"{topo.name} ({acc.name}), goodput target {s.goodput_target:.0%} within "
              f"bench.slo; results in {root}", soft_wrap=True)
    outcomes = []
    for k, c in enumerate(checked, 1):
        out = Outcome(c)
        outcomes.append(out)
        if c.plan is None:
            con.print(f"  [{k}/{len(checked)}] {c.candidate.label}: not a valid plan: {c.error}",
                soft_wrap=True)
            continue
        assert c.cfg is not None
        out.key = run_key(c.cfg)
        tune_candidate(out, s, bench, store, overrides, con, f"[{k}/{len(checked)}]")
    return report.write_report(root, outcomes, cfg, overrides, con)
