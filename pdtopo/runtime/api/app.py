"""The FastAPI app of a pdtopo server: sglang's native API, info/health routes, metrics.

Routes here: POST /generate, GET /health, /health_generate, /get_server_info (/server_info),
/get_model_info (/model_info), /v1/models, /get_load, /metrics, /pdtopo/state,
POST /flush_cache. OpenAI routes are in `openai_api.py`. Each request handler validates and
tokenizes (asyncio thread), submits `Req`s to the scheduler, and awaits their sinks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdtopo.runtime.api.errors import error_response, install_error_handlers
from pdtopo.runtime.api.openai_api import install_openai_routes
from pdtopo.runtime.api.protocol import GenerateRequest, parse_body
from pdtopo.runtime.api.state import DISAGG_MODE, Handle, Prepared, ServerState
from pdtopo.runtime.api.streaming import (
    SSE_DONE,
    ClientDisconnected,
    TextView,
    abort_error,
    collect,
    merged_outputs,
    sse,
)
from pdtopo.runtime.engine.metrics import CONTENT_TYPE
from pdtopo.runtime.engine.request import InvalidRequest, ReqOutput, SamplingParams


def _per_item(value: Any, n: int, field_name: str, batch: bool) -> list[Any]:
    """Broadcast a scalar top-level field over a batch, or check a list's length."""
    if batch and isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(field_name, f"{field_name} has {len(value)} entries for a batch "
                                 f"of {n}")
        return value
    if not batch and isinstance(value, list):
        if len(value) != 1:
            raise InvalidRequest(field_name, f"{field_name} must be a single value here")
        return value
    return [value] * n


def _item_rids(rid: Any, n: int, batch: bool) -> list[str | None]:
    if isinstance(rid, list):
        return _per_item(rid, n, "rid", batch)
    if rid is None:
        return [None] * n
    return [rid] if not batch else [f"{rid}_{i}" for i in range(n)]


def generate_items(state: ServerState, body: GenerateRequest) -> tuple[list[Handle], bool]:
    """Validate a /generate body into submitted handles (all validated before any submit)."""
    state.require_engine()
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("text", "exactly one of text and input_ids must be given")
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if batch else [body.text]
        if batch and not texts:
            raise InvalidRequest("text", "text is an empty batch")
        prompts = [state.encode_text(t, f"text[{i}]" if batch else "text")
                   for i, t in enumerate(texts)]
        fields = [f"text[{i}]" if batch else "text" for i in range(len(texts))]
    else:
        ids = body.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        lists = ids if batch else [ids]
        fields = [f"input_ids[{i}]" if batch else "input_ids" for i in range(len(lists))]
        prompts = [state.check_ids(x, f) for x, f in zip(lists, fields, strict=True)]
    n = len(prompts)
    sps = body.sampling_params
    if isinstance(sps, list):
        if len(sps) != n:
            raise InvalidRequest("sampling_params", f"sampling_params has {len(sps)} entries for "
                                 f"a batch of {n}")
    else:
        sps = [sps] * n
    prepared = [state.prepare(p, sp, prompt_field=f,
                              sampling_prefix=f"sampling_params[{i}]" if isinstance(
                                  body.sampling_params, list) else "sampling_params")
                for i, (p, sp, f) in enumerate(zip(prompts, sps, fields, strict=True))]
    rids = _item_rids(body.rid, n, batch)
    hosts = _per_item(body.bootstrap_host, n, "bootstrap_host", batch)
    ports = _per_item(body.bootstrap_port, n, "bootstrap_port", batch)
    rooms = _per_item(body.bootstrap_room, n, "bootstrap_room", batch)
    handles = [state.submit(p, rid=r, bootstrap_host=h, bootstrap_port=pt, bootstrap_room=rm)
               for p, r, h, pt, rm in zip(prepared, rids, hosts, ports, rooms, strict=True)]
    return handles, batch


def generate_result(h: Handle, view: TextView, upto: ReqOutput | None = None) -> dict[str, Any]:
    """sglang's /generate result; `upto`: as of that output (streaming), else the final one."""
    out = upto or h.final
    ids = h.output_ids[:out.num_output_tokens] if out is not None else list(h.output_ids)
    final = out if out is not None and out.finished else None
    return {
        "text": view.visible(ids, final),
        "output_ids": ids,
        "meta_info": {
            "id": h.rid,
            "prompt_tokens": len(h.req.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "finish_reason": final.finish_reason if final else None,
            "e2e_latency": time.perf_counter() - h.started,
        },
    }


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pdtopo server", docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)

    @app.post("/generate")
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        handles, batch = generate_items(state, body)
        views = [TextView(state.tokenizer, h) for h in handles]
        if body.stream:
            return StreamingResponse(_generate_stream(handles, views, batch),
                                     media_type="text/event-stream")
        try:
            await collect(handles, request)
        except ClientDisconnected:
            return error_response(499, "client disconnected")
        for h in handles:
            err = abort_error(h.final)
            if err is not None:
                return error_response(err[0], f"request {h.rid}: {err[1]}")
        results = [generate_result(h, v) for h, v in zip(handles, views, strict=True)]
        return JSONResponse(results if batch else results[0])

    async def _generate_stream(handles: list[Handle], views: list[TextView], batch: bool):
        async for i, out in merged_outputs(handles):
            h = handles[i]
            err = abort_error(out) if out.finished else None
            if err is not None:
                yield sse({"error": {"message": f"request {h.rid}: {err[1]}", "code": err[0]},
                           **({"index": i} if batch else {})})
                continue
            chunk = generate_result(h, views[i], out)
            if batch:
                chunk["index"] = i
            yield sse(chunk)
        yield SSE_DONE

    @app.get("/health")
    async def health():
        if state.load_error:
            return error_response(503, f"engine failed to load: {state.load_error}")
        if not state.ready:
            return error_response(503, "engine is loading")
        if state.scheduler is None or not state.scheduler.alive:
            return error_response(503, "engine scheduler has stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate():
        state.require_engine()
        ids = state.tokenizer.encode("hi")
        sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        h = state.submit(Prepared(ids, sp), health_check=True)  # P/D: local, no peer
        try:
            await asyncio.wait_for(collect([h], None), timeout=60.0)
        except asyncio.TimeoutError:
            return error_response(503, "health generation timed out after 60 s")
        err = abort_error(h.final)
        if err is not None:
            return error_response(503, f"health generation failed: {err[1]}")
        return JSONResponse({"status": "ok", "output_ids": h.output_ids})

    def server_info() -> dict[str, Any]:
        eng = state.engine
        stats = state.scheduler.stats() if state.scheduler is not None else {}
        info = state.model_info()
        total_pages = stats.get("total_pages")
        return {
            **info,
            "version": "pdtopo-0.1.0",
            "role": state.ctx.role,
            "name": state.ctx.name,
            "load_balance_method": "round_robin",
            "page_size": int(eng.page_size),
            "context_length": int(eng.max_model_len),
            "max_running_requests": int(eng.max_running_requests),
            "max_prefill_tokens": int(eng.max_prefill_tokens),
            "max_total_num_tokens": (total_pages * int(eng.page_size)) if total_pages else None,
            "dtype": str(eng.dtype),
            "kv_dtype": str(eng.kv_dtype),
            "ready": state.ready,
            "internal_states": [stats],
        }

    app.get("/get_server_info")(lambda: JSONResponse(server_info()))
    app.get("/server_info")(lambda: JSONResponse(server_info()))
    app.get("/get_model_info")(lambda: JSONResponse(state.model_info()))
    app.get("/model_info")(lambda: JSONResponse(state.model_info()))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "pdtopo", "root": state.served_model_name,
            "max_model_len": int(state.engine.max_model_len)}]}

    @app.post("/flush_cache")
    async def flush_cache():
        state.require_engine()
        return Response("Cache flushed (pdtopo keeps no prefix cache: nothing to drop).\n",
                        media_type="text/plain")

    @app.get("/get_load")
    async def get_load():
        st = state.require_engine().stats()
        return [{"dp_rank": int(state.ctx.rank.get("dp_rank", 0)),
                 "num_reqs": st["num_running"] + st["num_waiting"],
                 "num_waiting_reqs": st["num_waiting"], "num_tokens": st["num_tokens"]}]

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/pdtopo/state")
    async def pdtopo_state():
        stats = state.scheduler.stats() if state.scheduler is not None else {}
        return {"ready": state.ready, "role": state.ctx.role, "name": state.ctx.name,
                "disaggregation_mode": DISAGG_MODE.get(state.ctx.role, state.ctx.role),
                "load_error": state.load_error, **stats}

    install_openai_routes(app, state)
    return app
