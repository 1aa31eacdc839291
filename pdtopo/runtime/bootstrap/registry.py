"""The bootstrap server's registry of P/D instances: pure state with TTL expiry.

Each registration is keyed by the full rank tuple `(role, instance_id, tp_rank, cp_rank,
dp_rank, pp_rank)`. Heartbeats refresh `last_seen`; entries older than the TTL are dropped
lazily on every read and by `expire()`. One `InstanceRegistry` is owned by the bootstrap app;
its lock makes it safe to call from FastAPI's worker threads. The clock is injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdtopo.config.settings import check_value

RANK_FIELDS = ("tp_rank", "cp_rank", "dp_rank", "pp_rank")

RankKey = tuple[str, str, int, int, int, int]


def rank_key(role: str, instance_id: str, ranks: dict[str, int]) -> RankKey:
    return (role, instance_id, *(int(ranks.get(f, 0)) for f in RANK_FIELDS))


@dataclass
class Entry:
    info: dict[str, Any]
    registered_at: float
    last_seen: float


class InstanceRegistry:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = check_value("bootstrap.heartbeat_ttl_s", ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[RankKey, Entry] = {}

    def register(self, info: dict[str, Any]) -> tuple[RankKey, bool]:
        """Insert or replace an instance rank; returns (key, replaced_existing)."""
        key = rank_key(info["role"], info["instance_id"], info)
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            replaced = key in self._entries
            self._entries[key] = Entry(info=dict(info), registered_at=now, last_seen=now)
        return key, replaced

    def heartbeat(self, role: str, instance_id: str, ranks: dict[str, int]) -> bool:
        """Refresh an entry; False when it is unknown (expired or never registered)."""
        key = rank_key(role, instance_id, ranks)
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.last_seen = now
            return True

    def deregister(self, role: str, instance_id: str, ranks: dict[str, int]) -> bool:
        with self._lock:
            return self._entries.pop(rank_key(role, instance_id, ranks), None) is not None

    def list(self, role: str | None = None) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            return [
                self._public(e, now)
                for k, e in sorted(self._entries.items())
                if role is None or k[0] == role
            ]

    def get(self, role: str, instance_id: str, ranks: dict[str, int]) -> dict[str, Any] | None:
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            entry = self._entries.get(rank_key(role, instance_id, ranks))
            return None if entry is None else self._public(entry, now)

    def expire(self) -> int:
        with self._lock:
            return self._expire_locked(self._clock())

    def __len__(self) -> int:
        return len(self.list())

    def _expire_locked(self, now: float) -> int:
        dead = [k for k, e in self._entries.items() if now - e.last_seen > self.ttl_s]
        for k in dead:
            del self._entries[k]
        return len(dead)

    @staticmethod
    def _public(entry: Entry, now: float) -> dict[str, Any]:
        return {**entry.info, "age_s": round(now - entry.last_seen, 3)}
