"""The source side of a response that moves with its request to another D (issue 50).

On a D with `disaggregation.migration=true`, `MovableMiddleware` keeps, for every inference
request being answered, what another server needs to answer it instead (`MovableResponse`:
the ASGI scope, the body, the handles submitted for it, an OpenAI response's id and created
time) in `ServerState.movable`, keyed by request id, and marks every response `connection:
close` (a connection handed away mid-response is never reused for another request).

A move, once the request's KV is on the target (migration_routes.py):

    HandoffMarker put in the handle's sink   after every output D1 emitted (same queue)
    the response's consumer takes it         streaming.merged_outputs / collect: by then every
                                             earlier event was written to the transport
    HandoffMarker.perform()                  waits for the transport's buffer to empty, stops
                                             reading, passes the socket to the target
                                             (handoff.send_connection), detaches the handle
                                             (no abort on the way out) and closes its own copy;
                                             the target writes the rest of the response
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdtopo.runtime.api.handoff import HandoffError, send_connection
from pdtopo.runtime.api.http_probe import connection_for
from pdtopo.runtime.engine.request import ReqOutput

log = logging.getLogger("pdtopo.movable")

# the response being answered on this task (set by MovableMiddleware)
CURRENT: contextvars.ContextVar[MovableResponse | None] = contextvars.ContextVar(
    "pdtopo_movable_response", default=None)

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string",
              "root_path", "client", "server")


@dataclass
class MovableResponse:
    scope: dict[str, Any]
    body: bytearray = field(default_factory=bytearray)
    handles: list[Any] = field(default_factory=list)   # the route's Handles
    envelope: dict[str, Any] | None = None   # an OpenAI response's {"id", "created"}
    started: float = field(default_factory=time.monotonic)

    def single(self) -> Any:
        """The one request of this response (None: several, e.g. n > 1, or none yet)."""
        return self.handles[0] if len(self.handles) == 1 else None

    def describe(self) -> dict[str, Any]:
        """What the target needs to answer it (JSON)."""
        s = self.scope
        return {
            "scope": {
                **{k: s[k] for k in ("http_version", "method", "scheme", "path", "root_path")
                   if k in s},
                "query_string": bytes(s.get("query_string", b"")).decode("latin-1"),
                "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                            for k, v in s.get("headers", [])],
                "client": list(s["client"]) if s.get("client") else None,
                "server": list(s["server"]) if s.get("server") else None,
            },
            "body": base64.b64encode(bytes(self.body)).decode(),
            "envelope": self.envelope,
            "elapsed_s": time.monotonic() - self.started,
        }


def note_handle(state: Any, h: Any) -> None:
    """ServerState.submit: `h` belongs to the response being answered (if it may move)."""
    rec = CURRENT.get()
    if rec is not None:
        rec.handles.append(h)
        state.movable[h.rid] = rec


def note_envelope(rid: str, created: int) -> None:
    rec = CURRENT.get()
    if rec is not None:
        rec.envelope = {"id": rid, "created": created}


class MovableMiddleware:
    """ASGI middleware of a migrating D (see the module docstring)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in INFERENCE_PATHS \
                or scope.get("pdtopo_resumed"):
            await self.app(scope, receive, send)
            return
        rec = MovableResponse({k: scope[k] for k in SCOPE_KEYS if k in scope}
                              | {"headers": list(scope.get("headers", []))})

        async def recording_receive() -> dict:
            msg = await receive()
            if msg.get("type") == "http.request":
                rec.body += msg.get("body", b"")
            return msg

        async def closing_send(msg: dict) -> None:
            if msg.get("type") == "http.response.start":
                headers = list(msg.get("headers", []))
                if not any(k.lower() == b"connection" for k, _ in headers):
                    msg = {**msg, "headers": headers + [(b"connection", b"close")]}
            await send(msg)

        token = CURRENT.set(rec)
        try:
            await self.app(scope, recording_receive, closing_send)
        finally:
            CURRENT.reset(token)
            for h in rec.handles:
                if self.state.movable.get(h.rid) is rec:
                    del self.state.movable[h.rid]


class HandoffMarker(ReqOutput):
    """Put in a moved request's sink after its last output here: its consumer performs the
    handoff (the consumer knows every earlier event is written by then)."""

    def __init__(self, rec: MovableResponse, address: str, done: asyncio.Future) -> None:
        h = rec.single()
        assert h is not None
        super().__init__(rid=h.rid, new_token_ids=[], num_output_tokens=len(h.output_ids),
                         prompt_tokens=len(h.req.prompt_ids))
        self.rec, self.address, self.done = rec, address, done

    async def perform(self, streamed: bool) -> None:
        """Give the client's connection to the target (`streamed`: the response is begun);
        `done` gets None or the error. The caller then waits to be cancelled or gives up (its
        connection is closed here)."""
        h = self.rec.single()
        assert h is not None
        proto = connection_for(self.rec.scope.get("client"))
        try:
            if proto is None:
                raise HandoffError("the client's connection is already closed")
            transport = proto.transport  # type: ignore[attr-defined]
            for _ in range(5000):  # what this server wrote must reach the socket first
                if transport.get_write_buffer_size() == 0:
                    break
                await asyncio.sleep(0.001)
            else:
                raise HandoffError("the client does not read: 5 s of unsent response")
            transport.pause_reading()
            fd = transport.get_extra_info("socket").fileno()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, send_connection, self.address, h.rid, fd,
                                       streamed)
        except HandoffError as exc:
            h.detached = True  # the request lives on the target now; the client has lost it
            if proto is not None:
                proto.transport.close()  # type: ignore[attr-defined]
            self.done.set_result(str(exc))
            return
        h.detached = True
        log.debug("%s: its connection went to %s", h.rid, self.address.lstrip("\0"))
        self.done.set_result(None)  # before the close: a stream is cancelled by it
        transport.close()
        while connection_for(self.rec.scope.get("client")) is proto:
            await asyncio.sleep(0.001)  # closed for uvicorn too: it writes nothing more
