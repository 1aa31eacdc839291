"""The live P/D planner program (issue 49): a supervisord program of a PD run with
`planner.enabled=true`, restarted whenever it exits; the deployment serves on as it is while
it is down.

    [program:planner]  (RUN/supervisord.conf; render/supervisord.py)
    command = python -m pdtopo.launcher.programs.planner RUN_DIR

Every `planner.interval_s`:

1. read RUN/plan.json (the P/D counts and leaders: `pdtopo scale` rewrites it), and see
   whether the change it started (`pdtopo scale` as a child, programs/planner_io.py) ended:
   its outcome goes into the decision core's state (a failure backs it off) and the log;
2. scrape every leader's /metrics into an `Observation` (one window per instance since the
   last scrape) and run `plan_step` (pdtopo/planner: load estimate, capacity from the
   profile or the live metrics, the decision with hysteresis and back-off);
3. with `planner.mode=act`, a decision that changes something and no pause: start
   `pdtopo scale prefill=N decode=M RUN` (scale out: health-gated, added to the router;
   scale in: drain, then stop; a role change: both in one scale, the instance that leaves
   freeing the chips the new one takes; the scale's own roll-back on failure);
4. append the decision (and its inputs) to RUN/planner.log, rewrite RUN/planner.json (what
   `pdtopo status`, `top` and `planner status` show) and RUN/planner.prom (pdtopo:planner_*).

The planner pauses (RUN/planner.paused, operate/planner_files.py) when a `pdtopo scale` by
hand runs, or the counts change while it has no change under way; it keeps deciding and
logging, acts again after `pdtopo planner resume`. Its state (hysteresis, back-off, a change
under way) is kept in RUN/planner_state.json, so a restarted planner carries on: a change
whose child outlived the planner (killed, crashed) is followed to its end (the counts it
reached say whether it worked). Stopped by supervisord (SIGTERM: `pdtopo stop`,
`supervisorctl stop planner`) mid-change, it interrupts its `pdtopo scale` like a Ctrl-C,
which rolls back what it began, and waits for it. Its own log (what it does, tracebacks) is
RUN/logs/planner.log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.run_files import CONFIG_FILE, PLAN_FILE
from pdtopo.config.schema import typed_topology
from pdtopo.config.settings import group_settings
from pdtopo.launcher.operate import planner_files as files
from pdtopo.launcher.plan.expand import Plan, Process
from pdtopo.launcher.plan.scale import role_leaders
from pdtopo.launcher.plan.tpu_env import accelerator_spec
from pdtopo.launcher.plan.validate import planner_budget
from pdtopo.launcher.programs.planner_io import (
    SavedState,
    ScaleActor,
    Scraper,
    load_state,
    metrics_text,
    save_state,
)
from pdtopo.planner.budget import ROLES, Budget, Counts
from pdtopo.planner.capacity import InstanceProfile, LiveCapacity
from pdtopo.planner.decide import Decision, finished, started
from pdtopo.planner.profile import ProfileError, load_profile
from pdtopo.planner.settings import PlannerSettings
from pdtopo.planner.step import PlannerMemory, plan_step

log = logging.getLogger("pdtopo.planner")
INTERRUPT_WAIT_S = 25.0  # within the program's stopwaitsecs (render/supervisord.py)


def read_plan(run_dir: Path) -> Plan:
    return Plan.from_dict(json.loads((run_dir / PLAN_FILE).read_text()))


def counts_of(plan: Plan) -> Counts:
    return Counts(len(role_leaders(plan, "prefill")), len(role_leaders(plan, "decode")))


def leaders_of(plan: Plan) -> list[Process]:
    return [p for role in ROLES for p in role_leaders(plan, role)]


@dataclass
class PlannerLoop:
    """One planner: `tick(now)` is one interval (now: Unix time). Tests drive it with a fake
    scraper, actor and clock."""

    run_dir: Path
    settings: PlannerSettings
    budget: Budget
    profile: InstanceProfile | None = None
    scraper: Scraper = field(default_factory=Scraper)
    actor: ScaleActor | None = None
    saved: SavedState | None = None
    max_batch: int | None = None
    last_decision: Decision | None = None

    def __post_init__(self) -> None:
        self.saved = self.saved or load_state(self.run_dir)
        self.actor = self.actor or ScaleActor(self.run_dir)
        self.memory = PlannerMemory(state=self.saved.state,
                                    live=LiveCapacity(max_batch=self.max_batch))
        self.expected: Counts | None = None  # the counts when last seen with no change on
        if self.saved.state.in_flight and self.saved.action_target:
            self.actor.adopt(self.saved.action_pid, Counts(**self.saved.action_target))
            log.info("carrying on with %s (pid %s), started by the previous planner",
                     self.saved.state.in_flight, self.saved.action_pid)

    @property
    def acts(self) -> bool:
        return self.settings.mode == "act"

    def tick(self, now: float) -> dict[str, Any] | None:
        """One interval; returns the decision record it logged (None: nothing to decide yet)."""
        self._follow_change(now)  # first: a change that just ended has rewritten plan.json
        plan = read_plan(self.run_dir)
        counts = counts_of(plan)
        pause = self._pause(counts)
        obs = self.scraper.observe(leaders_of(plan), now)
        for name, error in self.scraper.errors.items():
            log.info("%s: no /metrics (%s); left out of this interval", name, error)
        if obs is None:
            self._publish(now, counts, pause)
            return None
        decision, self.memory = plan_step(obs, counts, self.budget, self.settings,
                                          self.memory, now, self.profile)
        self.last_decision = decision
        acted, not_acted = False, None
        if decision.act:
            under_way = files.scale_under_way(self.run_dir)
            if pause is not None:
                not_acted = f"paused: {pause}"
            elif under_way:
                not_acted = f"a scale is under way ({under_way})"
            else:
                acted = self._start(decision, counts, now)
                not_acted = None if acted else "could not start `pdtopo scale`"
        saved = self.saved
        saved.decisions[decision.action] = saved.decisions.get(decision.action, 0) + 1
        record = {"event": "decision", **decision.to_dict(), "acted": acted,
                  "not_acted": not_acted, "paused": pause,
                  "observation": obs.to_dict(), "unobserved": dict(self.scraper.errors)}
        files.append_line(self.run_dir, record)
        log.info("%s %s -> %s%s: %s", decision.label, counts, decision.target,
                 " (started)" if acted else f" (not carried out: {not_acted})"
                 if not_acted else "", decision.reason)
        self._publish(now, counts, pause)
        return record

    def _start(self, decision: Decision, counts: Counts, now: float) -> bool:
        try:
            pid = self.actor.start(decision, counts)
        except OSError as exc:
            log.error("could not start pdtopo scale for %s: %s", decision.label, exc)
            return False
        self.memory = self.memory.with_state(started(self.memory.state, decision, now))
        self.saved.action_pid, self.saved.action_started = pid, now
        self.saved.action_target = decision.target.to_dict()
        return True

    def _follow_change(self, now: float) -> None:
        def counts_now() -> Counts:
            return counts_of(read_plan(self.run_dir))

        if not self.actor.busy:
            if not self.memory.state.in_flight:
                return
            # in the state with no child known: the counts it left say how it went
            target = self.saved.action_target
            self.actor.adopt(None, Counts(**target) if target else counts_now())
        ok = self.actor.poll(counts_now)
        if ok is None:
            return
        counts = counts_now()
        label = self.memory.state.in_flight
        self.memory = self.memory.with_state(finished(self.memory.state, now, ok))
        began = self.saved.action_started or now
        change = {"event": "outcome", "at": now, "label": label, "ok": ok,
                  "took_s": round(now - began, 1), "counts": counts.to_dict(),
                  "target": self.saved.action_target}
        files.append_line(self.run_dir, change)
        self.saved.outcomes["ok" if ok else "failed"] = \
            self.saved.outcomes.get("ok" if ok else "failed", 0) + 1
        self.saved.last_change = change
        self.saved.action_pid = self.saved.action_target = self.saved.action_started = None
        self.actor.clear()
        self.expected = counts
        log.info("%s %s after %.0f s; now %s%s", label, "done" if ok else "FAILED",
                 now - began, counts, "" if ok else " (backing off; see "
                 "RUN/logs/planner_scale.log)")

    def _pause(self, counts: Counts) -> str | None:
        pause = files.paused(self.run_dir)
        if self.actor.busy:
            return pause
        if pause is None and self.acts and self.expected is not None \
                and counts != self.expected:
            pause = (f"the deployment went from {self.expected} to {counts} without the "
                     "planner (a `pdtopo scale` by hand?)")
            files.pause(self.run_dir, pause)
            log.warning("paused: %s", pause)
        self.expected = counts
        return pause

    def _publish(self, now: float, counts: Counts, pause: str | None) -> None:
        self.saved.state = self.memory.state
        save_state(self.run_dir, self.saved)
        d = self.last_decision
        last = None if d is None else {
            k: v for k, v in d.to_dict().items()
            if k in ("at", "action", "label", "current", "target", "reason", "act",
                     "capacity_source", "needed")}
        status = {"pid": os.getpid(), "mode": self.settings.mode,
                  "interval_s": self.settings.interval_s, "updated_at": now,
                  "counts": counts.to_dict(), "budget": self.budget.to_dict(),
                  "paused": pause, "in_flight": self.memory.state.in_flight,
                  "last_decision": last, "last_change": self.saved.last_change,
                  "decisions": self.saved.decisions, "outcomes": self.saved.outcomes,
                  "unobserved": dict(self.scraper.errors)}
        files.write_atomic(self.run_dir / files.STATUS_FILE, json.dumps(status, indent=1))
        files.write_atomic(self.run_dir / files.METRICS_FILE,
                           metrics_text(self.saved, counts, d, pause is not None, now))

    def run_forever(self, stop: threading.Event) -> None:
        interval = self.settings.interval_s
        due = time.monotonic()
        while not stop.is_set():
            try:
                self.tick(time.time())
            except Exception:  # the planner must outlive any one bad interval; it is logged
                log.exception("planner interval failed")
            due += interval
            stop.wait(max(0.0, due - time.monotonic()))
            due = max(due, time.monotonic() - interval)  # a long tick does not pile up


def load_capacity_profile(settings: PlannerSettings, cfg: DictConfig, budget: Budget,
                          max_batch: int) -> InstanceProfile | None:
    """`planner.capacity.profile` as an InstanceProfile (None without one, or when it cannot
    be read: said in the log; the decisions then say which capacity they used)."""
    path = settings.capacity.profile
    if not path:
        return None
    bench = cfg.get("bench") or {}
    tune = cfg.get("tune") or {}
    try:
        return load_profile(path, chips=budget.prefill_chips, max_batch=max_batch,
                            input_len=bench.get("input_len"), output_len=bench.get("output_len"),
                            goodput_target=float(tune.get("goodput_target", 0.9)))
    except ProfileError as exc:
        log.error("planner.capacity.profile: %s; deciding from the live metrics only", exc)
        return None


def build(run_dir: Path) -> PlannerLoop:
    cfg = OmegaConf.load(run_dir / CONFIG_FILE)
    assert isinstance(cfg, DictConfig)
    settings = PlannerSettings.from_config(cfg.planner)
    topo = typed_topology(cfg)
    budget = planner_budget(settings, topo, accelerator_spec(topo.accelerator, topo.platform))
    max_batch = group_settings(cfg, "engine", "decode").max_running_requests
    profile = load_capacity_profile(settings, cfg, budget, max_batch)
    loop = PlannerLoop(run_dir, settings, budget, profile, max_batch=max_batch)
    files.append_line(run_dir, {
        "event": "start", "at": time.time(), "mode": settings.mode,
        "interval_s": settings.interval_s, "budget": budget.to_dict(),
        "capacity": settings.capacity.source,
        "profile": None if profile is None else profile.to_dict(),
        "slo": OmegaConf.to_container(cfg.planner.slo, resolve=True),
        "hysteresis": OmegaConf.to_container(cfg.planner.hysteresis, resolve=True),
        "in_flight": loop.memory.state.in_flight})
    return loop


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdtopo.launcher.programs.planner RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = Path(args[0])
    loop = build(run_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    s = loop.settings
    log.info("planning %s: mode %s, every %g s, budget %s, capacity %s%s", run_dir, s.mode,
             s.interval_s, loop.budget.to_dict(), s.capacity.source,
             f" (profile {loop.profile.source})" if loop.profile else "")
    try:
        loop.run_forever(stop)
    except KeyboardInterrupt:
        pass
    if loop.actor.proc is not None:  # stopped (not killed) mid-change: scale rolls it back
        log.info("stopping: interrupting %s (pdtopo scale rolls back what it began)",
                 loop.memory.state.in_flight)
        code = loop.actor.interrupt(INTERRUPT_WAIT_S)
        log.info("pdtopo scale ended with %s", code)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
