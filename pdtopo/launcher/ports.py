"""Launch-time port check: is any port of the plan already bound on this host?

Tries to bind each (address, port) of the plan the way a server would (SO_REUSEADDR, so a
port in TIME_WAIT after a previous deployment is not a false alarm). Addresses that are not
local to this host are skipped (another host's program binds them).
"""

from __future__ import annotations

import errno
import socket
import time

from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan import Plan


def port_in_use(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            if exc.errno == errno.EADDRNOTAVAIL:
                return False  # not an address of this host
            raise
    return False


def check_ports_free(plan: Plan) -> None:
    """Raise TopologyError naming the first port of the plan that is already in use."""
    for proc in plan.processes:
        for kind, port in proc.ports.items():
            if port_in_use(proc.address, port):
                key = proc.port_keys.get(kind, f"{proc.name}.ports.{kind}")
                raise TopologyError(key, port, f"port {port} for program {proc.name} ({kind}) "
                                               f"is already in use on {proc.address}")


def wait_ports_free(plan: Plan, timeout_s: float = 0.0, poll_s: float = 0.5) -> None:
    """`check_ports_free`, retried for up to `timeout_s` (a previous deployment on the same
    ports may still be shutting down)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_ports_free(plan)
            return
        except TopologyError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)
