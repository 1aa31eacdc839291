"""What every route module shares: the `ServerState` dependency and how handles become replies.

`create_app` stores the server's one `ServerState` on `app.state.server`; a handler declares a
parameter `state: ServerDep` and FastAPI passes that state in (`server_state`). Handlers submit
`Handle`s and then either stream them (`event_stream` of SSE events, `stream_error_event` for a
request that ended in an abort) or wait for all of them (`finished_or_error`: the 499 / abort
error response to send instead, or None when every handle finished cleanly).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdtopo.runtime.api.errors import error_response
from pdtopo.runtime.api.state import Handle, ServerState
from pdtopo.runtime.api.streaming import ClientDisconnected, abort_error, collect, sse


async def server_state(request: Request) -> ServerState:
    """The app's `ServerState` (async: read on the event loop, no threadpool hop)."""
    return request.app.state.server


ServerDep = Annotated[ServerState, Depends(server_state)]


def first_abort_error(handles: list[Handle]) -> JSONResponse | None:
    """The error response of the first handle whose request was aborted, if any."""
    for h in handles:
        err = abort_error(h.final)
        if err is not None:
            return error_response(err[0], f"request {h.rid}: {err[1]}")
    return None


async def finished_or_error(handles: list[Handle], request: Request) -> JSONResponse | None:
    """Await every handle's final output; None if all finished, else the response to send:
    499 when the client went away, or the first aborted request's error."""
    try:
        await collect(handles, request)
    except ClientDisconnected:
        return error_response(499, "client disconnected")
    return first_abort_error(handles)


def stream_error_event(h: Handle, err: tuple[int, str], **extra: Any) -> bytes:
    """The SSE event a stream sends for a request that ended in an abort."""
    return sse({"error": {"message": f"request {h.rid}: {err[1]}", "code": err[0]}, **extra})


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")
