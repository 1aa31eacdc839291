"""Which connection a ZMQ message came in on: the side channel's ROUTER and the lockstep
control channel match a peer's messages to its TCP connection by the frame's source descriptor,
so that a socket monitor's "disconnected (fd)" event names the peer that is gone."""

from __future__ import annotations

import zmq


def source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection a received frame came in on (None if unknown)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
