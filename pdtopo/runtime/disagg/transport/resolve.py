"""Host names -> IPv4 addresses for D, never on a shared thread.

A request names its P by `bootstrap_host`, which may be a DNS name (Kubernetes plans address
pods by name). `getaddrinfo` blocks for as long as DNS takes (seconds for a name nobody
answers), so neither the scheduler, the side channel's I/O thread, ZMQ's own I/O thread nor the
peer-lookup thread ever calls it:

    caller --lookup(host, on_done)--> cache hit: ("ok", ip) / ("error", why) at once
                                      IPv4 literal: ("ok", host) at once
                                      else ("pending", None); one job per name on a pool of
                                      `disaggregation.resolve_threads` threads
    pool thread --getaddrinfo--> cache (ok for ttl_s, errors for error_ttl_s) --> on_done()

Bounds: at most `max_pending` names being resolved (past it a lookup answers "error" at once),
at most `max_entries` cached names (expired ones are dropped first, then the oldest). Callers
hand the IP (not the name) to ZMQ, whose I/O thread would otherwise resolve it itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import ipaddress
import socket
import threading
from collections.abc import Callable
from typing import Any

from pdtopo.runtime.disagg.transport.expiring_cache import ExpiringCache

Result = tuple[str, Any]  # ("ok", ip) | ("pending", None) | ("error", message)


def is_ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


def _getaddrinfo(host: str) -> str:
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host!r} has no IPv4 address")
    return str(infos[0][4][0])


class HostResolver:
    def __init__(self, threads: int = 2, *, ttl_s: float = 30.0, error_ttl_s: float = 2.0,
                 max_entries: int = 256, max_pending: int = 64,
                 resolve: Callable[[str], str] = _getaddrinfo) -> None:
        self.ttl_s = ttl_s
        self.error_ttl_s = error_ttl_s
        self.max_pending = max_pending
        self._resolve = resolve
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="resolve")
        self._lock = threading.Lock()
        self._cache = ExpiringCache(max_entries)  # host -> ("ok", ip) | ("error", why)
        self._pending: dict[str, list[Callable[[], None]]] = {}  # host -> callbacks

    def lookup(self, host: str, on_done: Callable[[], None] | None = None) -> Result:
        """Never blocks. `on_done` (called on a pool thread) when a "pending" name is done."""
        if is_ipv4(host):
            return "ok", host
        with self._lock:
            hit = self._cache.get(host)
            if hit is not None:
                return hit
            waiting = self._pending.get(host)
            if waiting is None:
                if len(self._pending) >= self.max_pending:
                    return "error", (f"{len(self._pending)} host names are being resolved "
                                     "already; try again")
                waiting = self._pending[host] = []
                self._pool.submit(self._run, host)
            if on_done is not None:
                waiting.append(on_done)
        return "pending", None

    def _run(self, host: str) -> None:
        try:
            result: Result = "ok", self._resolve(host)
        except Exception as exc:  # noqa: BLE001 - any failure is this name's answer
            result = "error", f"cannot resolve host name {host!r}: {exc}"
        ttl = self.ttl_s if result[0] == "ok" else self.error_ttl_s
        with self._lock:
            self._cache.put(host, result[0], result[1], ttl)
            callbacks = self._pending.pop(host, [])
        for cb in callbacks:
            cb()

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
