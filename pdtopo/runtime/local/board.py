"""State shared by the threads of a local-disaggregation process (each with one owner + a lock).

`RequestBoard`: the requests alive anywhere in the process (rid -> Req) and the rids a client
has aborted. The HTTP side adds aborts; engines register requests when they accept them and
drop them when they finish them. A request in flight between engines (transfer backlog, decode
backlog) is aborted when the decode engine admits it. `DecodeLoad`: requests assigned to each
decode engine and not finished yet, the number the transfer thread balances on
(fewest active requests wins).
"""

from __future__ import annotations

import threading
from typing import Any


class RequestBoard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Any] = {}
        self._aborted: set[str] = set()

    def register(self, req: Any) -> bool:
        """Record a newly accepted request; False if another live request has its rid."""
        with self._lock:
            if req.rid in self._live:
                return False
            self._live[req.rid] = req
            return True

    def finished(self, req: Any) -> None:
        with self._lock:
            if self._live.get(req.rid) is req:
                del self._live[req.rid]
                self._aborted.discard(req.rid)

    def abort(self, rid: str, only: Any = None) -> bool:
        """Mark a live request aborted (False: unknown or already finished, or not `only`
        when given: a refused duplicate of the rid)."""
        with self._lock:
            if rid not in self._live or (only is not None and self._live[rid] is not only):
                return False
            self._aborted.add(rid)
            return True

    def is_aborted(self, rid: str) -> bool:
        with self._lock:
            return rid in self._aborted

    def num_live(self) -> int:
        with self._lock:
            return len(self._live)


class DecodeLoad:
    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        self._active = [0] * n

    def pick_and_acquire(self) -> int:
        """The engine with the fewest active requests (lowest index on ties), counted +1."""
        with self._lock:
            i = min(range(len(self._active)), key=lambda k: (self._active[k], k))
            self._active[i] += 1
            return i

    def release(self, i: int) -> None:
        with self._lock:
            if self._active[i] <= 0:
                raise RuntimeError(f"decode_{i}: released more requests than were assigned")
            self._active[i] -= 1

    def snapshot(self) -> list[int]:
        with self._lock:
            return list(self._active)
