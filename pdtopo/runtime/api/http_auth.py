"""The credential a P/D server beyond loopback asks of every HTTP caller.

    guard = HttpGuard.from_context(ctx)     # off, or the credentials this server accepts
    guard.problem(authorization_header)     # None: let it in; else the 401 message
    app = HttpAuthMiddleware(app, guard)    # ASGI: 401 JSON before any route runs

`server.http_auth` (pdtopo.config.credentials.http_auth_on, the same decision the planner
made) says whether this server requires one. Accepted: `Authorization: Bearer <key>` with the
proxy's API key (the router sends it on every call it makes for a client, and on its own
info calls) or with the deployment token (the launcher's admin calls: drain, state). `/health`
and `/metrics` stay open: the router's health checks and Prometheus carry no credential.
Comparisons are constant-time.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from pdtopo.config.credentials import OPEN_PATHS, http_auth_on

WWW_AUTHENTICATE = b'Bearer realm="pdtopo"'


@dataclass(frozen=True)
class HttpGuard:
    required: bool
    accepted: tuple[str, ...] = ()
    why: str = ""  # the setting and the address that made this server require one

    @classmethod
    def from_context(cls, ctx: Any) -> HttpGuard:
        setting = ctx.settings.server.http_auth
        if not http_auth_on(setting, ctx.role, ctx.bind_host, (ctx.plan or {}).get("mode")):
            return cls(required=False)
        accepted = tuple(c for c in (ctx.api_key, ctx.token) if c)
        if not accepted:
            raise RuntimeError(f"server.http_auth={setting!r}: {ctx.name} (listening on "
                               f"{ctx.bind_host}) must check a credential, but it has none "
                               "(no deployment token PDTOPO_DEPLOYMENT_TOKEN, no proxy API key)")
        return cls(required=True, accepted=accepted,
                   why=f"server.http_auth={_yaml(setting)}, listening on {ctx.bind_host}")

    def problem(self, authorization: str | None) -> str | None:
        if not self.required:
            return None
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return ("this server requires a credential: send 'Authorization: Bearer <key>' "
                    "with the proxy's API key (RUN/api_key when it is derived) or the "
                    f"deployment token ({self.why})")
        value = given.strip().encode()
        if any(secrets.compare_digest(value, c.encode()) for c in self.accepted):
            return None
        return "wrong credential: neither the proxy's API key nor the deployment token"


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def unauthorized_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "unauthorized", "param": None,
                                 "code": 401}}).encode()


class HttpAuthMiddleware:
    """ASGI middleware: a request to anything but OPEN_PATHS without an accepted credential is
    answered 401 (JSON, `WWW-Authenticate: Bearer`) and never reaches a route."""

    def __init__(self, app: Any, guard: HttpGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.guard.required or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                       if k == b"authorization"), None)
        problem = self.guard.problem(header)
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = unauthorized_body(problem)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", WWW_AUTHENTICATE)]})
        await send({"type": "http.response.body", "body": body})
