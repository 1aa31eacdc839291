"""What `pdtopo tune` leaves behind: the ranking and the winner as a topology file.

    code = write_report(tune_dir, outcomes, cfg, overrides, console)

Rows rank candidates by goodput per unit (requests/s within the SLOs at the highest passing
rate, divided by the chips, or on cpu-N the cores, the candidate holds), ties by that rate.
Files in `tune.dir`: summary.md, summary.csv, summary.png (goodput per unit by candidate; the
goodput fraction against the request rate, per candidate, with the target), topology/best.yaml
(the best candidate's topology: `pdtopo launch --config-dir TUNE_DIR topology=best`) and
best.diff.md (`pdtopo diff` of the starting topology against it, as Markdown for a review).
Exit code 0 when some candidate met the target, 1 when none did.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.hosts import host_cpus
from pdtopo.launcher.render import diff
from pdtopo.tune.outcome import Outcome

BEST_NAME = "best"


@dataclass
class Row:
    slug: str
    label: str
    kind: str
    units: int
    status: str
    max_rate: float | None = None
    bounded: bool = True
    goodput_rps: float | None = None
    per_unit: float | None = None
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    launch_s: float | None = None
    runs: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def rate_text(self) -> str:
        if self.max_rate is None:
            return "-"
        return f"{'>= ' if not self.bounded else ''}{self.max_rate:g}"


def _p99(stats: dict[str, Any], key: str) -> float | None:
    value = (stats.get(key) or {}).get("p99")
    return None if value is None else float(value)


def row_of(out: Outcome) -> Row:
    c = out.checked
    row = Row(c.candidate.slug, c.candidate.label, c.candidate.kind, c.units, "ok",
              launch_s=out.launch_s)
    if c.plan is None:
        row.status = f"invalid plan: {c.error}"
        return row
    if out.error:
        row.status = f"launch failed: {out.error}"
        return row
    search = out.search
    assert search is not None
    row.runs = len(search.runs)
    row.bounded = search.bounded
    if search.best_rate <= 0:
        row.status = "no rate within the SLOs"
        return row
    row.max_rate = search.best_rate
    stats = out.records[search.best_rate]["stats"]
    row.goodput_rps = float((stats.get("goodput") or {}).get("rps") or 0.0)
    row.per_unit = row.goodput_rps / max(1, c.units)
    row.ttft_p99_ms = _p99(stats, "ttft_ms")
    row.itl_p99_ms = _p99(stats, "itl_ms")
    return row


def ranked(rows: list[Row]) -> list[Row]:
    good = sorted((r for r in rows if r.ok),
                  key=lambda r: (-(r.per_unit or 0.0), -(r.max_rate or 0.0)))
    return good + [r for r in rows if not r.ok]


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


HEADERS = ("rank", "candidate", "units", "max req/s in SLO", "goodput req/s per unit",
           "TTFT p99 ms", "ITL p99 ms", "launch s", "runs", "status")


def _cells(i: int, r: Row) -> list[str]:
    return [str(i) if r.ok else "-", r.label, str(r.units or "-"), r.rate_text(),
            _fmt(r.per_unit, 3), _fmt(r.ttft_p99_ms, 1), _fmt(r.itl_p99_ms, 1),
            _fmt(r.launch_s, 1), str(r.runs), r.status]


SHORT_HEADERS = ("#", "candidate", "units", "req/s", "/unit", "TTFT99", "ITL99", "up s", "runs")


def table(rows: list[Row], unit: str) -> Table:
    """The terminal's ranking: candidates by slug, short headers; why a candidate has no rank
    goes below the table (`notes`), summary.md has everything."""
    t = Table(title=f"pdtopo tune: req/s within the SLOs, goodput /unit (unit: {unit}), "
              "p99 latencies in ms, launch (up) s")
    for h in SHORT_HEADERS:
        t.add_column(h, no_wrap=True)
    for i, r in enumerate(rows, 1):
        t.add_row(str(i) if r.ok else "-", r.slug, str(r.units or "-"), r.rate_text(),
                  _fmt(r.per_unit, 2), _fmt(r.ttft_p99_ms, 0), _fmt(r.itl_p99_ms, 0),
                  _fmt(r.launch_s, 0), str(r.runs))
    return t


def notes(rows: list[Row]) -> list[str]:
    return [f"  {r.slug}: {r.status}" for r in rows if not r.ok]


def markdown(rows: list[Row], unit: str, target: float, best: Row | None) -> str:
    out = [f"# pdtopo tune\n\nGoodput target: {target:.0%} of requests within `bench.slo`. "
           f"Unit: {unit}. `>=`: the candidate met the target at every rate tried.\n",
           "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in _cells(i, r)) + " |"
            for i, r in enumerate(rows, 1)]
    if best is not None:
        out.append(f"\nBest: **{best.label}** (`{best.slug}`): topology/{BEST_NAME}.yaml, "
                   f"launch with `pdtopo launch --config-dir <this dir> topology={BEST_NAME}`; "
                   "review the change in best.diff.md.")
    return "\n".join(out) + "\n"


def write_csv(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rank", "slug", "label", "kind", "units", "max_rate", "bounded",
                    "goodput_rps", "goodput_per_unit", "ttft_p99_ms", "itl_p99_ms", "launch_s",
                    "runs", "status"])
        for i, r in enumerate(rows, 1):
            w.writerow([i if r.ok else "", r.slug, r.label, r.kind, r.units, r.max_rate,
                        r.bounded, r.goodput_rps, r.per_unit, r.ttft_p99_ms, r.itl_p99_ms,
                        r.launch_s, r.runs, r.status])


def write_png(path: Path, rows: list[Row], outcomes: list[Outcome], unit: str,
              target: float) -> None:
    import matplotlib  # deferred: heavy, and only the tune summary plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after choosing the Agg backend

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    good = [r for r in rows if r.ok]
    left.barh([r.label for r in good][::-1], [r.per_unit or 0 for r in good][::-1])
    left.set_xlabel(f"goodput req/s per {unit}")
    left.set_title("at the highest rate within the SLOs")
    for out in outcomes:
        if out.search is None or not out.search.runs:
            continue
        pts = sorted(out.search.runs)
        right.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                   label=out.checked.candidate.label)
    right.axhline(target, color="grey", linestyle="--", label=f"target {target:.0%}")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("goodput fraction")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def best_topology(cfg: DictConfig, name: str) -> str:
    """A topology file `pdtopo launch` accepts (config dir + group), from a composed config."""
    topo = OmegaConf.to_container(cfg.topology, resolve=True)
    assert isinstance(topo, dict)
    topo["name"] = name
    header = ("# Written by `pdtopo tune`: the best candidate's topology. Launch it with\n"
              "#   pdtopo launch --config-dir <the tune dir> topology=best\n")
    body = yaml.safe_dump({"defaults": ["/pdtopo_topology_schema@_here_", "_self_"], **topo},
                          sort_keys=False)
    return header + body


def write_report(root: Path, outcomes: list[Outcome], cfg: DictConfig, overrides: list[str],
                 con: Console) -> int:
    root.mkdir(parents=True, exist_ok=True)
    unit = "core (cpu-N chips share the host's cores)" if cfg.topology.platform == "cpu" \
        else "chip"
    target = float(cfg.tune.goodput_target)
    rows = ranked([row_of(o) for o in outcomes])
    best_row = rows[0] if rows and rows[0].ok else None
    con.print(table(rows, unit))
    for line in notes(rows):
        con.print(line, markup=False, highlight=False, soft_wrap=True)
    (root / "summary.md").write_text(markdown(rows, unit, target, best_row))
    write_csv(root / "summary.csv", rows)
    write_png(root / "summary.png", rows, outcomes, unit.split()[0], target)
    written = ["summary.md", "summary.csv", "summary.png"]
    if best_row is None:
        con.print("[bold red]no candidate met the goodput target[/] at any rate tried; "
                  f"see {root / 'summary.md'}", soft_wrap=True)
        return 1
    best = next(o for o in outcomes if o.checked.candidate.slug == best_row.slug)
    assert best.checked.cfg is not None
    name = f"{cfg.topology.name}_tuned"
    (root / "topology").mkdir(exist_ok=True)
    (root / "topology" / f"{BEST_NAME}.yaml").write_text(best_topology(best.checked.cfg, name))
    res = diff.diff_configs(compose_config(overrides), best.checked.cfg, host_cpus(),
                            diff.label_of(overrides), f"tune best: {best_row.label}")
    same = "" if not res.identical else (
        "\nThe starting topology is already the best candidate for this workload.\n")
    (root / "best.diff.md").write_text(diff.to_markdown(res) + same)
    written += [f"topology/{BEST_NAME}.yaml", "best.diff.md"]
    con.print(f"[bold green]best:[/] {best_row.label} ({best_row.rate_text()} req/s within the "
              f"SLOs, {_fmt(best_row.per_unit, 3)} per {unit.split()[0]}); wrote "
              f"{', '.join(written)} in {root}", soft_wrap=True)
    con.print(f"  launch it: pdtopo launch --config-dir {root.resolve()} topology={BEST_NAME}",
        soft_wrap=True)
    return 0
