"""KVPoll: the state of one request's KV transfer, and a holder that keeps it monotonic.

States (values as in sglang): Failed=0, Bootstrapping=1, WaitingForInput=2, Transferring=3,
Success=4. A transfer only moves forward: Bootstrapping -> WaitingForInput -> Transferring ->
Success, or to Failed from any non-terminal state. Success and Failed are terminal. Staying in
the same state is a no-op; any other move raises `InvalidKVTransition`.

`KVPollState` is owned by one sender/receiver; its lock makes reads from other threads safe.
"""

from __future__ import annotations

import enum
import threading


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class InvalidKVTransition(ValueError):
    """A KVPoll transition that would move backwards or leave a terminal state."""


class KVPollState:
    """A monotonic KVPoll holder with the failure that ended it (if any)."""

    def __init__(self, initial: KVPoll = KVPoll.Bootstrapping, *, label: str = "") -> None:
        self._state = KVPoll(initial)
        self._error: BaseException | None = None
        self._label = label
        self._lock = threading.Lock()

    @property
    def state(self) -> KVPoll:
        with self._lock:
            return self._state

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def advance(self, new: KVPoll) -> KVPoll:
        """Move to `new` (forward only). Use `fail()` to move to Failed."""
        new = KVPoll(new)
        with self._lock:
            cur = self._state
            if new == cur:
                return cur
            if cur.terminal:
                raise InvalidKVTransition(
                    f"{self._label or 'KV transfer'}: state {cur.name} is terminal, "
                    f"cannot move to {new.name}")
            if new == KVPoll.Failed:
                raise InvalidKVTransition(
                    f"{self._label or 'KV transfer'}: use fail(exc) to move to Failed")
            if new < cur:
                raise InvalidKVTransition(
                    f"{self._label or 'KV transfer'}: cannot move backwards from "
                    f"{cur.name} to {new.name}")
            self._state = new
            return new

    def fail(self, exc: BaseException) -> bool:
        """Move to Failed with `exc`. Returns False (and changes nothing) if already terminal."""
        with self._lock:
            if self._state.terminal:
                return False
            self._state = KVPoll.Failed
            self._error = exc
            return True
