"""Bootstrap server program: the deployment's registry of prefill/decode instances (docs/protocol.md#bootstrap-api).

P and D processes `PUT /route` their full rank tuple and addresses at start and
`POST /heartbeat` every few seconds; entries whose heartbeats stop are dropped after the TTL.
D looks up the P instance of a request with `GET /list?role=prefill` (matching the side-channel
address injected by the router) or by rank tuple with `GET /route`. Everything but `/health`
and the OpenAPI schema requires the per-deployment token (`Authorization: Bearer <token>`).

Run by the launcher as `python -m pdtopo.runtime.bootstrap --run-dir RUN --process bootstrap`,
or directly as `python -m pdtopo.runtime.bootstrap --port 8998 --token T`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pdtopo.logs import configure_logging
from pdtopo.runtime.bootstrap.protocol import Heartbeat, Registration, Role
from pdtopo.runtime.bootstrap.registry import InstanceRegistry
from pdtopo.runtime.settings import load_process_context

log = logging.getLogger("pdtopo.bootstrap")


def _validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return JSONResponse(status_code=400, content={"error": "invalid request", "detail": problems})


def create_app(token: str, ttl_s: float = 15.0, sweep_interval_s: float = 1.0) -> FastAPI:
    """The bootstrap FastAPI app. `token` must be non-empty: registration is never open."""
    if not token:
        raise ValueError("the bootstrap server needs a deployment token (PDTOPO_DEPLOYMENT_TOKEN)")
    registry = InstanceRegistry(ttl_s=ttl_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async def sweep() -> None:
            while True:
                await asyncio.sleep(sweep_interval_s)
                dropped = registry.expire()
                if dropped:
                    log.warning("dropped %d registration(s) whose heartbeats stopped", dropped)

        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="pdtopo bootstrap server", version="1", lifespan=lifespan)
    app.state.registry = registry
    app.add_exception_handler(RequestValidationError, _validation_error_handler)

    def require_token(authorization: str | None = Header(None)) -> None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong deployment token: send 'Authorization: Bearer <token>'",
            )

    auth = [Depends(require_token)]

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "instances": len(registry)}

    @app.put("/route", dependencies=auth)
    def register(reg: Registration) -> dict:
        key, replaced = registry.register(reg.model_dump())
        log.info("%s %s rank %s at %s", "re-registered" if replaced else "registered",
                 reg.instance_id, key[2:], reg.zmq_addr)
        return {"status": "registered", "replaced": replaced, "ttl_s": registry.ttl_s}

    @app.post("/heartbeat", dependencies=auth)
    def heartbeat(hb: Heartbeat) -> dict:
        if not registry.heartbeat(hb.role, hb.instance_id, hb.model_dump()):
            raise HTTPException(
                status_code=404,
                detail=f"{hb.role} instance {hb.instance_id!r} with that rank tuple is not "
                "registered (expired or never registered): register again with PUT /route",
            )
        return {"status": "ok"}

    @app.get("/list", dependencies=auth)
    def list_instances(role: Role | None = None) -> list[dict]:
        return registry.list(role)

    @app.get("/route", dependencies=auth)
    def route(
        role: Role,
        instance_id: str = Query(min_length=1),
        tp_rank: int = Query(0, ge=0),
        cp_rank: int = Query(0, ge=0),
        dp_rank: int = Query(0, ge=0),
        pp_rank: int = Query(0, ge=0),
    ) -> dict:
        ranks = {"tp_rank": tp_rank, "cp_rank": cp_rank, "dp_rank": dp_rank, "pp_rank": pp_rank}
        entry = registry.get(role, instance_id, ranks)
        if entry is None:
            raise HTTPException(
                status_code=404,
                detail=f"no live {role} instance {instance_id!r} with ranks {ranks}",
            )
        return entry

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdtopo.runtime.bootstrap")
    parser.add_argument("--run-dir", help="launcher run directory (config.yaml, plan.json)")
    parser.add_argument("--process", default="bootstrap", help="this program's plan entry")
    parser.add_argument("--host", default=None, help="bind address (direct form: default "
                        "127.0.0.1; with --run-dir: default the plan's, e.g. 0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, help="direct form: port")
    parser.add_argument("--token", help="direct form: deployment token")
    parser.add_argument("--ttl", type=float, default=15.0, help="direct form: heartbeat TTL (s)")
    args = parser.parse_args(argv)
    configure_logging()

    if args.run_dir:
        ctx = load_process_context(args.run_dir, args.process)
        host = args.host or ctx.bind_host
        port = int(ctx.ports.get("http") or ctx.cfg.topology.bootstrap.port)
        token, ttl = ctx.token, ctx.settings.bootstrap.heartbeat_ttl_s
    else:
        if args.port is None:
            parser.error("give --run-dir, or --port (and --token) for the direct form")
        host, port, token, ttl = args.host or "127.0.0.1", args.port, args.token, args.ttl
    if not token:
        parser.error("no deployment token: set PDTOPO_DEPLOYMENT_TOKEN or pass --token")
    log.info("bootstrap server on http://%s:%d (ttl %.1fs)", host, port, ttl)
    uvicorn.run(create_app(token, ttl_s=ttl), host=host, port=port, log_level="warning")
