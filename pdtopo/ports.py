"""Port probing, the one helper for the whole project: is a port bound on this host, and which
ports are free to hand to a server about to start.

`port_in_use` binds the port the way a server does (SO_REUSEADDR, so a port in TIME_WAIT after a
previous deployment is not a false alarm; an address that is not this host's is "not in use":
another host's program binds it). `free_port_block(n)` / `free_port()` pick ports below the
kernel's ephemeral range, so that no outgoing connection takes them before the server binds
them. The launcher's pre-flight, the benchmarks' deployments and the tests all use these.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"


def ephemeral_low() -> int:
    """Lowest port the kernel hands out to outgoing connections (they could steal ours)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


def free_port_block(n: int, lo: int = 10000, hi: int | None = None) -> int:
    """A base port such that base..base+n-1 are all free on 127.0.0.1 right now, below the
    kernel's ephemeral range (outgoing connections cannot take them meanwhile)."""
    hi = hi if hi is not None else ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        if not any(port_in_use(LOOPBACK, p) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found below {hi}")


def free_port() -> int:
    """One port on 127.0.0.1 that nothing listens on right now (see free_port_block)."""
    return free_port_block(1)
