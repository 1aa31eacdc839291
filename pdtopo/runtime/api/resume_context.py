"""A moved request as the target D's HTTP side holds it until its connection arrives.

`ResumeTicket` is made by `POST /pdtopo/migrate_in` (migration_routes.py) for the offer it
passes to the scheduler: the sink the scheduler will emit into (already holding one output
with every token the source wrote to the client: `prefix`), the response's description from
the source (scope, body, OpenAI id/created), and the Req the HTTP side shows. While the route
that answers it runs (resume.py), `RESUMING` holds the ticket: `ServerState.submit` returns
the ticket's handle instead of submitting, and the OpenAI envelope takes the source's id and
created time, so the rest of the response continues the one the client has.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

from pdtopo.runtime.engine.request import AsyncSink, Req, ReqOutput

RESUMING: contextvars.ContextVar[ResumeTicket | None] = contextvars.ContextVar(
    "pdtopo_resuming", default=None)


@dataclass
class ResumeTicket:
    req: Req
    sink: AsyncSink
    prefix: ReqOutput
    response: dict[str, Any]          # MovableResponse.describe() of the source
    made: float = field(default_factory=time.monotonic)
    adopted: bool = False
    handle: Any = None                # the route's Handle (ServerState.submit makes it)

    def replaying(self) -> bool:
        """True while the response's events are built from what the client already has."""
        h = self.handle
        return h is None or h.last_out is None or h.last_out is self.prefix

    def envelope(self) -> dict[str, Any] | None:
        return self.response.get("envelope")
