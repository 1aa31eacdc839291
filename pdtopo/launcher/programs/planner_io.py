"""What the planner program (programs/planner.py) touches outside its decision core: the
instances' /metrics, `pdtopo scale` as a child process, the state a restarted planner carries
on from, and its own metrics text.

    Scraper(fetch).observe(leaders, now) -> Observation | None
        every P/D leader's /metrics (plan.json's leaders, read each interval: scale rewrites
        it); one window per instance between its last two scrapes; an instance that did not
        answer, or answered once so far (just added), is left out of this interval
    ScaleActor(run_dir).start(decision, current) / .poll() -> None (running) | bool (ok)
        `python -m pdtopo.cli scale prefill=N decode=M RUN` in its own session (a planner
        killed mid-change does not cut the change short; one stopped by supervisord
        interrupts it like a Ctrl-C, and scale rolls back), its output appended to
        RUN/logs/planner_scale.log
    save_state / load_state        RUN/planner_state.json (PlannerState, the tallies, the
                                   change under way with its child's pid and target)
    metrics_text(...)              RUN/planner.prom's pdtopo:planner_* families
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdtopo.launcher.operate.planner_files import (
    SCALE_BY_ENV,
    SCALE_EXPECT_ENV,
    STATE_FILE,
    format_counts,
    read_json,
    write_atomic,
)
from pdtopo.launcher.plan.expand import Process
from pdtopo.planner.budget import ROLES, Counts
from pdtopo.planner.decide import ACTIONS, Decision, PlannerState
from pdtopo.planner.observe import MetricsSample, Observation, observe_instance, parse_metrics

SCRAPE_TIMEOUT_S = 2.0
SCALE_LOG = "logs/planner_scale.log"
Fetch = Callable[[str], str]  # URL -> /metrics text (raises OSError / ValueError)


def fetch_metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
        return resp.read().decode(errors="replace")


@dataclass
class Scraper:
    fetch: Fetch = fetch_metrics
    last: dict[str, MetricsSample] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def observe(self, leaders: list[Process], now: float) -> Observation | None:
        """This interval's observation of the leaders (None: no instance has two scrapes)."""
        instances, newest, older_at = [], {}, []
        self.errors = {}
        for proc in leaders:
            url = f"http://{proc.address}:{proc.ports['http']}/metrics"
            try:
                sample = parse_metrics(self.fetch(url), at=now)
            except (OSError, ValueError, urllib.error.URLError) as exc:
                self.errors[proc.name] = str(getattr(exc, "reason", exc))
                continue
            newest[proc.name] = sample
            before = self.last.get(proc.name)
            if before is not None and before.at < now:
                instances.append(observe_instance(proc.name, proc.role, before, sample))
                older_at.append(before.at)
        self.last = newest  # an instance gone from the plan is forgotten
        if not instances:
            return None
        return Observation(at=now, interval_s=now - min(older_at), instances=tuple(instances))


def scale_command(run_dir: Path, target: Counts) -> list[str]:
    return [sys.executable, "-m", "pdtopo.cli", "scale", f"prefill={target.prefill}",
            f"decode={target.decode}", str(run_dir)]


@dataclass
class ScaleActor:
    """Carries out one decision at a time through `pdtopo scale` (a child process)."""

    run_dir: Path
    proc: subprocess.Popen | None = None
    pid: int | None = None        # a child adopted from a planner before a restart
    target: Counts | None = None

    def start(self, decision: Decision, current: Counts) -> int:
        env = {**os.environ, SCALE_BY_ENV: "planner",
               SCALE_EXPECT_ENV: format_counts(current.to_dict())}
        log = (self.run_dir / SCALE_LOG).open("a")
        log.write(f"--- {decision.label}: {current} -> {decision.target}\n")
        log.flush()
        try:
            self.proc = subprocess.Popen(scale_command(self.run_dir, decision.target),
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        finally:
            log.close()
        self.pid, self.target = self.proc.pid, decision.target
        return self.proc.pid

    def adopt(self, pid: int | None, target: Counts) -> None:
        """A change a previous planner process started (its child may still run)."""
        self.proc, self.pid, self.target = None, pid, target

    def poll(self, counts: Callable[[], Counts]) -> bool | None:
        """None while the change runs; then whether it reached its target (an adopted child's
        exit status is not ours to read: the counts it left, read after it ended, say)."""
        if self.proc is not None:
            code = self.proc.poll()
            if code is None:
                return None
            self.proc = None
            return code == 0
        if self.pid is not None and _scale_alive(self.pid):
            return None
        return counts() == self.target

    def interrupt(self, timeout_s: float) -> int | None:
        """Ctrl-C to our child's session (scale rolls back what it began, as after a Ctrl-C
        by hand) and wait for it; its exit code, None if it had none (or outlived the wait)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            return self.proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return None

    @property
    def busy(self) -> bool:
        return self.proc is not None or self.pid is not None

    def clear(self) -> None:
        self.proc, self.pid, self.target = None, None, None


def _scale_alive(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pdtopo.cli\x00scale" in cmd


@dataclass
class SavedState:
    """RUN/planner_state.json."""

    state: PlannerState = field(default_factory=PlannerState)
    decisions: dict[str, int] = field(default_factory=dict)      # action -> count
    outcomes: dict[str, int] = field(default_factory=dict)       # ok | failed -> count
    action_pid: int | None = None
    action_target: dict[str, int] | None = None
    action_started: float | None = None
    last_change: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": asdict(self.state)}


def load_state(run_dir: Path) -> SavedState:
    data = read_json(run_dir / STATE_FILE)
    if not data:
        return SavedState()
    try:
        state = PlannerState(**data.get("state", {}))
        return SavedState(state, dict(data.get("decisions", {})),
                          dict(data.get("outcomes", {})), data.get("action_pid"),
                          data.get("action_target"), data.get("action_started"),
                          data.get("last_change"))
    except TypeError:
        return SavedState()


def save_state(run_dir: Path, saved: SavedState) -> None:
    write_atomic(run_dir / STATE_FILE, json.dumps(saved.to_dict(), indent=1) + "\n")


def _family(lines: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[dict[str, str], float | None]]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        if value is None:
            continue
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        text = repr(float(value))
        lines.append(f"{name}{{{lab}}} {text}" if lab else f"{name} {text}")


def metrics_text(saved: SavedState, counts: Counts, decision: Decision | None,
                 paused: bool, updated_at: float) -> str:
    """The pdtopo:planner_* families (Prometheus text format, version 0.0.4)."""
    lines: list[str] = []
    _family(lines, "pdtopo:planner_decisions_total", "counter",
            "Planner decisions by action (none included; recommend mode counts too)",
            [({"action": a}, float(saved.decisions.get(a, 0))) for a in ACTIONS])
    _family(lines, "pdtopo:planner_changes_total", "counter",
            "Changes the planner carried out, by outcome",
            [({"outcome": o}, float(saved.outcomes.get(o, 0))) for o in ("ok", "failed")])
    _family(lines, "pdtopo:planner_current_instances", "gauge",
            "Instances per role in the plan now", [({"role": r}, float(counts.of(r)))
                                                   for r in ROLES])
    target = decision.target if decision else counts
    _family(lines, "pdtopo:planner_target_instances", "gauge",
            "Instances per role the last decision aims at",
            [({"role": r}, float(target.of(r))) for r in ROLES])
    if decision is not None:
        load = decision.load
        _family(lines, "pdtopo:planner_estimated_load_tokens_per_second", "gauge",
                "The next interval's load as the planner estimates it (prefill: prompt "
                "tokens/s, decode: output tokens/s)",
                [({"role": r}, load.of(r)) for r in ROLES])
        _family(lines, "pdtopo:planner_needed_instances", "gauge",
                "Instances per role the estimated load needs (fractional)",
                [({"role": r}, decision.needed.get(r)) for r in ROLES])
        _family(lines, "pdtopo:planner_capacity_tokens_per_second", "gauge",
                "One instance's capacity within the SLOs, as the planner counts it",
                [({"role": r, "source": c.source}, c.tokens_per_s) for r in ROLES
                 if (c := decision.capacity.of(r)) is not None])
    _family(lines, "pdtopo:planner_paused", "gauge",
            "1 while the planner is paused (RUN/planner.paused)", [({}, 1.0 if paused else 0.0)])
    _family(lines, "pdtopo:planner_change_in_flight", "gauge",
            "1 while a change the planner started is under way",
            [({}, 1.0 if saved.state.in_flight else 0.0)])
    _family(lines, "pdtopo:planner_last_update_timestamp_seconds", "gauge",
            "When the planner last wrote this file (Unix time)", [({}, updated_at)])
    return "\n".join(lines) + "\n"
