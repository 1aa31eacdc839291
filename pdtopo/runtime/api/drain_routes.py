"""Draining a server for `pdtopo drain` / `pdtopo restart`: the in-flight count and the switch.

`InFlightMiddleware` counts the inference requests (POST /generate, /v1/completions,
/v1/chat/completions) whose response has not been sent to the end, streams included, in
`ServerState.http_in_flight`. `POST /pdtopo/drain` (body `{"drain": true|false}`, the deployment
token as `Authorization: Bearer <token>`) sets `ServerState.draining`: while it is set `/health`
answers 503, so the router's health checks stop choosing this server, and requests that still
arrive are served as usual (the router may have chosen this server before it noticed). The
answer, like `/pdtopo/state`, carries `in_flight`: HTTP requests open here plus the requests the
scheduler still holds, plus a P's rooms whose KV waits for D's pull (`pd_inflight_senders`). The
launcher waits for 0 before it restarts the program.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse

from pdtopo.runtime.api.errors import error_response
from pdtopo.runtime.api.routing import ServerDep
from pdtopo.runtime.api.state import ServerState

router = APIRouter()

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class InFlightMiddleware:
    """ASGI middleware: `state.http_in_flight` is the number of inference requests being
    answered (incremented when one arrives, decremented when its last byte was sent or the
    client went away)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.http_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.http_in_flight -= 1


def in_flight(state: ServerState) -> int:
    """0 when nothing is in flight (a request being answered counts once at the HTTP side and
    once in the engine). A P's request leaves the engine once its KV is announced, but its
    packed copy waits for D's pull (`pd_inflight_senders`): stopping P then would fail it."""
    stats = state.scheduler.stats() if state.scheduler is not None else {}
    held = int(stats.get("num_reqs", 0)) + int(stats.get("pd_inflight_senders", 0))
    return state.http_in_flight + held


def token_problem(state: ServerState, authorization: str | None) -> JSONResponse | None:
    token = state.ctx.token
    if not token:
        return error_response(403, "this server has no deployment token (it was not started by "
                              "pdtopo launch): draining is off")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        return error_response(401, "missing or wrong deployment token: send 'Authorization: "
                              "Bearer <token>' (RUN/token)")
    return None


@router.post("/pdtopo/drain")
async def drain(state: ServerDep, body: dict[str, Any] | None = None,
                authorization: str | None = Header(None)) -> JSONResponse:
    problem = token_problem(state, authorization)
    if problem is not None:
        return problem
    value = (body or {}).get("drain", True)
    if not isinstance(value, bool):
        return error_response(400, f"drain: expected true or false, got {value!r}")
    state.draining = value
    return JSONResponse({"draining": state.draining, "in_flight": in_flight(state),
                         "http_in_flight": state.http_in_flight})
