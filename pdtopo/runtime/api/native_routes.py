"""sglang's native API and pdtopo's info/health routes, as one `APIRouter` (`router`).

Routes: POST /generate, GET /health, /health_generate, /get_server_info (/server_info),
/get_model_info (/model_info), /v1/models, /get_load, /metrics, /pdtopo/state,
POST /flush_cache. Each handler gets the server's `ServerState` through the `ServerDep`
dependency (`routing.py`). /generate validates and tokenizes the whole body first (its prompts
off the event loop, `ServerState.off_loop`; then `generate_items`: every item checked before
any is submitted), submits `sampling_params.n` requests per item to the scheduler
(`fanout.py`), then streams their outputs as SSE (`generate_events`) or awaits their sinks and
answers with sglang's result objects (`generate_result`, with output logprobs in
`meta_info` when `return_logprob` asks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdtopo.runtime.api.drain_routes import in_flight
from pdtopo.runtime.api.errors import error_response
from pdtopo.runtime.api.fanout import submit_completions
from pdtopo.runtime.api.logprob_format import sglang_logprobs
from pdtopo.runtime.api.protocol import GenerateRequest, check_logprob_fields, parse_body
from pdtopo.runtime.api.routing import (
    ServerDep,
    event_stream,
    finished_or_error,
    stream_error_event,
)
from pdtopo.runtime.api.state import DISAGG_MODE, Handle, Prepared, ServerState
from pdtopo.runtime.api.streaming import (
    SSE_DONE,
    TextView,
    abort_error,
    collect,
    merged_outputs,
    sse,
)
from pdtopo.runtime.engine.metrics import CONTENT_TYPE
from pdtopo.runtime.engine.request import InvalidRequest, ReqOutput, SamplingParams

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 60.0
FLUSH_TIMEOUT_S = 10.0


# ---------------------------------------------------------------- /generate: body -> handles
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


def _item_logprobs(body: GenerateRequest, n: int, batch: bool) -> list[int]:
    """Each item's logprobs setting (SamplingParams.logprobs: -1 none, else top_n)."""
    wants = _per_item(body.return_logprob, n, "return_logprob", batch)
    tops = _per_item(body.top_logprobs_num, n, "top_logprobs_num", batch)
    return [(top or 0) if want else -1 for want, top in zip(wants, tops, strict=True)]


def _item_rids(rid: Any, n: int, batch: bool) -> list[str | None]:
    if isinstance(rid, list):
        return _per_item(rid, n, "rid", batch)
    if rid is None:
        return [None] * n
    return [rid] if not batch else [f"{rid}_{i}" for i in range(n)]


def _text_prompts(state: ServerState, text: Any) -> tuple[list[list[int]], list[str], bool]:
    batch = isinstance(text, list)
    texts = text if batch else [text]
    if batch and not texts:
        raise InvalidRequest("text", "text is an empty batch")
    fields = [f"text[{i}]" if batch else "text" for i in range(len(texts))]
    prompts = [state.encode_text(t, f) for t, f in zip(texts, fields, strict=True)]
    return prompts, fields, batch


def _id_prompts(state: ServerState, ids: Any) -> tuple[list[list[int]], list[str], bool]:
    batch = bool(ids) and isinstance(ids[0], list)
    lists = ids if batch else [ids]
    fields = [f"input_ids[{i}]" if batch else "input_ids" for i in range(len(lists))]
    prompts = [state.check_ids(x, f) for x, f in zip(lists, fields, strict=True)]
    return prompts, fields, batch


def _generate_prompts(state: ServerState,
                      body: GenerateRequest) -> tuple[list[list[int]], list[str], bool]:
    """The tokenized prompts, the field each came from, and whether the body is a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("text", "exactly one of text and input_ids must be given")
    if body.text is not None:
        return _text_prompts(state, body.text)
    return _id_prompts(state, body.input_ids)


def _sampling_per_item(sampling_params: Any, n: int) -> list[tuple[Any, str]]:
    """(sampling dict, the field name its errors are reported under) for each of n items."""
    if not isinstance(sampling_params, list):
        return [(sampling_params, "sampling_params")] * n
    if len(sampling_params) != n:
        raise InvalidRequest("sampling_params", f"sampling_params has {len(sampling_params)} "
                             f"entries for a batch of {n}")
    return [(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]


def generate_items(state: ServerState, body: GenerateRequest,
                   tokenized: tuple[list[list[int]], list[str], bool],
                   ) -> tuple[list[Handle], bool]:
    """Validate a /generate body, its prompts `tokenized` (`_generate_prompts`), into submitted
    handles (all validated before any submit)."""
    state.require_engine()
    prompts, fields, batch = tokenized
    n = len(prompts)
    sampling = _sampling_per_item(body.sampling_params, n)
    prepared = [state.prepare(p, sp, prompt_field=f, sampling_prefix=prefix)
                for p, (sp, prefix), f in zip(prompts, sampling, fields, strict=True)]
    for prep, logprobs in zip(prepared, _item_logprobs(body, n, batch), strict=True):
        prep.sampling.logprobs = logprobs
    rids = _item_rids(body.rid, n, batch)
    routing = {"bootstrap_host": body.bootstrap_host, "bootstrap_port": body.bootstrap_port,
               "bootstrap_room": body.bootstrap_room}
    handles = submit_completions(state, prepared, rids, routing)
    return handles, batch or len(handles) > 1


# ---------------------------------------------------------------- /generate: handles -> bodies
def _logprob_fields(h: Handle, view: TextView, ids: list[int],
                    with_text: bool) -> dict[str, Any]:
    """meta_info's logprob fields (none unless the request asked for logprobs). Prompt
    logprobs are not computed: the input fields are empty."""
    top_n = h.req.sampling.logprobs
    if top_n < 0:
        return {}
    return {"input_token_logprobs": [], **({"input_top_logprobs": []} if top_n else {}),
            **sglang_logprobs(view.tokenizer, ids, h.output_logprobs[:len(ids)], top_n,
                              with_text)}


def generate_result(h: Handle, view: TextView, upto: ReqOutput | None = None,
                    with_text: bool = False) -> dict[str, Any]:
    """sglang's /generate result; `upto`: as of that output (streaming), else the final one;
    `with_text`: logprob entries carry their token's text (`return_text_in_logprobs`)."""
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
            "cached_tokens": out.cached_tokens if out is not None else 0,
            "finish_reason": final.finish_reason if final else None,
            "e2e_latency": time.perf_counter() - h.started,
            **({"pd_timeline": out.timeline} if out is not None and out.timeline else {}),
            **_logprob_fields(h, view, ids, with_text),
        },
    }


async def generate_events(handles: list[Handle], views: list[TextView], batch: bool,
                          with_text: bool = False) -> AsyncIterator[bytes]:
    """The SSE stream of /generate: one result chunk per output (with its `index` in a batch)."""
    async for i, out in merged_outputs(handles):
        h = handles[i]
        err = abort_error(out) if out.finished else None
        if err is not None:
            yield stream_error_event(h, err, **({"index": i} if batch else {}))
            continue
        chunk = generate_result(h, views[i], out, with_text)
        if batch:
            chunk["index"] = i
        yield sse(chunk)
    yield SSE_DONE


@router.post("/generate")
async def generate(request: Request, state: ServerDep):
    body = await parse_body(request, GenerateRequest)
    state.require_engine()
    check_logprob_fields(body)  # before tokenizing: a long prompt takes seconds
    tokenized = await state.off_loop(_generate_prompts, state, body)
    handles, batch = generate_items(state, body, tokenized)
    views = [TextView(state.tokenizer, h) for h in handles]
    with_text = body.return_text_in_logprobs
    if body.stream:
        return event_stream(generate_events(handles, views, batch, with_text))
    if (err := await finished_or_error(handles, request)) is not None:
        return err
    results = [generate_result(h, v, with_text=with_text)
               for h, v in zip(handles, views, strict=True)]
    return JSONResponse(results if batch else results[0])


# ---------------------------------------------------------------- health
@router.get("/health")
async def health(state: ServerDep) -> JSONResponse:
    if state.load_error:
        return error_response(503, f"engine failed to load: {state.load_error}")
    if not state.ready:
        return error_response(503, f"engine is loading: {state.load_progress.latest()}")
    if state.scheduler is None or not state.scheduler.alive:
        return error_response(503, "engine scheduler has stopped")
    if state.draining:
        return error_response(503, "draining (pdtopo drain): the router is to stop choosing "
                              "this server; requests still arriving are served")
    return JSONResponse({"status": "ok"})


@router.get("/health_generate")
async def health_generate(state: ServerDep) -> JSONResponse:
    """Generate one token from "hi" (P/D: locally, without a peer)."""
    state.require_engine()
    ids = state.tokenizer.encode("hi")
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    h = state.submit(Prepared(ids, sp), health_check=True)
    try:
        await asyncio.wait_for(collect([h], None), timeout=HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(503, "health generation timed out after 60 s")
    err = abort_error(h.final)
    if err is not None:
        return error_response(503, f"health generation failed: {err[1]}")
    return JSONResponse({"status": "ok", "output_ids": h.output_ids})


# ---------------------------------------------------------------- info
def server_info(state: ServerState) -> dict[str, Any]:
    """sglang's /get_server_info: model info, engine limits and the scheduler's stats."""
    eng = state.engine
    stats = state.scheduler.stats() if state.scheduler is not None else {}
    runner = getattr(state.scheduler, "runner", None)  # dtypes as served ("auto" resolved)
    total_pages = stats.get("total_pages")
    return {
        **state.model_info(),
        "version": "pdtopo-0.1.0",
        "role": state.ctx.role,
        "name": state.ctx.name,
        "load_balance_method": "round_robin",
        "page_size": eng.page_size,
        "context_length": eng.max_model_len,
        "max_running_requests": eng.max_running_requests,
        "max_prefill_tokens": eng.max_prefill_tokens,
        "max_total_num_tokens": (total_pages * eng.page_size) if total_pages else None,
        "dtype": runner.dtype.name if runner is not None else eng.dtype,
        "kv_dtype": runner.kv_dtype.name if runner is not None else eng.kv_dtype,
        "ready": state.ready,
        "internal_states": [stats],
    }


# plain `def` handlers: FastAPI runs them in its threadpool
@router.get("/server_info")
@router.get("/get_server_info")
def get_server_info(state: ServerDep) -> JSONResponse:
    return JSONResponse(server_info(state))


@router.get("/model_info")
@router.get("/get_model_info")
def get_model_info(state: ServerDep) -> JSONResponse:
    return JSONResponse(state.model_info())


@router.get("/v1/models")
async def models(state: ServerDep):
    return {"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": state.created,
        "owned_by": "pdtopo", "root": state.served_model_name,
        "max_model_len": state.engine.max_model_len}]}


@router.post("/flush_cache")
async def flush_cache(state: ServerDep) -> Response:
    """Empty the prefix cache of every page no request holds (docs/prefix-cache.md): requests in
    flight keep their pages, which join the cache when they finish. The body says what went."""
    scheduler = state.require_engine()
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(asyncio.wrap_future(f) for f in scheduler.flush_caches())), FLUSH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(503, f"the scheduler did not flush within {FLUSH_TIMEOUT_S:g} s")
    flushed = sum(r["flushed_pages"] for r in results)
    held = sum(r["tree_pages"] for r in results)
    if not any(r["prefix_cache"] for r in results):
        text = "Cache flushed (engine.prefix_cache is off: nothing to drop).\n"
    else:
        dropped = sum(r.get("flushed_host_pages", 0) for r in results)
        host = f", {dropped} host-tier pages dropped" if dropped else ""
        text = (f"Cache flushed: {flushed} pages freed{host}, {held} still held by requests "
                f"in flight.\n")
    return Response(text, media_type="text/plain")


@router.get("/get_load")
async def get_load(state: ServerDep):
    st = state.require_engine().stats()
    return [{"dp_rank": int(state.ctx.rank.get("dp_rank", 0)),
             "num_reqs": st["num_running"] + st["num_waiting"],
             "num_waiting_reqs": st["num_waiting"], "num_tokens": st["num_tokens"]}]


@router.get("/metrics")
async def metrics(state: ServerDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/pdtopo/state")
async def pdtopo_state(state: ServerDep):
    stats = state.scheduler.stats() if state.scheduler is not None else {}
    return {"ready": state.ready, "role": state.ctx.role, "name": state.ctx.name,
            "disaggregation_mode": DISAGG_MODE.get(state.ctx.role, state.ctx.role),
            "load_error": state.load_error, "draining": state.draining,
            "in_flight": in_flight(state), "http_in_flight": state.http_in_flight, **stats}
