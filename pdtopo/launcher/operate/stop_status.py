"""status / stop / logs on an existing run directory (through supervisord's XML-RPC)."""

from __future__ import annotations

import json
import sys
import time
import xmlrpc.client
from pathlib import Path
from xml.parsers.expat import ExpatError

from pdtopo.launcher.operate import display, planner_files
from pdtopo.launcher.operate.health import probe
from pdtopo.launcher.operate.supervisor_control import Supervisor, SupervisorError, teardown
from pdtopo.launcher.plan.expand import Plan

TAIL_BYTES = 16384


def _plan(run_dir: Path) -> Plan | None:
    try:
        return Plan.from_dict(json.loads((run_dir / "plan.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def status(run_dir: Path) -> int:
    con = display.console()
    sv = Supervisor(run_dir)
    if not sv.is_up():
        con.print(f"{run_dir}: not running (supervisord does not answer on {sv.serverurl})")
        return 3
    plan = _plan(run_dir)
    infos = sv.processes()
    by_name = plan.by_name() if plan else {}
    healthy = {i["name"]: probe(by_name[i["name"]].health_url, timeout=1.0)
               for i in infos if i["name"] in by_name and i["statename"] == "RUNNING"}
    con.print(display.status_table(plan, infos, healthy, title=str(run_dir)))
    planner = planner_files.summary(planner_files.read_status(run_dir),
                                    planner_files.paused(run_dir))
    if planner:
        con.print(planner, markup=False)
    return 0 if all(i["statename"] == "RUNNING" for i in infos) else 1


def stop(run_dir: Path) -> int:
    con = display.console()
    sv = Supervisor(run_dir)
    if not sv.is_up() and not sv.supervisord_pid():
        con.print(f"{run_dir}: nothing running")
        return 0
    try:
        killed = teardown(run_dir)
    except SupervisorError as exc:
        con.print(f"[bold red]error:[/] {exc}")
        return 1
    con.print(f"stopped {run_dir}" + (f" (killed leftovers {killed})" if killed else ""))
    return 0


def _read_file(path: Path, offset: int, length: int) -> tuple[str, int]:
    with path.open("rb") as fh:
        size = fh.seek(0, 2)
        start = max(offset, size - length) if offset else max(0, size - length)
        fh.seek(start)
        data = fh.read()
    return data.decode(errors="replace"), start + len(data)


def logs(run_dir: Path, program: str, follow: bool = False) -> int:
    """Print (and with follow, keep printing) a program's log. Reads through supervisord's
    tailProcessStdoutLog; falls back to the log file when supervisord is down or cannot encode
    the bytes as XML (e.g. ANSI colour codes in the router's log)."""
    sv = Supervisor(run_dir)
    path = run_dir / "logs" / f"{program}.log"
    use_file = not sv.is_up()
    if use_file and not path.is_file():
        print(f"no log for program {program!r} in {run_dir}/logs", file=sys.stderr)
        return 2
    offset = 0
    try:
        while True:
            if not use_file:
                try:
                    text, offset, _ = sv.tail(program, offset, TAIL_BYTES)
                except xmlrpc.client.Fault as fault:
                    print(f"program {program!r}: {fault.faultString}", file=sys.stderr)
                    return 2
                except (OSError, xmlrpc.client.Error, ExpatError):
                    use_file = path.is_file()
                    if not use_file:
                        return 0
                    continue
            else:
                text, offset = _read_file(path, offset, TAIL_BYTES if not offset else 1 << 30)
            sys.stdout.write(text)
            sys.stdout.flush()
            if not follow:
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
