"""The FastAPI app of a pdtopo server: sglang's native API, OpenAI's API, info/health, metrics.

`create_app(state)` builds the app, stores the server's one `ServerState` on `app.state.server`
(every handler gets it from there through the `ServerDep` dependency in `routing.py`), installs
the error handlers (`errors.py`: client errors are 400s naming the field) and includes the two
route tables: `native_routes.router` (POST /generate, health, server/model info, /v1/models,
/get_load, /metrics, /pdtopo/state, /flush_cache) and `openai_api.router` (/v1/completions,
/v1/chat/completions), plus `drain_routes` (POST /pdtopo/drain and the in-flight count its
middleware keeps) and `migration_routes` (a D's running requests moved to another D with
their connections: `MovableMiddleware` and the handoff listener, on a D with
`disaggregation.migration=true` only). `BodyLimitMiddleware` (pdtopo/body_limit.py) answers 413 to a body over
`server.max_body_bytes` before it is read. Outermost, `HttpAuthMiddleware` answers 401 to a
caller without a credential where the server requires one (beyond loopback:
pdtopo/runtime/api/http_auth.py). A handler validates its body, tokenizes it off the event loop
(`ServerState.off_loop`: a long prompt takes seconds), submits `Req`s to the scheduler
(`ServerState.submit`), and awaits their sinks or streams their outputs as SSE.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from pdtopo.body_limit import BodyLimitMiddleware
from pdtopo.runtime.api import drain_routes, migration_routes, native_routes, openai_api
from pdtopo.runtime.api.errors import install_error_handlers
from pdtopo.runtime.api.handoff import HandoffListener, handoff_address
from pdtopo.runtime.api.http_auth import HttpAuthMiddleware, HttpGuard
from pdtopo.runtime.api.movable import MovableMiddleware
from pdtopo.runtime.api.resume import adopt_from_thread
from pdtopo.runtime.api.state import ServerState


def migrates(state: ServerState) -> bool:
    """A D whose running requests may move to another D (and that takes moved ones)."""
    return state.ctx.role == "decode" and bool(state.ctx.settings.disaggregation.migration)


def create_app(state: ServerState) -> FastAPI:
    moves = migrates(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        listener = None
        if moves:  # connections of requests moved here (resume.py)
            loop = asyncio.get_running_loop()
            listener = HandoffListener(
                handoff_address(int(state.ctx.ports["http"])),
                lambda rid, fd, streamed: adopt_from_thread(state, app, loop, rid, fd,
                                                            streamed))
        try:
            yield
        finally:
            if listener is not None:
                listener.close()

    app = FastAPI(title="pdtopo server", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(native_routes.router)
    app.include_router(openai_api.router)
    app.include_router(drain_routes.router)
    app.include_router(migration_routes.router)
    if moves:
        app.add_middleware(MovableMiddleware, state=state)
    app.add_middleware(drain_routes.InFlightMiddleware, state=state)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.ctx.settings.server.max_body_bytes,
                       key="server.max_body_bytes")
    app.add_middleware(HttpAuthMiddleware, guard=HttpGuard.from_context(state.ctx))
    return app
