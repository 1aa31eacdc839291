"""The target side of a moved response: this D answers, on a connection handed to it, the rest
of a response another D began (issue 50).

    POST /pdtopo/migrate_in (migration_routes.py)  -> a ResumeTicket in ServerState.resuming,
                                                      the offer to the scheduler
    HandoffListener thread: adopt(rid, fd)         -> the ticket's connection: serve_resumed()
    serve_resumed                                  runs the app's own route for the source's
                                                   scope and body over that connection, under
                                                   RESUMING (the route gets the moved request's
                                                   handle instead of submitting one): events
                                                   built from the tokens the client already has
                                                   are dropped, the rest is written in the
                                                   framing the source began (chunked, headers
                                                   sent) or, for a response not begun, whole
    a ticket whose connection never comes          -> expired after `ttl_s`: the request is
                                                      aborted here
"""

from __future__ import annotations

import asyncio
import base64
import http
import logging
import socket
from typing import TYPE_CHECKING, Any

from pdtopo.runtime.api.resume_context import RESUMING, ResumeTicket

if TYPE_CHECKING:
    from pdtopo.runtime.api.state import ServerState

log = logging.getLogger("pdtopo.resume")

ADOPT_TIMEOUT_S = 5.0


def adopt_from_thread(state: ServerState, app: Any, loop: asyncio.AbstractEventLoop,
                      rid: str, fd: int, streamed: bool) -> str | None:
    """HandoffListener's callback (its thread): None when the connection was taken."""
    fut = asyncio.run_coroutine_threadsafe(_adopt(state, app, rid, fd, streamed), loop)
    return fut.result(ADOPT_TIMEOUT_S)


async def _adopt(state: ServerState, app: Any, rid: str, fd: int, streamed: bool) -> str | None:
    ticket = state.resuming.get(rid)
    if ticket is None:
        return f"no moved request {rid!r} waits for its connection here"
    if ticket.adopted:
        return f"request {rid!r} has its connection already"
    ticket.adopted = True
    asyncio.get_running_loop().create_task(serve_resumed(state, app, ticket, fd, streamed))
    return None


def expire(state: ServerState, rid: str, ticket: ResumeTicket) -> None:
    """The connection of a moved request never came (the source failed after the move)."""
    if state.resuming.get(rid) is ticket and not ticket.adopted:
        del state.resuming[rid]
        log.warning("%s: its connection never arrived from the source D: aborted", rid)
        if state.scheduler is not None:
            state.scheduler.abort(rid)


def _scope(ticket: ResumeTicket) -> dict[str, Any]:
    s = ticket.response["scope"]
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": s.get("http_version", "1.1"), "method": s.get("method", "POST"),
        "scheme": s.get("scheme", "http"), "path": s["path"], "raw_path": s["path"].encode(),
        "root_path": s.get("root_path", ""),
        "query_string": str(s.get("query_string", "")).encode("latin-1"),
        "headers": [(str(k).encode("latin-1"), str(v).encode("latin-1"))
                    for k, v in s.get("headers", [])],
        "client": tuple(s["client"]) if s.get("client") else None,
        "server": tuple(s["server"]) if s.get("server") else None,
        "pdtopo_resumed": True,
    }


class _Writer:
    """The ASGI `send` of a resumed response over the handed-over connection."""

    def __init__(self, writer: asyncio.StreamWriter, ticket: ResumeTicket, streamed: bool):
        self.w = writer
        self.ticket = ticket
        self.streamed = streamed      # the source sent the headers: chunked body goes on
        self.whole = False            # a response the source had not begun: written whole
        self.complete = False
        self.error_status: int | None = None  # an error answer where a stream was begun

    async def send(self, msg: dict) -> None:
        if self.complete:
            return
        if msg["type"] == "http.response.start":
            headers = [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
            if self.streamed:
                if any(k.lower() == b"content-length" for k, _ in headers):
                    # an error answer where a stream was begun: as an event, then the end
                    self.error_status = msg["status"]
                return
            self.whole = True
            phrase = http.HTTPStatus(msg["status"]).phrase
            head = [f"HTTP/1.1 {msg['status']} {phrase}".encode()]
            head += [k + b": " + v for k, v in headers if k.lower() != b"connection"]
            head.append(b"connection: close")
            self.w.write(b"\r\n".join(head) + b"\r\n\r\n")
        elif msg["type"] == "http.response.body":
            body = bytes(msg.get("body", b""))
            more = bool(msg.get("more_body", False))
            if self.whole:
                self.w.write(body)
            elif self.error_status is not None:
                if body:  # the error's JSON body, as one SSE event
                    self._chunk(b"data: " + body + b"\n\n")
            elif body and not self.ticket.replaying():
                self._chunk(body)
            if not more:
                if not self.whole:
                    self.w.write(b"0\r\n\r\n")
                self.complete = True
            await self.w.drain()

    def _chunk(self, data: bytes) -> None:
        self.w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def serve_resumed(state: ServerState, app: Any, ticket: ResumeTicket, fd: int,
                        streamed: bool) -> None:
    rid = ticket.req.rid
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    writer = None
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
        out = _Writer(writer, ticket, streamed)
        body = base64.b64decode(ticket.response.get("body", ""))
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            while await reader.read(65536):
                pass  # nothing else comes on a connection: close; EOF = the client left
            return {"type": "http.disconnect"}

        token = RESUMING.set(ticket)
        try:
            await app(_scope(ticket), receive, out.send)
        finally:
            RESUMING.reset(token)
        if not out.complete:
            log.warning("%s: the resumed response ended unfinished", rid)
    except Exception:
        log.exception("%s: answering the moved request failed", rid)
        if state.scheduler is not None:
            state.scheduler.abort(rid)
    finally:
        if state.resuming.get(rid) is ticket:
            del state.resuming[rid]
        if writer is not None:
            writer.close()
        else:
            sock.close()

