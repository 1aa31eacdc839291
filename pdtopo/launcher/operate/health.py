"""Health probing: one HTTP GET per program's health URL, and the start-order waiter.

`wait_for_programs` walks the plan in start order; each program gets `timeout_s` from the
moment the programs before it are healthy. It polls supervisord's process states and the
health URLs, calling `on_update(rows)` after every poll so the caller can draw progress. A
program that is FATAL (supervisord gave up restarting a program that exits before
`launcher.startsecs`), or that has exited `CRASH_LOOP_EXITS` times after running past
startsecs (supervisord restarts those forever: a start-up error there is a crash loop, not a
slow start; seen as EXITED or as a new pid), fails the wait at once. The proxy counts as
healthy only once the router has registered every P and D worker (`router_workers_ready`). A
server that is not healthy yet is asked what it is doing (`loading_detail`: its /health 503
names the load step, e.g. "loading weights 40/272 tensors", "compiled step shape 3/10"), shown
in the row's progress. A P or D leader that turns healthy is handed to `announce` (the launcher
adds it to the router's registry at once, `WorkerAnnouncer`) until that succeeds: the router
itself retries its command-line workers with a back-off that grows by a second per attempt,
so it would otherwise notice a server that took 30 s to load only seconds later. A server that
turns healthy is asked once which attention path it serves with (`attention_of`: its
/pdtopo/state `attention`, e.g. "gather (pallas refused: ...)" when warmup fell back from the
TPU kernel), shown in the row. Returns a `WaitResult`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdtopo.launcher.plan.expand import Plan

FAILED_STATES = {"FATAL"}
ANNOUNCED_ROLES = ("prefill", "decode")  # the PD router's workers (`WorkerAnnouncer`)
LOADING_ROLES = ("prefill", "decode", "colocated", "local")  # their /health 503 says progress
CRASH_LOOP_EXITS = 2  # exits of one program during the launch that end it


def probe(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def loading_detail(url: str, timeout: float = 2.0) -> str:
    """What a loading server says it is doing: the message of its /health 503 ("engine is
    loading: compiled step shape 3/10" -> "compiled step shape 3/10"), or "" when it says
    nothing (not answering yet, or not a pdtopo server)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return ""
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read() or b"{}")["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return ""
        return str(message).removeprefix("engine is loading: ")[:80]
    except (urllib.error.URLError, OSError, ValueError):
        return ""


def attention_of(health_url: str, token: str | None = None, timeout: float = 2.0) -> str:
    """The attention path a healthy server serves with (`attention` of its /pdtopo/state,
    asked with the deployment token), or "" when it does not say or does not answer."""
    base = health_url.rsplit("/", 1)[0]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        req = urllib.request.Request(f"{base}/pdtopo/state", headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return ""
    attention = body.get("attention") if isinstance(body, dict) else None
    return str(attention) if attention else ""


def router_workers_ready(base_url: str, expected: int, timeout: float = 2.0,
                         api_key: str | None = None) -> bool:
    """True once sglang-router lists `expected` healthy workers. The Rust router answers
    /health before it has registered its workers (it adds them in the background, with
    back-off), so its /health alone does not mean requests can reach every P and D. A router
    without a worker registry (MiniLB: no /workers) is ready when its /health is. A router
    with an API key lists its workers only to a caller that sends it (`api_key`); a 401 is
    never taken for "no registry"."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        req = urllib.request.Request(f"{base_url}/workers", headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code not in (401, 403)  # else: no worker registry
    except (urllib.error.URLError, OSError, ValueError):
        return False
    workers = body.get("workers", []) if isinstance(body, dict) else []
    healthy = [w for w in workers if isinstance(w, dict) and w.get("is_healthy", True)]
    return len(healthy) >= expected


def proxy_worker_count(plan: Plan) -> int:
    """Server HTTP endpoints the proxy is given (P and D, or mode dp's colocated servers):
    one per instance (the leaders)."""
    return sum(1 for p in plan.processes
               if p.role in ("prefill", "decode", "colocated")
               and getattr(p, "leader", True) is not False)


@dataclass
class Row:
    name: str
    state: str = "-"
    pid: int = 0
    healthy: bool = False
    waited_s: float = 0.0
    exits: int = 0  # times it exited after running past startsecs (EXITED, or a new pid)
    ran: bool = False  # the current pid was seen RUNNING
    progress: str = ""  # what a loading server says it is doing (`loading_detail`)
    attention: str = ""  # the attention path a healthy server serves with (`attention_of`)


@dataclass
class WaitResult:
    ok: bool
    rows: list[Row] = field(default_factory=list)
    failed: str | None = None
    reason: str = ""


def _observe(row: Row, state: str, pid: int) -> str | None:
    """Take one supervisord observation into `row`; why the program failed, or None."""
    restarted = bool(pid and row.pid and pid != row.pid)
    if (restarted or state == "EXITED") and row.ran:
        row.exits += 1
        row.ran = row.healthy = False
    row.state, row.pid = state, pid or row.pid
    row.ran = row.ran or state == "RUNNING"
    if state in FAILED_STATES:
        return f"is {state} (it exited during start-up)"
    if row.exits >= CRASH_LOOP_EXITS:
        return (f"exited {row.exits} times during start-up (a crash loop: supervisord keeps "
                "restarting it)")
    return None


def wait_for_programs(plan: Plan, get_states: Callable[[], dict[str, tuple[str, int]]],
                      timeout_s: float, on_update: Callable[[list[Row]], None] | None = None,
                      poll_s: float = 0.25, probe_fn: Callable[[str], bool] = probe,
                      clock: Callable[[], float] = time.monotonic,
                      workers_fn: Callable[[str, int], bool] | None = router_workers_ready,
                      detail_fn: Callable[[str], str] | None = loading_detail,
                      announce: Callable[[Any], bool] | None = None,
                      attention_fn: Callable[[str], str] | None = None,
                      ) -> WaitResult:
    order = plan.start_order()
    rows = {p.name: Row(p.name) for p in order}
    unannounced = {p.name for p in order if p.role in ANNOUNCED_ROLES
                   and getattr(p, "leader", True) is not False} if announce else set()
    current, started = 0, clock()
    while True:
        states = get_states()
        now = clock()
        for proc in order:
            row = rows[proc.name]
            failure = _observe(row, *states.get(proc.name, ("UNKNOWN", 0)))
            if failure:
                if on_update:
                    on_update(list(rows.values()))
                return WaitResult(False, list(rows.values()), proc.name,
                                  f"{proc.name} {failure}")
            if not row.healthy and row.state == "RUNNING":
                row.healthy = probe_fn(proc.health_url)
                if not row.healthy and detail_fn is not None and proc.role in LOADING_ROLES:
                    row.progress = detail_fn(proc.health_url) or row.progress
                if row.healthy:
                    row.progress = ""
                    if attention_fn is not None and proc.role in LOADING_ROLES:
                        row.attention = attention_fn(proc.health_url)
                if row.healthy and proc.role == "proxy" and workers_fn is not None:
                    base = proc.health_url.rsplit("/", 1)[0]
                    row.healthy = workers_fn(base, proxy_worker_count(plan))
            if row.healthy and proc.name in unannounced and announce(proc):
                unannounced.discard(proc.name)
        while current < len(order) and rows[order[current].name].healthy:
            current, started = current + 1, now
        if current < len(order):
            rows[order[current].name].waited_s = now - started
        if on_update:
            on_update(list(rows.values()))
        if current == len(order):
            return WaitResult(True, list(rows.values()))
        if now - started > timeout_s:
            name = order[current].name
            return WaitResult(False, list(rows.values()), name,
                              f"{name} not healthy at {order[current].health_url} after "
                              f"{timeout_s:g} s")
        time.sleep(poll_s)


@dataclass
class WorkerAnnouncer:
    """Adds a healthy P or D leader to the PD router's worker registry (`POST /workers`) as
    soon as the launcher sees it healthy. The router was given every worker on its command
    line and registers them itself, later: whichever comes second is refused by the router
    as a duplicate ("already exists"), which changes nothing. Returns True once the router
    lists the worker or took the addition; False (try again at the next poll) while the
    router does not answer."""

    admin: Any  # router_admin.RouterAdmin of the deployment's proxy

    def __call__(self, proc: Any) -> bool:
        from pdtopo.launcher.operate.admin_http import OperationError  # deferred: HTTP client

        try:
            if self.admin.entry(proc.url) is None:
                self.admin.add(proc)
        except OperationError:
            return False
        return True
