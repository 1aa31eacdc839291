"""What a room's sender (P) and receiver (D) share: `RoomEndpoint`, the room's KVPoll state
driven by its manager, and `check_endpoint`, the check of a `host:port` a request names.

The manager (manager.py) creates the endpoints and calls them back from its `progress()`;
`poll()` drives the manager first, `last_state` reads the state without side-channel work.
"""

from __future__ import annotations

from typing import Any

from pdtopo.runtime.disagg.transport.base import KVTransferError
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll, KVPollState
from pdtopo.runtime.engine.request import bootstrap_host_problem


def check_endpoint(addr: str, what: str) -> str:
    host, _, port = str(addr).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port, got {addr!r}")
    why = bootstrap_host_problem(host)  # checked before any socket is opened for it
    if why is not None:
        raise ValueError(f"{what}: the host {why}, got {addr!r}")
    return f"{host}:{int(port)}"


class RoomEndpoint:
    """What a sender and a receiver share: the room's KVPoll state, driven by the manager.
    `abort` gives up on the room and tells the peer (which then frees what it holds)."""

    mgr: Any  # the JaxTransferKVManager that made it (manager.py) and drives it
    room: int
    _state: KVPollState

    def poll(self) -> KVPoll:
        self.mgr.progress()
        return self._state.state

    @property
    def last_state(self) -> KVPoll:
        """The state as of the manager's last `progress()` (no side-channel work: for loops
        over many rooms right after one `mgr.progress()`)."""
        return self._state.state

    def failure_exception(self) -> BaseException | None:
        return self._state.error

    def abort(self, reason: str, status: int | None = 500) -> None:
        self._fail(KVTransferError(f"room {self.room}: {reason}", status=status), notify=True)

    def _fail(self, exc: KVTransferError, *, notify: bool) -> None:
        raise NotImplementedError
