"""Error bodies and exception handlers: every client error is a 400 naming the field.

Body: `{"error": {"message", "type", "param", "code"}}` (the shape OpenAI clients parse).
FastAPI's 422 validation errors (wrong types, malformed JSON, missing fields) become 400s whose
message names the field path, e.g. `sampling_params.temperature: Input should be a valid number`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pdtopo.runtime.api.state import EngineUnavailable
from pdtopo.runtime.engine.request import UINT64_MAX, InvalidRequest

log = logging.getLogger("pdtopo.api")

_TYPES = {400: "invalid_request_error", 499: "client_closed_request", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                   "param": param, "code": status}},
        status_code=status)


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    msgs = []
    for e in errors[:4]:
        msgs.append(f"{_loc(e.get('loc', ()))}: {e.get('msg')}"
                    + (f" (got {e['input']!r})" if "input" in e and e.get("type") != "missing"
                       and not isinstance(e["input"], dict) else ""))
    return "; ".join(msgs), _loc(first.get("loc", ()))


def _rooms(value, n: int) -> list[int]:
    """The rooms D waits on for this body: `fanout.spread`'s rule for n completions each."""
    values = value if isinstance(value, list) else [value]
    values = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if n == 1 or (isinstance(value, list) and len(value) == n):
        return values
    return [(v + i) % (UINT64_MAX + 1) for v in values for i in range(n)]


def tell_peer_rejected(request: Request, exc: InvalidRequest) -> None:
    """A prefill server that rejects a PD request (too long, bad sampling values) tells the
    decode server waiting for that room's KV at once, over the side channel, so D ends the
    request with the same 400 instead of waiting `kv_timeout_s` for KV that never comes."""
    rooms = _rooms(getattr(request.state, "bootstrap_rooms", None),
                   getattr(request.state, "completions", 1))
    scheduler = getattr(getattr(request.app.state, "server", None), "scheduler", None)
    reject = getattr(scheduler, "reject_room", None)
    if not rooms or reject is None:
        return
    for room in rooms:
        reject(room, f"rejected by the prefill server: {exc.message}", 400)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        tell_peer_rejected(request, exc)
        return error_response(400, exc.message, exc.field)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable):
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
