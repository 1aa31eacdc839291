"""The router watch: a supervisord event listener that takes a dead P/D instance out of the
router the moment its leader exits, and puts it back once the replacement is healthy.

    [eventlistener:router_watch]  (RUN/supervisord.conf, launcher.router_watch)
    command = python -m pdtopo.launcher.programs.router_watch RUN_DIR

Why: the router's own health checks need `interval x failures` (about 4 s by default) to stop
choosing a dead worker; until then its retries keep landing on it, and under load some
requests use up every retry there (measured: 10 of 842 requests failed after a kill -9 of one P
with 200 in flight). supervisord learns of an exit at once (SIGCHLD), so the watch deletes the
worker from the router's `/workers` registry within milliseconds and retries only meet live
workers.

Data flow: supervisord writes PROCESS_STATE_* events to this program's stdin
(`supervisor.childutils.listener`); an unexpected EXITED, BACKOFF or FATAL of a prefill/decode
leader in RUN/plan.json (read on every event: `pdtopo scale` rewrites it) queues a removal; the
one worker thread applies removals at once and then, for each removed instance, polls its
leader's `/health` and adds it back (`POST /workers`) once it answers 200 (a restarted server
is healthy only after it has loaded and registered with the bootstrap server). Stops, restarts
and drains by pdtopo or an operator are STOPPED events and are left alone (drain/restart handle
the router themselves). Everything the watch does is logged to RUN/logs/router_watch.log.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor import childutils

from pdtopo.launcher.operate.admin_http import OperationError
from pdtopo.launcher.operate.deployment import SERVER_ROLES, Deployment
from pdtopo.launcher.operate.health import probe
from pdtopo.launcher.operate.router_admin import RouterAdmin
from pdtopo.launcher.plan.expand import Plan, Process

DEAD_STATES = ("PROCESS_STATE_EXITED", "PROCESS_STATE_BACKOFF", "PROCESS_STATE_FATAL")
READMIT_POLL_S = 0.5
log = logging.getLogger("pdtopo.router_watch")


def dead_program(event: str, payload: dict[str, str]) -> str | None:
    """The program an event reports dead (an exit supervisord did not expect, a failed start),
    None for every other event."""
    if event not in DEAD_STATES:
        return None
    if event == "PROCESS_STATE_EXITED" and payload.get("expected") == "1":
        return None
    return payload.get("processname")


def parse_payload(text: str) -> dict[str, str]:
    """supervisord's `key:value key:value` event payload header."""
    return dict(item.split(":", 1) for item in text.split() if ":" in item)


def leader_of(plan: Plan, program: str) -> Process | None:
    """The P/D leader whose instance `program` belongs to (a follower's death ends its leader
    too, and the leader's exit is the event that counts), None for other programs."""
    proc = plan.by_name().get(program)
    if proc is None or proc.role not in SERVER_ROLES or proc.leader is False:
        return None
    return proc


@dataclass
class Watch:
    """The one owner of the router changes: events go in through `report`, a single worker
    thread removes and re-adds workers."""

    run_dir: Path
    router: RouterAdmin
    poll_s: float = READMIT_POLL_S

    def __post_init__(self) -> None:
        self.dead: queue.Queue[Process] = queue.Queue()
        self.waiting: dict[str, Process] = {}  # removed, waiting to be healthy again

    def plan(self) -> Plan:
        return Plan.from_dict(json.loads((self.run_dir / "plan.json").read_text()))

    def report(self, event: str, payload: dict[str, str]) -> None:
        program = dead_program(event, payload)
        if program is None:
            return
        try:
            leader = leader_of(self.plan(), program)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s %s: cannot read plan.json (%s)", program, event, exc)
            return
        if leader is not None:
            log.info("%s: %s (pid %s)", program, event.removeprefix("PROCESS_STATE_"),
                     payload.get("pid", "?"))
            self.dead.put(leader)

    def step(self) -> None:
        """Wait up to `poll_s` for removals and apply every queued one at once, then re-add
        what has become healthy; an instance no longer in the plan (scaled in) is dropped."""
        try:
            self._remove(self.dead.get(timeout=self.poll_s))
            while True:
                self._remove(self.dead.get_nowait())
        except queue.Empty:
            pass
        if not self.waiting:
            return
        current = self.plan().by_name()
        for name, leader in list(self.waiting.items()):
            if name not in current:
                del self.waiting[name]
                log.info("%s: no longer in the plan; not re-adding it", name)
            elif probe(leader.health_url, timeout=1.0):
                self._add(leader)

    def _remove(self, leader: Process) -> None:
        t0 = time.monotonic()
        try:
            self.router.remove(leader)
        except OperationError as exc:
            log.warning("%s: could not take it out of the router: %s (its health checks "
                        "will)", leader.name, exc)
        else:
            log.info("%s: out of the router (%s) in %.3f s", leader.name, leader.url,
                     time.monotonic() - t0)
        self.waiting[leader.name] = leader

    def _add(self, leader: Process) -> None:
        try:
            listed = self.router.listed(leader.url)
            if not listed:
                self.router.add(leader)
        except OperationError as exc:
            log.warning("%s: healthy, but adding it back to the router failed: %s (retrying)",
                        leader.name, exc)
            return
        del self.waiting[leader.name]
        log.info("%s: healthy again; %s the router", leader.name,
                 "already in" if listed else "added back to")

    def run_forever(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # the watch must outlive any one failure; it is logged
                log.exception("router watch step failed")
                time.sleep(self.poll_s)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdtopo.launcher.programs.router_watch RUN_DIR", file=sys.stderr)
        return 2
    # stdout is supervisord's event protocol: logs go to stderr (RUN/logs/router_watch.log)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = Path(args[0])
    watch = Watch(run_dir, Deployment.load(run_dir, "router_watch").router)
    threading.Thread(target=watch.run_forever, name="router-watch", daemon=True).start()
    log.info("watching %s for P/D exits (router %s)", run_dir, watch.router.url)
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        body, _, _data = payload.partition("\n")
        watch.report(headers.get("eventname", ""), parse_payload(body))
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
