"""`ExpiringCache`: a bounded map whose entries expire, for lookups D caches (host names in
resolve.py, prefill peers in peers.py).

    put(key, status, value, ttl_s) -> stored until now + ttl_s; past `max_entries` the expired
                                      entries are dropped first, then those expiring soonest
    get(key)                       -> (status, value), or None when absent or expired

Not thread-safe on its own: its owner holds its lock around every call.
"""

from __future__ import annotations

import time
from typing import Any


class ExpiringCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = int(max_entries)
        self._entries: dict[str, tuple[str, Any, float]] = {}  # key -> (status, value, expiry)

    def get(self, key: str) -> tuple[str, Any] | None:
        hit = self._entries.get(key)
        if hit is None or hit[2] <= time.monotonic():
            return None
        return hit[0], hit[1]

    def put(self, key: str, status: str, value: Any, ttl_s: float) -> None:
        now = time.monotonic()
        self._entries[key] = (status, value, now + ttl_s)
        if len(self._entries) > self.max_entries:
            for k in [k for k, v in self._entries.items() if v[2] <= now]:
                del self._entries[k]
        while len(self._entries) > self.max_entries:
            del self._entries[min(self._entries, key=lambda k: self._entries[k][2])]

    def __len__(self) -> int:
        return len(self._entries)
