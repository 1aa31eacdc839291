"""Who is at the other end of the side channel, and whether it is still there.

`Peer` names the other end of a message (the ROUTER's view of a D, or a DEALER's P endpoint);
`SideChannelEvent` is a received message with its peer, what the channel hands its owner.
`PeerWatch` is the part of `SideChannel` (side_channel.py) that reads the sockets' monitors on
its I/O thread and turns a peer that is gone into local `failed` events.

A P that dies (kill -9, crash) closes its TCP connections at once: each DEALER's socket monitor
reports the disconnect, and every room still expected from that endpoint gets a local
`failed(room, status=503)` event, as if P had sent it, so D fails those requests now instead of
at `disaggregation.kv_timeout_s` (counted as `peer_disconnects` / `rooms_failed_on_disconnect`).
While the endpoint stays down (the monitor reports refused reconnects), a `want` for a new room
fails the same way at once, and so does a room whose first connection attempt is refused: a
request the router still sends to a dead P gets a retryable error in milliseconds.
The same holds the other way: the ROUTER's socket monitor reports a D whose connection closed;
the ROUTER knows which connection each D identity's messages came from (the frames' source
descriptor), and every room that D owns gets a local `failed(room, status=503)` event, as if D
had sent it, so P drops that room's KV now instead of at `disaggregation.sender_expiry_s`
(counted as `decode_disconnects` / `rooms_failed_on_decode_disconnect`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdtopo.runtime.disagg.transport import messages as m

log = logging.getLogger(__name__)

PEER_GONE_STATUS = 503  # a retryable status: the router may send the request elsewhere
# the DEALER connection events watched
MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class Peer(NamedTuple):
    """Where a message came from / goes to: ("router", identity) or ("dealer", "host:port")."""

    kind: str
    key: bytes | str


@dataclass(frozen=True)
class SideChannelEvent:
    peer: Peer
    msg: m.Message


class PeerWatch:
    """The monitors' side of `SideChannel` (its I/O thread only): reads `_monitors` (DEALER
    monitor -> P endpoint), `_router_monitor`, `_peer_fds`, `_owners`, `_expected` and `_down`,
    puts local `failed` events on `events` and counts through `_count`."""

    def _recv_monitor(self, monitor: zmq.Socket, endpoint: str) -> None:
        """Connection events of one DEALER; a disconnect fails the rooms expected from it."""
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self._down.discard(endpoint)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._down.add(endpoint)
                self._peer_gone(endpoint)
            elif kind == zmq.EVENT_CONNECT_RETRIED:  # refused: nothing listens there now
                if endpoint not in self._down:
                    self._down.add(endpoint)
                    self._fail_expected(endpoint, "refuses connections (it is down or "
                                        "restarting)")

    def _recv_router_monitor(self) -> None:
        """The ROUTER's connection events; a closed connection fails its D's rooms."""
        assert self._router_monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._router_monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fd = event["value"]
                for identity in [i for i, f in self._peer_fds.items() if f == fd]:
                    del self._peer_fds[identity]
                    self._decode_gone(identity)

    def _decode_gone(self, identity: bytes) -> None:
        rooms = sorted(r for r, o in self._owners.items() if o == identity)
        self._count("decode_disconnects")
        if rooms:
            log.warning("%s: decode peer %r disconnected; failing its rooms %s", self.name,
                        identity, rooms)
        for room in rooms:
            self._count("rooms_failed_on_decode_disconnect")
            self.events.put(SideChannelEvent(Peer("router", identity), m.Failed(
                room=room, status=PEER_GONE_STATUS,
                reason="the decode server that asked for this KV disconnected (it died or "
                       "restarted); nobody will pull it")))

    def _peer_gone(self, endpoint: str) -> None:
        self._count("peer_disconnects")
        self._fail_expected(endpoint, "disconnected (it died or restarted)")

    def _fail_expected(self, endpoint: str, what: str, rooms: list[int] | None = None) -> None:
        """Local `failed` events for the rooms expected from `endpoint` (or just `rooms`)."""
        if rooms is None:
            rooms = sorted(r for r, e in self._expected.items() if e == endpoint)
        if rooms:
            log.warning("%s: prefill side channel %s %s; failing rooms %s", self.name,
                        endpoint, what, rooms)
        for room in rooms:
            self._count("rooms_failed_on_disconnect")
            self.events.put(SideChannelEvent(Peer("dealer", endpoint), m.Failed(
                room=room, status=PEER_GONE_STATUS,
                reason=f"the prefill server at {endpoint} {what}; its KV for this request "
                       "will not come")))
