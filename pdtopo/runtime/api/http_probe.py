"""The HTTP protocol class P/D servers run under uvicorn: uvicorn's own (`auto`), except that a
connection opening with the HTTP/2 prior-knowledge preface is closed quietly.

sglang-router (proxy.kind=rust) probes every worker it registers with an HTTP/1.1 health check
and, at the same time, a gRPC one (HTTP/2 without negotiation) to detect how it speaks. uvicorn
speaks HTTP/1.1 only, so each probe used to log "WARNING: Invalid HTTP request received." in
every P/D log at start-up; the router takes the closed connection as "not gRPC" just as it took
the 400. Any other malformed request still gets uvicorn's answer and warning.

`connection_for(client)` finds the open connection a request came in on by its peer address
(the ASGI scope's `client`): a migrating D hands that TCP connection to another D
(pdtopo/runtime/api/handoff.py).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

log = logging.getLogger("pdtopo.http")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

_Base: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS["auto"])


_OPEN: dict[tuple[str, int], asyncio.Protocol] = {}  # peer (host, port) -> its protocol


def connection_for(client: tuple[str, int] | list | None) -> asyncio.Protocol | None:
    """The protocol (with its `transport`) of the open connection from `client`, if any."""
    return _OPEN.get(tuple(client)) if client else None  # type: ignore[arg-type]


class HttpProtocol(_Base):  # type: ignore[misc, valid-type]
    _seen_data = False
    _peer: tuple[str, int] | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._peer = (str(peer[0]), int(peer[1]))
            _OPEN[self._peer] = self

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        if self._peer is not None and _OPEN.get(self._peer) is self:
            del _OPEN[self._peer]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._seen_data:
            self._seen_data = True
            if data.startswith(H2_PREFACE):
                log.debug("closed an HTTP/2 prior-knowledge connection (a router's gRPC probe)")
                self.transport.close()
                return
        super().data_received(data)
