"""D's directory of prefill peers: `(bootstrap_host, bootstrap_port)` -> checked registration.

The router injects the P instance's side-channel address into each request. Before D pulls KV
from a P it has not seen, it looks that address up in the bootstrap server's registry (on a
background thread: the scheduler loop never waits on HTTP) and compares P's registration with
its own (page size, KV dtype, model identity, KV layout). `status(addr)` answers without
blocking: `("pending", None)`, `("ok", entry)` or `("error", message)`. Results are cached for
`ttl_s`; errors for a shorter time so that a restarted, fixed peer is picked up again.

Bounds (the address comes from the request): a host name is resolved by the shared
`HostResolver` first (the lookup thread never calls DNS for a client's name; it is given the
IPv4 address); at most `max_entries` results are cached (expired ones are dropped first, then
the oldest) and at most `max_pending` lookups wait for the lookup thread (past that an address
stays "pending" until a slot frees: the request waits, within its kv_timeout_s).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import Any

from pdtopo.runtime.disagg.reshard.layout import layout_problems
from pdtopo.runtime.disagg.transport.expiring_cache import ExpiringCache
from pdtopo.runtime.disagg.transport.resolve import HostResolver

Lookup = Callable[[str, int], dict[str, Any]]


def compatibility_problems(mine: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    """Differences between this rank's registration and a peer's that make KV exchange unsafe."""
    problems = []
    for key in ("page_size", "kv_dtype", "model"):
        if mine.get(key) != peer.get(key):
            problems.append(f"{key}: this server has {mine.get(key)!r}, peer has {peer.get(key)!r}")
    problems += layout_problems(mine.get("kv_layout") or {}, peer.get("kv_layout") or {})
    return problems


class PeerDirectory:
    def __init__(self, lookup: Lookup | None, mine: dict[str, Any], *, ttl_s: float = 30.0,
                 error_ttl_s: float = 2.0,
                 on_lookup: Callable[[float], None] | None = None,
                 resolver: HostResolver | None = None, max_entries: int = 256,
                 max_pending: int = 64):
        self._lookup = lookup
        self._owns_resolver = resolver is None
        self._resolver = resolver or HostResolver(1, max_pending=max_pending)
        self.max_pending = max_pending
        self._on_lookup = on_lookup  # seconds one bootstrap lookup took (lookup thread)
        self._mine = mine
        self.ttl_s = ttl_s
        self.error_ttl_s = error_ttl_s
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="peer-lookup")
        self._lock = threading.Lock()
        self._cache = ExpiringCache(max_entries)  # addr -> (status, value)
        self._pending: dict[str, cf.Future] = {}

    def status(self, addr: str) -> tuple[str, Any]:
        if self._lookup is None:
            return "ok", None  # no bootstrap server in this process's plan: trust the proxy
        with self._lock:
            cached = self._cache.get(addr)
            if cached is not None:
                return cached
            fut = self._pending.get(addr)
            if fut is None:
                return self._start(addr)
            if not fut.done():
                return "pending", None
            del self._pending[addr]
        status, value = fut.result()
        with self._lock:
            self._store(addr, status, value)
        return status, value

    def _start(self, addr: str) -> tuple[str, Any]:
        """Under the lock: resolve the host (never blocking), then queue the registry lookup."""
        host, _, port = addr.rpartition(":")
        status, ip = self._resolver.lookup(host)
        if status == "error":
            message = f"cannot resolve prefill peer {addr}: {ip}"
            self._store(addr, status, message)
            return "error", message
        if status == "ok" and len(self._pending) < self.max_pending:
            self._pending[addr] = self._pool.submit(self._resolve, addr, ip, int(port))
        return "pending", None

    def _store(self, addr: str, status: str, value: Any) -> None:
        """Under the lock: cache a result (errors for error_ttl_s, the rest for ttl_s)."""
        self._cache.put(addr, status, value, self.ttl_s if status == "ok" else self.error_ttl_s)

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _resolve(self, addr: str, ip: str, port: int) -> tuple[str, Any]:
        t0 = time.monotonic()
        try:
            entry = self._lookup(ip, port)
        except Exception as exc:  # noqa: BLE001 - any lookup failure is reported to the client
            return "error", f"cannot resolve prefill peer {addr}: {exc}"
        finally:
            if self._on_lookup is not None:
                self._on_lookup(time.monotonic() - t0)
        problems = compatibility_problems(self._mine, entry)
        if problems:
            return "error", (f"prefill instance {entry.get('instance_id')!r} at {addr} is "
                             f"incompatible with this decode server: " + "; ".join(problems))
        return "ok", entry

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_resolver:
            self._resolver.close()
