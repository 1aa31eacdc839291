"""`pdtopo drain` and `pdtopo restart` on a running PD deployment, one instance at a time.

    pdtopo drain PROGRAM|ROLE [RUN_DIR] [--undo] [--force]
    pdtopo restart PROGRAM|ROLE [RUN_DIR] [--force]

A target is a server program of the plan (`prefill_1`; a follower names its whole instance) or a
role (`prefill`, `decode`: every instance of it, in order). For each instance:

1. drain: `POST /pdtopo/drain` on its leader (the deployment token from RUN/token) turns its
   `/health` to 503; the router's health checks take it out of the choice (watched in the
   router's `/workers` list where it reports health, else the time its health checks need:
   interval x failures + timeout);
2. wait until its in-flight requests are done (`/pdtopo/state` `in_flight`), at most
   `launcher.drain_timeout_s`; a D of a deployment with `disaggregation.migration=true` waits
   `launcher.migrate_after_s`, then moves what still runs to the other serving D instances
   (`POST /pdtopo/migrate_out`: KV and client connection, runtime/api/migration_routes.py);
   what cannot move completes where it is;
3. restart only: stop and start the instance's programs through supervisord, wait for the
   leader's `/health` (at most `launcher.health_timeout_s`), then for the router to choose it
   again (its `/workers` entry healthy, or two health-check intervals).

`drain` leaves the instance out of the router (`--undo` puts it back without a restart). An
instance is drained only while another instance of its role is serving, unless `--force` (then
that role has no server until it is back). Mode pd, one host, rust or gateway proxy only.
Every step prints what it waits for and how long it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from pdtopo.launcher.operate import display
from pdtopo.launcher.operate.admin_http import OperationError, admin_request, wait_until
from pdtopo.launcher.operate.deployment import Deployment
from pdtopo.launcher.operate.health import probe
from pdtopo.launcher.operate.supervisor_control import CALL_ERRORS, Supervisor
from pdtopo.launcher.plan.expand import Process

__all__ = ["OperationError", "Operator", "run"]


class Operator:
    """Drains and restarts instances of one deployment, printing every step."""

    def __init__(self, dep: Deployment, say: Callable[[str], None]) -> None:
        self.dep = dep
        self.say = say
        self.sv = Supervisor(dep.run_dir)
        p = dep.proxy
        self.exclusion_s = (p.health_check_interval_s * p.health_failure_threshold
                            + p.health_check_timeout_s + 1.0)
        self.readmission_s = 2 * p.health_check_interval_s + p.health_check_timeout_s + 1.0

    def check_others_serve(self, leader: Process, force: bool) -> None:
        others = [p for p in self.dep.leaders(leader.role) if p.instance_id != leader.instance_id]
        serving = [p for p in others if self._serving(p)]
        if serving or force:
            return
        raise OperationError(
            f"{leader.name}: no other {leader.role} instance is serving "
            f"({', '.join(p.name for p in others) or 'it is the only one'}); draining it would "
            f"leave the router no {leader.role} server. Add --force to accept that")

    def _serving(self, proc: Process) -> bool:
        try:
            state = admin_request(f"{proc.url}/pdtopo/state", token=self.dep.token,
                                  timeout=2.0)
        except OperationError:
            return False
        return probe(proc.health_url, timeout=2.0) and not state.get("draining", False)

    def set_draining(self, leader: Process, value: bool) -> dict:
        return admin_request(f"{leader.url}/pdtopo/drain", body={"drain": value},
                        token=self.dep.token)

    def drain(self, leader: Process) -> int:
        """Take the instance out of the router and wait for its requests; returns how many
        were still in flight when `launcher.drain_timeout_s` ran out (0: drained)."""
        answer = self.set_draining(leader, True)
        http = int(answer.get("http_in_flight", 0))
        engine = int(answer.get("in_flight", 0)) - http
        self.say(f"{leader.name}: draining ({http} HTTP requests open, {engine} requests in the "
                 "engine)")
        url = leader.url
        self._await_router(leader, healthy=False, bound_s=self.exclusion_s, slack_s=5.0,
                           failure="the router still lists it healthy {took:.0f} s after "
                                   "/health turned 503")
        last = {"in_flight": None}

        def idle() -> bool:
            try:
                last["in_flight"] = admin_request(f"{url}/pdtopo/state", token=self.dep.token,
                                                  timeout=2.0)["in_flight"]
            except (OperationError, KeyError):
                return False
            return last["in_flight"] == 0

        limit = self.dep.launcher.drain_timeout_s
        done, took = False, 0.0
        grace = self.migration_grace(leader)
        if grace is not None:
            done, took = wait_until(idle, min(grace, limit))
            if not done:
                self.migrate_away(leader)
        if not done:
            done, more = wait_until(idle, max(limit - took, 0.0))
            took += more
        if done:
            self.say(f"{leader.name}: drained: nothing in flight after {took:.1f} s")
            return 0
        left = int(last["in_flight"] or 0)
        self.say(f"{leader.name}: {left} requests still in flight after "
                 f"launcher.drain_timeout_s={self.dep.launcher.drain_timeout_s:g} s")
        return left

    def migration_grace(self, leader: Process) -> float | None:
        """How long the drained instance's requests may end by themselves before the rest
        move to the other D instances (None: they do not move)."""
        after = self.dep.launcher.migrate_after_s
        if leader.role != "decode" or not self.dep.migration or after is None:
            return None
        if len(self.dep.instance(leader)) > 1:
            self.say(f"{leader.name}: a multi-process instance: its requests do not move "
                     "(migration is single-process this release); waiting for them")
            return None
        return float(after)

    def migrate_away(self, leader: Process) -> None:
        """`POST /pdtopo/migrate_out` with every other serving D as a target; what stays
        (no room anywhere, a refusal) completes on the instance as before."""
        others = [p for p in self.dep.leaders("decode")
                  if p.instance_id != leader.instance_id and self._serving(p)]
        if not others:
            self.say(f"{leader.name}: no other decode instance serves: its requests stay")
            return
        try:
            answer = admin_request(f"{leader.url}/pdtopo/migrate_out", token=self.dep.token,
                                   body={"targets": [{"url": p.url} for p in others]},
                                   timeout=120.0)
        except OperationError as exc:
            self.say(f"{leader.name}: moving its requests failed ({exc}); waiting for them")
            return
        kept = [r for r in answer.get("requests", []) if not r.get("moved")]
        self.say(f"{leader.name}: moved {answer.get('moved', 0)} running requests to "
                 f"{', '.join(p.name for p in others)} in {answer.get('seconds', 0):.1f} s"
                 + (f"; {len(kept)} stay ({kept[0].get('reasons')})" if kept else ""))

    def restart(self, leader: Process) -> None:
        procs = self.dep.instance(leader)
        names = [p.name for p in procs]
        t0 = time.monotonic()
        try:
            for name in reversed(names):  # followers first, the leader last
                self.sv.call("supervisor.stopProcess", name, True)
            for name in names:
                self.sv.call("supervisor.startProcess", name, False)
        except CALL_ERRORS as exc:
            raise OperationError(f"{leader.name}: supervisord could not restart "
                                 f"{', '.join(names)}: {exc}") from None
        self.say(f"{leader.name}: restarted {', '.join(names)}; waiting for /health "
                 f"(at most launcher.health_timeout_s={self.dep.launcher.health_timeout_s:g} s)")
        healthy, took = wait_until(lambda: probe(leader.health_url, timeout=2.0),
                                   self.dep.launcher.health_timeout_s)
        if not healthy:
            raise OperationError(f"{leader.name}: not healthy {took:.0f} s after its restart; "
                                 f"see `pdtopo logs {leader.name}`")
        self.say(f"{leader.name}: healthy {time.monotonic() - t0:.1f} s after the stop")
        self.readmit(leader)

    def readmit(self, leader: Process) -> None:
        self._await_router(leader, healthy=True, bound_s=self.readmission_s, slack_s=10.0,
                           failure="healthy, but the router has not chosen it again after "
                                   "{took:.0f} s")

    def _await_router(self, leader: Process, *, healthy: bool, bound_s: float,
                      slack_s: float, failure: str) -> None:
        """Wait until the router lists the leader (un)healthy, or, for a router that does not
        list its workers' health, for the time its health checks need (`bound_s`)."""
        where = "back in" if healthy else "out of"
        if self.dep.router.health(leader.url) is None:
            time.sleep(bound_s)
            self.say(f"{leader.name}: {where} the router (waited its health checks' "
                     f"{bound_s:.0f} s)")
            return
        done, took = wait_until(lambda: self.dep.router.health(leader.url) is healthy,
                                bound_s + slack_s)
        if not done:
            raise OperationError(f"{leader.name}: " + failure.format(took=took))
        self.say(f"{leader.name}: {where} the router after {took:.1f} s")


def run(verb: str, run_dir: Path, target: str, *, undo: bool = False,
        force: bool = False) -> int:
    """The CLI verbs `drain` and `restart`: 0 when every instance is done, 1 otherwise."""
    con = display.console()
    say = con.print
    try:
        dep = Deployment.load(run_dir, verb)
        leaders = dep.targets(target)
        op = Operator(dep, say)
        t0 = time.monotonic()
        left = 0
        for leader in leaders:
            if verb == "drain" and undo:
                op.set_draining(leader, False)
                say(f"{leader.name}: draining undone")
                op.readmit(leader)
                continue
            op.check_others_serve(leader, force)
            left += op.drain(leader)
            if verb == "restart":
                op.restart(leader)
    except OperationError as exc:
        con.print(f"[bold red]pdtopo {verb}:[/] {exc}")
        return 1
    what = "drained" if verb == "drain" and not undo else (
        "back in service" if undo else "restarted")
    say(f"{', '.join(p.name for p in leaders)} {what} in {time.monotonic() - t0:.1f} s"
        + (f" ({left} requests were still in flight)" if left else ""))
    return 1 if left and verb == "drain" else 0
