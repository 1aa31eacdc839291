"""D's directory of prefill peers: `(bootstrap_host, bootstrap_port)` -> checked registration.

The router injects the P instance's side-channel address into each request. Before D pulls KV
from a P it has not seen, it looks that address up in the bootstrap server's registry (on a
background thread: the scheduler loop never waits on HTTP) and compares P's registration with
its own (page size, KV dtype, model identity, KV layout). `status(addr)` answers without
blocking: `("pending", None)`, `("ok", entry)` or `("error", message)`. Results are cached for
`ttl_s`; errors for a shorter time so that a restarted, fixed peer is picked up again.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import Any

from pdtopo.runtime.disagg.mixin_base import compatibility_problems

Lookup = Callable[[str, int], dict[str, Any]]


class PeerDirectory:
    def __init__(self, lookup: Lookup | None, mine: dict[str, Any], *, ttl_s: float = 30.0,
                 error_ttl_s: float = 2.0,
                 on_lookup: Callable[[float], None] | None = None):
        self._lookup = lookup
        self._on_lookup = on_lookup  # seconds one bootstrap lookup took (lookup thread)
        self._mine = mine
        self.ttl_s = ttl_s
        self.error_ttl_s = error_ttl_s
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="peer-lookup")
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, Any, float]] = {}   # addr -> (status, value, expiry)
        self._pending: dict[str, cf.Future] = {}

    def status(self, addr: str) -> tuple[str, Any]:
        if self._lookup is None:
            return "ok", None  # no bootstrap server in this process's plan: trust the proxy
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(addr)
            if cached is not None and cached[2] > now:
                return cached[0], cached[1]
            fut = self._pending.get(addr)
            if fut is None:
                self._pending[addr] = self._pool.submit(self._resolve, addr)
                return "pending", None
            if not fut.done():
                return "pending", None
            del self._pending[addr]
        status, value = fut.result()
        ttl = self.ttl_s if status == "ok" else self.error_ttl_s
        with self._lock:
            self._cache[addr] = (status, value, time.monotonic() + ttl)
        return status, value

    def _resolve(self, addr: str) -> tuple[str, Any]:
        host, _, port = addr.rpartition(":")
        t0 = time.monotonic()
        try:
            entry = self._lookup(host, int(port))
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
