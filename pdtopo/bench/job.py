"""One job of a `pdtopo launch -m` sweep, after its deployment is healthy: benchmark it.

`bench_job(cfg, run_dir, plan, launch_to_healthy_s)` runs the job's `bench` config against the
deployment's proxy (or its colocated server), writes RUN/metrics.json, prints the table and
records RUN/job.json; it never raises (an error becomes a failed job record). The caller
tears the deployment down afterwards. `record_job(run_dir, status, ...)` writes job.json:
`{"status": "ok"|"failed"|"invalid", "error", "overrides", "topology", "exit_code",
"launch_to_healthy_s"}`; the sweep summary reads one per job dir.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from pdtopo.bench.report import metrics_table, write_json
from pdtopo.bench.run import run_bench, url_of_plan, wait_serving
from pdtopo.bench.settings import BenchSettings
from pdtopo.config.settings import group_settings

JOB_FILE = "job.json"
METRICS_FILE = "metrics.json"


def job_overrides() -> list[str]:
    """The job's command-line overrides (empty outside a Hydra job)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def record_job(run_dir: Path, status: str, *, cfg: DictConfig | None = None,
               error: str | None = None, exit_code: int = 0, **extra: Any) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    topo = OmegaConf.select(cfg, "topology.name", default=None) if cfg is not None else None
    data = {"status": status, "exit_code": exit_code, "error": error, "topology": topo,
            "overrides": job_overrides(), **extra}
    path = run_dir / JOB_FILE
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def bench_job(cfg: DictConfig, run_dir: Path, plan: Any, launch_to_healthy_s: float | None,
              con: Console, api_key: str | None = None) -> int:
    """`api_key`: the proxy's key, when it has one (sent, never recorded)."""
    extra = {"launch_to_healthy_s": launch_to_healthy_s}
    try:
        settings = BenchSettings.from_config(cfg.get("bench"))
        url = url_of_plan(plan.to_dict() if hasattr(plan, "to_dict") else plan)
        timeout = group_settings(cfg, "launcher").health_timeout_s
        waited = wait_serving(url, timeout, api_key=api_key)
        if launch_to_healthy_s is not None:
            extra["launch_to_serving_s"] = launch_to_healthy_s + waited
        con.print(f"bench: {settings.num_workload_requests} requests ({settings.workload}) at "
                  f"{settings.request_rate} req/s "
                  f"against {url}")
        metrics = run_bench(url, settings, api_key=api_key)
    except Exception as exc:  # noqa: BLE001 - any failure is a failed job, never a crash
        con.print(f"[bold red]bench failed:[/] {exc}")
        record_job(run_dir, "failed", cfg=cfg, error=f"bench: {exc}", exit_code=1,
                   traceback=traceback.format_exc(), **extra)
        return 1
    metrics.update({"topology": plan.topology if hasattr(plan, "topology") else None,
                    "overrides": job_overrides(), **extra})
    write_json(metrics, Path(run_dir) / METRICS_FILE)
    con.print(metrics_table(metrics, title=f"bench {' '.join(job_overrides()) or url}"))
    failed = metrics["stats"]["requests"]["failed"]
    status = "ok" if failed == 0 else "failed"
    error = None if failed == 0 else \
        f"{failed} of {metrics['stats']['requests']['total']} requests failed: " \
        f"{metrics['stats']['errors']}"
    record_job(run_dir, status, cfg=cfg, error=error, exit_code=0 if failed == 0 else 1,
               **extra)
    return 0 if failed == 0 else 1
