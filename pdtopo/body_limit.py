"""The request body limit of pdtopo's HTTP servers (P, D, colocated) and of the mini_lb proxy.

    app = BodyLimitMiddleware(app, max_bytes=8 << 20, key="server.max_body_bytes")

ASGI middleware, one rule for every route: a request whose `Content-Length` is over
`max_bytes` is answered 413 at once, before any of its body is read and before the app sees
it. A body without a length (chunked) is read here as it arrives and counted: past `max_bytes`
the request is answered 413 and the app never runs (what was read, at most `max_bytes`, is
dropped); within the limit the app gets the body just as it came. Bodies with a length within
the limit pass through untouched (the HTTP parser holds the client to its `Content-Length`).

uvicorn reads and drops the rest of a refused body after the answer, so a client that sends
its whole body before it reads gets the 413 too, on a connection it can use again. The answer
is the API's error body, `{"error": {"message", "type", "param", "code": 413}}`, its message
naming the limit's config key and value. The Rust router and the model gateway enforce the
same limit themselves (`--max-payload-size`, pdtopo.launcher.plan.expand.router_command).
"""

from __future__ import annotations

import json
from typing import Any

STATUS = 413


def too_large_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "request_too_large",
                                 "param": None, "code": STATUS}}).encode()


def declared_length(scope: dict) -> int | None:
    """The request's Content-Length (None: no header, a chunked body; -1: unreadable)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes` (see module docstring); `key` names the
    setting in the answer."""

    def __init__(self, app: Any, max_bytes: int, key: str) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)
        self.key = key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await self.refuse(send, f"the request body has {length} bytes")
            return
        if length is not None:  # within the limit (or unreadable: the HTTP parser refuses it)
            await self.app(scope, receive, send)
            return
        messages = await self._read_chunked(receive)
        if messages is None:
            await self.refuse(send, f"the request body (chunked) has more than {self.max_bytes} "
                              "bytes")
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _read_chunked(self, receive: Any) -> list[dict] | None:
        """The body's messages, or None once they pass the limit (or the client left)."""
        messages: list[dict] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # http.disconnect: the app sees it as it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def refuse(self, send: Any, what: str) -> None:
        body = too_large_body(f"{what}, over the limit {self.key}={self.max_bytes}: send a "
                              "smaller request (or raise the limit)")
        await send({"type": "http.response.start", "status": STATUS,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], receive: Any) -> Any:
    """A `receive` that hands out `messages` first, then what the server says later
    (a disconnect)."""
    pending = list(messages)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
