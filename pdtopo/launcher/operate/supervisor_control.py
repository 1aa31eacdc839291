"""supervisord of a run directory: start it, talk XML-RPC over its unix socket, tear it down.

`Supervisor(run_dir)` reads the serverurl from RUN/supervisord.conf and talks through
`supervisor.xmlrpc.SupervisorTransport`. `teardown(run_dir)` shuts supervisord down over
XML-RPC, then checks by PID (programs, their descendants, supervisord itself) that nothing of
the run is left, killing leftovers. PIDs are checked through /proc (zombies count as gone).
"""

from __future__ import annotations

import configparser
import os
import signal
import subprocess
import sys
import time
import xmlrpc.client
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import SupervisorTransport

from pdtopo.config.run_files import CONF_FILE


class SupervisorError(RuntimeError):
    pass


# what a `Supervisor.call` may raise: supervisord's own faults (xmlrpc Fault: NOT_RUNNING,
# BAD_NAME, ...), a dead socket, our errors
CALL_ERRORS = (SupervisorError, OSError, xmlrpc.client.Error)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def descendants(pid: int) -> list[int]:
    """All descendant PIDs of `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Supervisor:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir).resolve()
        parser = configparser.RawConfigParser()
        parser.read(self.run_dir / CONF_FILE)
        self.serverurl = parser.get("supervisorctl", "serverurl").replace("%%", "%")
        self.pidfile = Path(parser.get("supervisord", "pidfile").replace("%%", "%"))

    def _proxy(self) -> Any:
        transport = SupervisorTransport(None, None, serverurl=self.serverurl)
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)

    def call(self, method: str, *args: Any) -> Any:
        ns, name = method.split(".")
        return getattr(getattr(self._proxy(), ns), name)(*args)

    def is_up(self) -> bool:
        try:
            return self.call("supervisor.getState")["statename"] == "RUNNING"
        except (OSError, xmlrpc.client.Error):
            return False

    def processes(self) -> list[dict[str, Any]]:
        return self.call("supervisor.getAllProcessInfo")

    def states(self) -> dict[str, tuple[str, int]]:
        try:
            return {p["name"]: (p["statename"], p["pid"]) for p in self.processes()}
        except (OSError, xmlrpc.client.Error):
            return {}

    def supervisord_pid(self) -> int:
        """PID of this run's supervisord, 0 when none runs (a stale pidfile is ignored)."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            return 0
        ours = "supervisord" in cmdline and str(self.run_dir / CONF_FILE) in cmdline
        return pid if ours and pid_alive(pid) else 0

    def tail(self, name: str, offset: int, length: int) -> tuple[str, int, bool]:
        return tuple(self.call("supervisor.tailProcessStdoutLog", name, offset, length))

    def start(self, timeout_s: float = 30.0) -> None:
        """Start supervisord on the run dir's conf (it daemonizes) and wait for its socket."""
        conf = self.run_dir / CONF_FILE
        proc = subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
                              capture_output=True, text=True, cwd=self.run_dir)
        if proc.returncode != 0:
            raise SupervisorError(f"supervisord failed to start (exit {proc.returncode}): "
                                  f"{(proc.stderr or proc.stdout).strip()}")
        deadline = time.monotonic() + timeout_s
        while not self.is_up():
            if time.monotonic() > deadline:
                raise SupervisorError(f"supervisord did not answer on {self.serverurl} "
                                      f"within {timeout_s:g} s (see {self.run_dir}/supervisord.log)")
            time.sleep(0.1)


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def teardown(run_dir: Path, timeout_s: float = 40.0) -> list[int]:
    """Stop everything of the run. Returns the PIDs that had to be killed by force."""
    sv = Supervisor(run_dir)
    sup_pid = sv.supervisord_pid()
    prog_pids: list[int] = []
    if sv.is_up():
        for info in sv.processes():
            if info.get("pid"):
                prog_pids.append(info["pid"])
                prog_pids.extend(descendants(info["pid"]))
        try:
            sv.call("supervisor.shutdown")
        except (OSError, xmlrpc.client.Error):
            pass
    elif sup_pid and pid_alive(sup_pid):
        prog_pids.extend(descendants(sup_pid))
        os.kill(sup_pid, signal.SIGTERM)
    watched = [p for p in [sup_pid, *prog_pids] if p]
    leftovers = _wait_gone(watched, timeout_s)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    still = _wait_gone(leftovers, 5.0)
    if still:
        raise SupervisorError(f"processes of {run_dir} survived SIGKILL: {still}")
    return leftovers


LOG_TAIL_LINES = 40


def log_tail(run_dir: Path, program: str, lines: int = LOG_TAIL_LINES) -> str:
    path = run_dir / "logs" / f"{program}.log"
    try:
        data = path.read_bytes()[-65536:].decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(data.splitlines()[-lines:])
