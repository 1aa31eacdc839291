"""`pdtopo top [RUN_DIR] [--interval S] [--once]`: a live table of a running deployment from its
programs' /metrics (the targets of RUN/prometheus.yml).

    sample(targets) -> Sample          one scrape of every program (parsed Prometheus text)
    rows(plan, states, older, newer)   per program: role, state, req/s, running/queued, pages
                                       used, host-tier pages used (engine.host_kv_pages) and
                                       loaded back per second, KV transfer GB/s, running
                                       requests moved away/in since start (a D with
                                       disaggregation.migration), TTFT p50/p99 over the window
    run(run_dir, interval_s, once)     draws the table every interval (rich Live) or, with
                                       --once, takes two samples interval apart, prints one
                                       table and exits; plan.json is read again every
                                       interval (scale and the planner change it), and
                                       the live planner's line (RUN/planner.json) is the
                                       table's caption

Rates and quantiles come from the difference of two samples (counters and histogram buckets),
so they describe the last window, not the time since start. Every number is one process's own
measurement; nothing subtracts two hosts' clocks.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live
from rich.table import Table

from pdtopo.config.run_files import PLAN_FILE
from pdtopo.launcher.operate import display, planner_files
from pdtopo.launcher.operate.supervisor_control import Supervisor, SupervisorError
from pdtopo.launcher.plan.expand import Plan
from pdtopo.launcher.render.monitoring import ROUTER_JOB, Target, scrape_targets
from pdtopo.planner.observe import quantile  # one window arithmetic for top and the planner

REQUESTS = {"pdtopo-servers": "pdtopo:requests_total", ROUTER_JOB: "smg_http_requests_total"}
TTFT = "sglang:time_to_first_token_seconds"
MIGRATIONS = "pdtopo:migrations_total"


@dataclass
class Scrape:
    """One program's metrics: sample name -> [(labels, value)]; `error` when it did not answer."""

    at: float
    values: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    error: str | None = None

    def total(self, name: str, **match: str) -> float | None:
        """The sum of `name`'s samples (those whose labels include `match`)."""
        found = self.values.get(name)
        if found is None:
            return None
        return sum(v for labels, v in found if all(labels.get(k) == x for k, x in match.items()))

    def buckets(self, name: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in self.values.get(f"{name}_bucket", []):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + value
        return out


def parse(text: str, at: float) -> Scrape:
    scrape = Scrape(at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            scrape.values.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return scrape


def scrape(target: Target, timeout: float = 2.0) -> Scrape:
    now = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://{target.address}/metrics", timeout=timeout) as resp:
            return parse(resp.read().decode(errors="replace"), now)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Scrape(now, error=str(getattr(exc, "reason", exc)))


def sample(targets: list[Target]) -> dict[str, Scrape]:
    return {t.labels["program"]: scrape(t) for t in targets}


@dataclass
class Row:
    program: str
    role: str
    state: str
    req_s: float | None = None
    running: float | None = None
    queued: float | None = None
    pages: str = "-"
    host_pages: str = "-"              # the prefix cache's host tier: used/capacity
    host_hits_s: float | None = None   # its pages loaded back per second
    transfer_gbps: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    moved: str = "-"                   # running requests moved away / in (migration)
    error: str | None = None


def _rate(name: str, a: Scrape, b: Scrape) -> float | None:
    x, y = a.total(name), b.total(name)
    if x is None or y is None or b.at <= a.at:
        return None
    return max(0.0, y - x) / (b.at - a.at)


def rows(plan: Plan, states: dict[str, str], older: dict[str, Scrape],
         newer: dict[str, Scrape]) -> list[Row]:
    out = []
    for t in scrape_targets(plan):
        name = t.labels["program"]
        a, b = older.get(name), newer.get(name)
        row = Row(name, t.labels["role"], states.get(name, "-"))
        if a is None or b is None or a.error or b.error:
            row.error = next((s.error for s in (b, a) if s is not None and s.error), "no sample")
            out.append(row)
            continue
        row.req_s = _rate(REQUESTS[t.job], a, b)
        row.running = b.total("sglang:num_running_reqs")
        row.queued = b.total("sglang:num_queue_reqs")
        total, free = b.total("pdtopo:total_pages"), b.total("pdtopo:free_pages")
        if total:
            row.pages = f"{total - (free or 0):.0f}/{total:.0f}"
        host = b.total("pdtopo:host_kv_capacity_pages")
        if host:
            row.host_pages = f"{b.total('pdtopo:host_kv_pages') or 0:.0f}/{host:.0f}"
            row.host_hits_s = _rate("pdtopo:host_kv_hit_pages_total", a, b)
        moved = _rate("pdtopo:kv_transfer_bytes_total", a, b)
        row.transfer_gbps = None if moved is None else moved / 1e9
        if b.total(MIGRATIONS) is not None:
            out_n = b.total(MIGRATIONS, direction="out", result="moved") or 0
            in_n = sum(b.total(MIGRATIONS, direction="in", result=r) or 0
                       for r in ("moved", "replayed"))
            row.moved = f"{out_n:.0f}/{in_n:.0f}"
        older_b, newer_b = a.buckets(TTFT), b.buckets(TTFT)
        row.ttft_p50 = quantile(0.5, older_b, newer_b)
        row.ttft_p99 = quantile(0.99, older_b, newer_b)
        out.append(row)
    return out


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def table(plan: Plan, data: list[Row], window_s: float, planner: str | None = None) -> Table:
    """`planner`: the live planner's line (operate/planner_files.summary), as the caption."""
    t = Table(title=f"pdtopo top: {plan.topology} (last {window_s:.1f} s; TTFT in ms)",
              caption=planner, caption_justify="left")
    for col in ("program", "role", "state", "req/s", "run", "queue", "pages", "host pages",
                "host hits/s", "KV GB/s", "moved out/in", "TTFT p50", "TTFT p99"):
        t.add_column(col, justify="left" if col in ("program", "role", "state") else "right",
                     no_wrap=True)
    for r in data:
        if r.error:
            t.add_row(r.program, r.role, r.state, f"[red]{r.error}[/]", *[""] * 9)
            continue
        t.add_row(r.program, r.role, r.state, _num(r.req_s, ".2f"), _num(r.running, ".0f"),
                  _num(r.queued, ".0f"), r.pages, r.host_pages, _num(r.host_hits_s, ".1f"),
                  _num(r.transfer_gbps, ".3f"), r.moved,
                  _ms(r.ttft_p50), _ms(r.ttft_p99))
    return t


def _planner(run_dir: Path) -> str | None:
    return planner_files.summary(planner_files.read_status(run_dir),
                                 planner_files.paused(run_dir))


def _plan(run_dir: Path, plan: Plan) -> Plan:
    """plan.json again (`pdtopo scale` and the planner change it while top runs)."""
    try:
        return Plan.from_dict(json.loads((run_dir / PLAN_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return plan


def _states(run_dir: Path) -> dict[str, str]:
    try:
        return {name: state for name, (state, _pid) in Supervisor(run_dir).states().items()}
    except (SupervisorError, OSError):
        return {}


def run(run_dir: Path, interval_s: float = 2.0, once: bool = False) -> int:
    con = display.console()
    if not con.is_terminal:  # piped or captured: never cut a column to 80 characters
        con = Console(highlight=False, width=160)
    try:
        plan = Plan.from_dict(json.loads((run_dir / PLAN_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        con.print(f"[bold red]pdtopo top:[/] {run_dir}: not a readable pdtopo run ({exc})")
        return 2
    targets = scrape_targets(plan)
    older = sample(targets)
    if once:
        time.sleep(interval_s)
        newer = sample(targets)
        con.print(table(plan, rows(plan, _states(run_dir), older, newer), interval_s,
                        _planner(run_dir)))
        return 0
    try:
        with Live(table(plan, [], 0.0), console=con, refresh_per_second=2) as live:
            while True:
                time.sleep(interval_s)
                plan = _plan(run_dir, plan)
                newer = sample(scrape_targets(plan))
                window = max((s.at for s in newer.values()), default=0.0) - \
                    max((s.at for s in older.values()), default=0.0)
                live.update(table(plan, rows(plan, _states(run_dir), older, newer),
                                  window or interval_s, _planner(run_dir)))
                older = newer
    except KeyboardInterrupt:
        return 0
