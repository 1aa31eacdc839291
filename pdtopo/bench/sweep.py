"""Sweep summary across the jobs of `pdtopo launch ... -m`: Markdown, CSV and a PNG plot.

Each job dir of the sweep holds job.json (status, error, overrides, launch time) and, when
the bench ran, metrics.json (`pdtopo.bench.job`). `collect(sweep_dir)` reads them into rows;
`write_summary(sweep_dir)` writes SWEEP/summary.md, summary.csv and summary.png (latency
p50/p99 vs achieved throughput, one line per configuration, i.e. per value of the swept keys
other than the load keys) and returns the rows. A failed job is a row with its error.
`SweepSummary` is the Hydra callback (conf/config.yaml `hydra.callbacks`) that calls it at
the end of a multirun and prints the table; jobs that crashed before writing job.json are
recorded from their Hydra job return.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from rich.console import Console
from rich.table import Table

from pdtopo.bench.job import JOB_FILE, METRICS_FILE, record_job

LOAD_KEYS = ("bench.request_rate", "bench.max_concurrency", "bench.num_requests")
COLUMNS = [  # (header, getter path in metrics stats or job, digits)
    ("req/s", ("request_throughput",), 2),
    ("out tok/s", ("output_token_throughput",), 1),
    ("TTFT p50 ms", ("ttft_ms", "p50"), 1),
    ("TTFT p99 ms", ("ttft_ms", "p99"), 1),
    ("ITL p50 ms", ("itl_ms", "p50"), 1),
    ("ITL p99 ms", ("itl_ms", "p99"), 1),
    ("E2E p50 ms", ("e2e_ms", "p50"), 1),
    ("E2E p99 ms", ("e2e_ms", "p99"), 1),
    ("goodput req/s", ("goodput", "rps"), 2),
    ("goodput %", ("goodput", "fraction"), 0),
]
SUMMARY_FILES = ("summary.md", "summary.csv", "summary.png")


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and (p / JOB_FILE).is_file()]
    return sorted(dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit()
                                       else 0, p.name))


def collect(sweep_dir: Path) -> list[dict]:
    rows = []
    for d in _job_dirs(Path(sweep_dir)):
        job = json.loads((d / JOB_FILE).read_text())
        metrics = json.loads((d / METRICS_FILE).read_text()) if (d / METRICS_FILE).is_file() \
            else None
        row = {"job": d.name, "status": job.get("status"), "error": job.get("error"),
               "topology": job.get("topology"), "overrides": job.get("overrides") or [],
               "launch_to_healthy_s": job.get("launch_to_healthy_s"),
               "launch_to_serving_s": job.get("launch_to_serving_s")}
        stats = metrics["stats"] if metrics else {}
        for header, path, _ in COLUMNS:
            val = _get(stats, path)
            row[header] = val * 100 if header == "goodput %" and val is not None else val
        row["failed"] = _get(stats, ("requests", "failed"))
        row["total"] = _get(stats, ("requests", "total"))
        rows.append(row)
    _label(rows)
    return rows


def _label(rows: list[dict]) -> None:
    """`swept`: the overrides that differ between jobs; `config`: those minus load keys."""
    keyvals = [dict(o.split("=", 1) for o in r["overrides"] if "=" in o) for r in rows]
    keys = sorted({k for kv in keyvals for k in kv})
    varying = [k for k in keys if len({kv.get(k) for kv in keyvals}) > 1]
    for r, kv in zip(rows, keyvals, strict=True):
        r["swept"] = " ".join(f"{k}={kv.get(k, '-')}" for k in varying)
        cfg = [f"{k}={kv.get(k, '-')}" for k in varying if k not in LOAD_KEYS]
        r["config"] = " ".join(cfg) or (r["topology"] or "all")


def _fmt(v: Any, digits: int) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else str(v)


def headers() -> list[str]:
    return ["job", "swept", "topology", "status", *(h for h, _, _ in COLUMNS), "failed",
            "launch s", "error"]


def cells(r: dict) -> list[str]:
    failed = "-" if r["failed"] is None else f"{r['failed']}/{r['total']}"
    return [r["job"], r["swept"] or "-", r["topology"] or "-", r["status"] or "-",
            *(_fmt(r[h], d) for h, _, d in COLUMNS), failed,
            _fmt(r["launch_to_healthy_s"], 1), (r["error"] or "").replace("|", "/")[:200]]


def to_markdown(rows: list[dict], title: str = "pdtopo sweep") -> str:
    lines = [f"# {title}", "", "| " + " | ".join(headers()) + " |",
             "|" + "|".join("---" for _ in headers()) + "|"]
    lines += ["| " + " | ".join(c.replace("\n", " ") for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    fields = ["job", "swept", "config", "topology", "status", *(h for h, _, _ in COLUMNS),
              "failed", "total", "launch_to_healthy_s", "launch_to_serving_s", "overrides", "error"]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "overrides": " ".join(r["overrides"])})


def write_plot(rows: list[dict], path: Path, title: str = "pdtopo sweep") -> None:
    import matplotlib  # deferred: heavy, and only the sweep summary plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after choosing the Agg backend

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["req/s"] is not None:
            groups.setdefault(r["config"], []).append(r)
    panels = (("TTFT", "TTFT p50 ms", "TTFT p99 ms"), ("ITL", "ITL p50 ms", "ITL p99 ms"),
              ("E2E", "E2E p50 ms", "E2E p99 ms"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, p50, p99) in zip(axes, panels, strict=True):
        for i, (label, grp) in enumerate(sorted(groups.items())):
            grp = sorted(grp, key=lambda r: r["req/s"])
            xs = [r["req/s"] for r in grp]
            c = colors[i % len(colors)]
            ax.plot(xs, [r[p50] for r in grp], "o-", color=c, label=f"{label} p50")
            ax.plot(xs, [r[p99] for r in grp], "s--", color=c, label=f"{label} p99")
        ax.set_title(f"{name} latency vs throughput")
        ax.set_xlabel("achieved throughput (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
    if groups:
        axes[0].legend(fontsize=8)
    failed = [r for r in rows if r["status"] != "ok"]
    fig.suptitle(title + (f"  ({len(failed)} failed job(s) not plotted)" if failed else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(sweep_dir: Path, title: str | None = None) -> list[dict]:
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        return rows
    title = title or f"pdtopo sweep {sweep_dir}"
    (sweep_dir / "summary.md").write_text(to_markdown(rows, title))
    write_csv(rows, sweep_dir / "summary.csv")
    write_plot(rows, sweep_dir / "summary.png", title)
    return rows


COMPACT = ("req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p99 ms",
           "goodput %")


def print_summary(rows: list[dict], sweep_dir: Path) -> None:
    """One-screen table of the sweep (the files hold every column)."""
    con = Console(width=None if Console().is_terminal else 140)
    table = Table(title=f"sweep summary ({sweep_dir})", title_justify="left")
    for h in ("job", "swept", "status"):
        table.add_column(h, overflow="fold")
    digits = {h: d for h, _, d in COLUMNS}
    for h in COMPACT:
        table.add_column(h.replace(" ms", "").replace("goodput", "good"), justify="right")
    table.add_column("ok", justify="right")
    table.add_column("up s", justify="right")
    table.add_column("error", overflow="fold", max_width=40)
    for r in rows:
        ok = "-" if r["failed"] is None else f"{r['total'] - r['failed']}/{r['total']}"
        table.add_row(r["job"], r["swept"] or "-", r["status"] or "-",
                      *(_fmt(r[h], digits[h]) for h in COMPACT), ok,
                      _fmt(r["launch_to_healthy_s"], 1), (r["error"] or "")[:120],
                      style=None if r["status"] == "ok" else "red")
    con.print(table)
    con.print(f"written: {', '.join(str(sweep_dir / f) for f in SUMMARY_FILES)}")




class SweepSummary(Callback):  # type: ignore[misc]
    """Hydra callback: summary of a multirun's benchmark jobs at the end of the sweep."""

    def on_job_end(self, config, job_return, **kwargs) -> None:  # noqa: ARG002
        out_dir = Path(str(config.hydra.runtime.output_dir))
        if job_return.status == JobStatus.FAILED and not (out_dir / JOB_FILE).exists() \
                and out_dir.is_dir():
            record_job(out_dir, "failed", error=repr(job_return._return_value), exit_code=1)

    def on_multirun_end(self, config, **kwargs) -> None:  # noqa: ARG002
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows = write_summary(sweep_dir)
        if rows:
            print_summary(rows, sweep_dir)
