"""`pdtopo scale prefill=N decode=M [RUN_DIR]`: change a running PD deployment's instance counts.

    counts -> plan/scale.py (new config + plan, running programs unmoved)
           -> scale in:  drain each instance that goes (highest index first), remove it from
                         the router, stop it and remove its supervisord group
           -> run dir:   config.yaml, plan.json, supervisord.conf and prometheus.yml
                         describe the new shape
           -> scale out: supervisord rereads its conf and starts the new programs only; wait
                         for their /health (crash loops end the wait at once), add them to the
                         router (`POST /workers`), wait until it lists them healthy

One scale at a time per run dir (RUN/.scale.lock); a scale by hand pauses an acting live
planner, and the planner's own scale is refused once the deployment changed under it
(operate/planner_files.py). A failed scale-out is rolled back: the new programs are removed
from the router and from supervisord and the run dir is restored. A drain that does not finish within
`launcher.drain_timeout_s` keeps the instance (drain undone) and fails the scale. Every step
prints what it waits for and how long it took.

The running router learns of workers through its API; its program entry in supervisord.conf
lists the new set too, but supervisord keeps the command it started it with until the router
program is restarted (not something scale does: it would cut the requests in flight).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.live import Live

from pdtopo.config import run_conf
from pdtopo.config.credentials import API_KEY_ENV
from pdtopo.config.run_files import (
    CONF_FILE,
    CONFIG_FILE,
    DASHBOARD_FILE,
    PLAN_FILE,
    PROMETHEUS_FILE,
)
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.operate import display
from pdtopo.launcher.operate.admin_http import OperationError, wait_until
from pdtopo.launcher.operate.deployment import Deployment
from pdtopo.launcher.operate.health import wait_for_programs
from pdtopo.launcher.operate.hosts import host_cpus
from pdtopo.launcher.operate.planner_files import SCALE_BY_ENV, guard_scale, scale_lock
from pdtopo.launcher.operate.rolling import Operator
from pdtopo.launcher.operate.supervisor_control import CALL_ERRORS, log_tail
from pdtopo.launcher.plan.expand import Plan, Process
from pdtopo.launcher.plan.scale import (
    ROLES,
    changed_leaders,
    parse_counts,
    role_leaders,
    scaled_config,
    scaled_plan,
)
from pdtopo.launcher.render.run_dir import monitoring_files, resolved_config
from pdtopo.launcher.render.supervisord import program_settings, render_supervisord
from pdtopo.ports import port_in_use

ROUTER_CHANGE_S = 20.0  # the router applies /workers changes in the background
SHAPE_FILES = (CONFIG_FILE, PLAN_FILE, CONF_FILE, PROMETHEUS_FILE, DASHBOARD_FILE)
LIVE_STATES = ("STARTING", "RUNNING", "BACKOFF", "STOPPING")


@dataclass
class RunFiles:
    """The files of a run dir that describe its shape: name -> text."""

    texts: dict[str, str]

    @classmethod
    def read(cls, run_dir: Path) -> RunFiles:
        return cls({name: (run_dir / name).read_text() for name in SHAPE_FILES
                    if (run_dir / name).is_file()})

    def write(self, run_dir: Path) -> None:
        for name, text in self.texts.items():
            tmp = run_dir / f".{name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                         0o600 if name == CONF_FILE else 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, run_dir / name)  # a reader never sees half a file


def plan_scale(dep: Deployment, counts: dict[str, int]) -> tuple[DictConfig, Plan]:
    cfg = OmegaConf.load(dep.run_dir / CONFIG_FILE)
    assert isinstance(cfg, DictConfig)
    new_cfg = scaled_config(cfg, dep.plan, counts, port_taken=port_in_use)
    servers = [p for p in dep.plan.processes if p.role in ROLES]
    new_plan = scaled_plan(new_cfg, dep.plan, run_dir=str(dep.run_dir),
                           python=servers[0].command[0], cpus=host_cpus())
    # the key itself is only in supervisord.conf (config.yaml holds it redacted): the proxy and
    # every server that checks credentials (server.http_auth) get the running one again
    key = run_conf.program_environment(dep.run_dir, "proxy").get(API_KEY_ENV)
    if key:
        new_plan.processes = [
            replace(p, secret_env={**p.secret_env, API_KEY_ENV: key})
            if p.role == "proxy" or API_KEY_ENV in p.secret_env
            or API_KEY_ENV in run_conf.program_environment(dep.run_dir, p.name) else p
            for p in new_plan.processes]
    return new_cfg, new_plan


def render_files(dep: Deployment, cfg: DictConfig, plan: Plan) -> RunFiles:
    conf = render_supervisord(plan, run_dir=dep.run_dir, token=dep.token,
                              workdir=run_conf.workdir(dep.run_dir) or Path.cwd(),
                              settings=program_settings(cfg))
    return RunFiles({CONFIG_FILE: resolved_config(cfg), PLAN_FILE: plan.to_json(),
                     CONF_FILE: conf, **monitoring_files(cfg, plan)})


class Scaler:
    """Carries out one scale: removals, the new run dir, additions (rolled back on failure)."""

    def __init__(self, dep: Deployment, say: Callable[[str], None]) -> None:
        self.dep = dep
        self.say = say
        self.op = Operator(dep, say)
        self.sv = self.op.sv
        self.con = display.console()

    def check_kept_serve(self, new_plan: Plan, removed: list[Process]) -> None:
        """Scale-in only when an instance that stays serves each shrinking role (one drained
        by hand, or down, does not count): otherwise the role would have no server."""
        for role in dict.fromkeys(p.role for p in removed):
            kept = role_leaders(new_plan, role)
            if not any(self.op._serving(p) for p in kept):
                raise OperationError(
                    f"no {role} instance that stays ({', '.join(p.name for p in kept)}) is "
                    f"serving now (drained or down), so removing "
                    f"{', '.join(p.name for p in removed if p.role == role)} would leave the "
                    f"router no {role} server; `pdtopo drain ... --undo` or restart it first")

    def remove(self, leader: Process) -> None:
        left = self.op.drain(leader)
        try:
            if left:
                raise OperationError(
                    f"{leader.name}: {left} requests still in flight after "
                    f"launcher.drain_timeout_s={self.dep.launcher.drain_timeout_s:g} s; kept "
                    "it (drain undone). Raise the timeout or retry later")
            self.dep.router.remove(leader)
            gone, took = wait_until(
                lambda: self.dep.router.answers_listed(leader.url, False), ROUTER_CHANGE_S)
            if not gone:
                raise OperationError(f"{leader.name}: the router still lists {leader.url} "
                                     f"{took:.0f} s after its removal; kept it (drain undone)")
        except (OperationError, KeyboardInterrupt):
            self._keep(leader)
            raise
        self.say(f"{leader.name}: removed from the router after {took:.1f} s")
        self._drop_programs([leader.name])
        self.say(f"{leader.name}: stopped and removed from supervisord")

    def _keep(self, leader: Process) -> None:
        """Undo a drain that will not be followed by a removal: the instance serves again."""
        try:
            if not self.dep.router.listed(leader.url):
                self.dep.router.add(leader)
            self.op.set_draining(leader, False)
            self.op.readmit(leader)
        except OperationError as exc:
            self.say(f"{leader.name}: could not put it back in service: {exc}; run "
                     f"`pdtopo drain {leader.name} {self.dep.run_dir} --undo`")

    def _drop_programs(self, names: list[str]) -> None:
        """Stop (when it runs) and remove each program's supervisord group; every name is
        tried, the first failure is raised after the rest."""
        failures = []
        states = self.sv.states()
        for name in names:
            try:
                if states.get(name, ("STOPPED", 0))[0] in LIVE_STATES:
                    self.sv.call("supervisor.stopProcess", name, True)
                if name in states:
                    self.sv.call("supervisor.removeProcessGroup", name)
            except CALL_ERRORS as exc:
                failures.append(f"{name}: {exc}")
        if failures:
            raise OperationError(f"supervisord could not stop or remove {'; '.join(failures)}")

    def start(self, plan: Plan, added: list[Process]) -> None:
        """Reread supervisord.conf and start the new programs, waiting for their health."""
        try:
            changes = self.sv.call("supervisor.reloadConfig")[0]
            for name in changes[0]:  # added groups only: running programs are not touched
                self.sv.call("supervisor.addProcessGroup", name)
        except CALL_ERRORS as exc:
            raise OperationError(f"supervisord could not add {', '.join(p.name for p in added)}:"
                                 f" {exc}") from None
        part = Plan(plan.topology, plan.mode, plan.platform, plan.accelerator,
                    plan.bootstrap_url, plan.proxy_url, added)
        timeout = self.dep.launcher.health_timeout_s
        self.say(f"started {', '.join(p.name for p in added)}; waiting for /health (at most "
                 f"launcher.health_timeout_s={timeout:g} s)")
        def draw(rows: list) -> Any:
            return display.health_table(part, rows, title="pdtopo scale")

        with Live(draw([]), console=self.con, refresh_per_second=4) as live:
            result = wait_for_programs(part, self.sv.states, timeout, workers_fn=None,
                                       on_update=lambda rows: live.update(draw(rows)))
        self.con.print()
        if not result.ok:
            self.con.rule(f"last lines of logs/{result.failed}.log")
            self.con.print(log_tail(self.dep.run_dir, result.failed or ""), markup=False,
                           highlight=False)
            self.con.rule()
            raise OperationError(result.reason)

    def register(self, leader: Process) -> None:
        self.dep.router.add(leader)
        healthy, took = wait_until(lambda: self.dep.router.health(leader.url) is True,
                                   self.op.readmission_s + ROUTER_CHANGE_S)
        if not healthy:
            raise OperationError(f"{leader.name}: the router does not list it healthy "
                                 f"{took:.0f} s after it was added")
        self.say(f"{leader.name}: in the router after {took:.1f} s")

    def roll_back(self, added: list[Process], old: RunFiles) -> None:
        """Every step on its own (one failing does not skip the rest); the run dir is restored
        whatever happens."""
        self.say("rolling back: removing the new programs, restoring the run dir")
        try:
            for leader in added:
                try:  # a queued addition may show up late: wait for it, then remove it
                    wait_until(lambda leader=leader: self.dep.router.answers_listed(
                        leader.url, True), 3.0)
                    self.dep.router.remove(leader)
                except OperationError as exc:
                    self.say(f"{leader.name}: {exc}")
            try:
                self._drop_programs([p.name for p in added])
            except OperationError as exc:
                self.say(str(exc))
        finally:
            old.write(self.dep.run_dir)
            try:
                self.sv.call("supervisor.reloadConfig")
            except CALL_ERRORS as exc:
                self.say(f"supervisord could not reread the restored conf: {exc}")


def _shape(plan: Plan) -> str:
    return ", ".join(f"{role}={len(role_leaders(plan, role))}" for role in ROLES)


def _counts(plan: Plan) -> dict[str, int]:
    return {role: len(role_leaders(plan, role)) for role in ROLES}


def _apply(scaler: Scaler, files: RunFiles, con: Any) -> None:
    files.write(scaler.dep.run_dir)
    try:
        scaler.sv.call("supervisor.reloadConfig")
    except CALL_ERRORS as exc:
        con.print(f"[bold yellow]WARNING:[/] supervisord could not reread {CONF_FILE}: {exc}")


def run(run_dir: Path, args: list[str]) -> int:
    """The CLI verb: 0 when the deployment has the new shape, 1 when it failed (the run dir
    then describes what runs: the shape reached), 2 for a bad request (nothing changed).
    One scale at a time per run dir (RUN/.scale.lock: a second one waits)."""
    con = display.console()
    holder = ("the planner's" if os.environ.get(SCALE_BY_ENV) == "planner" else "by hand") \
        + f" `pdtopo scale {' '.join(args)}`"
    if not run_dir.is_dir():
        display.console(stderr=True).print(f"[bold red]pdtopo scale:[/] {run_dir}: no run dir")
        return 2
    with scale_lock(run_dir, holder, con.print):
        return _run(run_dir, args, con)


def _run(run_dir: Path, args: list[str], con: Any) -> int:
    err = display.console(stderr=True)
    try:
        counts = parse_counts(args)
        dep = Deployment.load(run_dir, verb="scale")
        new_cfg, new_plan = plan_scale(dep, counts)
        before = _counts(dep.plan)
        # after the scale-in, before the scale-out: where a failed scale-out returns to
        mid = {role: min(counts.get(role, n), n) for role, n in before.items()}
        new = render_files(dep, new_cfg, new_plan)
        restore = (render_files(dep, *plan_scale(dep, mid)) if mid != before
                   else RunFiles.read(run_dir))
    except TopologyError as exc:
        display.print_topology_error(exc, err)
        return 2
    except (OperationError, RuntimeError, OSError, ValueError) as exc:
        err.print(f"[bold red]pdtopo scale:[/] {exc}")
        return 2
    added, removed = changed_leaders(dep.plan, new_plan)
    if not added and not removed:
        con.print(f"{run_dir}: already {_shape(dep.plan)}; nothing to do")
        return 0
    refused = guard_scale(run_dir, before, args, con.print)
    if refused:
        err.print(f"[bold red]pdtopo scale:[/] {refused}; nothing changed")
        return 2
    con.print(f"scaling {run_dir}: {_shape(dep.plan)} -> {_shape(new_plan)}"
              + (f"; adding {', '.join(p.name for p in added)}" if added else "")
              + (f"; removing {', '.join(p.name for p in removed)}" if removed else ""))
    scaler = Scaler(dep, con.print)
    t0 = time.monotonic()
    gone: list[Process] = []
    try:
        scaler.check_kept_serve(new_plan, removed)
    except OperationError as exc:
        err.print(f"[bold red]pdtopo scale:[/] {exc}")
        return 2
    try:
        for leader in removed:
            scaler.remove(leader)
            gone.append(leader)
    except (OperationError, KeyboardInterrupt) as exc:
        con.print(f"[bold red]pdtopo scale:[/] {exc or 'interrupted'}")
        if gone:  # the run dir says what runs now: the instances removed so far are gone
            reached = dict(before)
            for leader in gone:
                reached[leader.role] -= 1
            _apply(scaler, render_files(dep, *plan_scale(dep, reached)), con)
            con.print(f"stopped at {', '.join(f'{r}={n}' for r, n in reached.items())}")
        return 1
    if not added:
        _apply(scaler, new, con)
    else:
        new.write(run_dir)
        try:
            scaler.start(new_plan, [p for p in new_plan.processes
                                    if p.name in {a.name for a in added}])
            for leader in added:
                scaler.register(leader)
        except (OperationError, KeyboardInterrupt) as exc:
            con.print(f"[bold red]pdtopo scale:[/] {exc or 'interrupted'}")
            scaler.roll_back(added, restore)
            return 1
    con.print(f"[bold green]scaled[/] to {_shape(new_plan)} in {time.monotonic() - t0:.1f} s")
    return 0
