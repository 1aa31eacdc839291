"""The HTTP protocol class P/D servers run under uvicorn: uvicorn's own (`auto`), except that a
connection opening with the HTTP/2 prior-knowledge preface is closed quietly.

sglang-router (proxy.kind=rust) probes every worker it registers with an HTTP/1.1 health check
and, at the same time, a gRPC one (HTTP/2 without negotiation) to detect how it speaks. uvicorn
speaks HTTP/1.1 only, so each probe used to log "WARNING: Invalid HTTP request received." in
every P/D log at start-up; the router takes the closed connection as "not gRPC" just as it took
the 400. Any other malformed request still gets uvicorn's answer and warning.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

log = logging.getLogger("pdtopo.http")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

_Base: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS["auto"])


class HttpProtocol(_Base):  # type: ignore[misc, valid-type]
    _seen_data = False

    def data_received(self, data: bytes) -> None:
        if not self._seen_data:
            self._seen_data = True
            if data.startswith(H2_PREFACE):
                log.debug("closed an HTTP/2 prior-knowledge connection (a router's gRPC probe)")
                self.transport.close()
                return
        super().data_received(data)
