"""Moving a D's running requests, connections and all, to other D instances (issue 50).

    POST /pdtopo/migrate_out  {"targets": [{"url": "http://host:port"}, ...]}   (on the source)
        every response here that may move (movable.py: one request, still running) is moved
        at once, each to the targets in turn (request k starts at target k mod n): the
        scheduler exports it (disagg/migration.py), the offer and the response's description
        go to the target's migrate_in; once the KV is there, the client's connection follows
        (HandoffMarker). A target that refuses (no room, an incompatible pool) or fails: the
        next one; none: the request stays and completes here. Answers what moved where.
    POST /pdtopo/migrate_in   {"offer": MigrationOffer, "response": {...}}    (on the target)
        validates the offer (a 400 names what is wrong), keeps a ResumeTicket for the
        connection to come (resume.py) and passes the offer to the scheduler: 202 with
        "mode": "kv" (the KV is pulled from the source) or "replay" (recomputed here: the
        source's page size or KV dtype differs, or `disaggregation.migration=replay`; the
        source then drops the request without a pull).

Both need the deployment token (`Authorization: Bearer`), like /pdtopo/drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from pdtopo.runtime.api.drain_routes import token_problem
from pdtopo.runtime.api.errors import error_response
from pdtopo.runtime.api.handoff import handoff_address
from pdtopo.runtime.api.movable import HandoffMarker, MovableResponse
from pdtopo.runtime.api.resume import expire
from pdtopo.runtime.api.resume_context import ResumeTicket
from pdtopo.runtime.api.routing import ServerDep
from pdtopo.runtime.api.state import ServerState
from pdtopo.runtime.disagg.transport.messages import MessageError, MigrationOffer
from pdtopo.runtime.engine.request import AsyncSink, NullSink, Req, ReqOutput, SamplingParams

router = APIRouter()
log = logging.getLogger("pdtopo.migration_routes")

OFFER_TIMEOUT_S = 5.0
HANDOFF_TIMEOUT_S = 15.0
TICKET_SLACK_S = 10.0    # a ticket waits kv_timeout_s + this for its connection


def _migrating(state: ServerState) -> JSONResponse | None:
    if not state.ctx.settings.disaggregation.migration or state.ctx.role != "decode":
        return error_response(409, f"{state.ctx.name} is a {state.ctx.role} server without "
                              "disaggregation.migration=true: it moves no requests")
    state.require_engine()
    return None


def _targets(body: Any) -> list[dict[str, Any]]:
    targets = body.get("targets") if isinstance(body, dict) else None
    if not isinstance(targets, list) or not targets:
        raise ValueError("targets: expected a non-empty list of {\"url\": \"http://host:port\"}")
    out = []
    for i, t in enumerate(targets):
        url = t.get("url") if isinstance(t, dict) else None
        port = httpx.URL(url).port if isinstance(url, str) and url.startswith("http") else None
        if port is None:
            raise ValueError(f"targets[{i}]: expected {{\"url\": \"http://host:port\"}}, "
                             f"got {t!r}"[:300])
        out.append({"url": url.rstrip("/"), "port": port})
    return out


@router.post("/pdtopo/migrate_out")
async def migrate_out(state: ServerDep, body: dict[str, Any] | None = None,
                      authorization: str | None = Header(None)) -> JSONResponse:
    problem = token_problem(state, authorization) or _migrating(state)
    if problem is not None:
        return problem
    try:
        targets = _targets(body)
    except ValueError as exc:
        return error_response(400, str(exc))
    t0 = time.monotonic()
    recs = list({id(r): r for r in state.movable.values()
                 if r.single() is not None and r.single().final is None}.values())
    results = await asyncio.gather(*(_move_one(state, rec, targets, k)
                                     for k, rec in enumerate(recs)))
    moved = sum(r["moved"] for r in results)
    return JSONResponse({"moved": moved, "kept": len(results) - moved,
                         "seconds": round(time.monotonic() - t0, 3), "requests": results})


async def _move_one(state: ServerState, rec: MovableResponse, targets: list[dict[str, Any]],
                    k: int) -> dict[str, Any]:
    h = rec.single()
    assert h is not None
    loop = asyncio.get_running_loop()
    reasons = []
    for j in range(len(targets)):
        target = targets[(k + j) % len(targets)]

        def offer_to(offer: MigrationOffer, _sink: Any, target=target) -> None:
            # the scheduler thread: the call to the target runs on the event loop
            asyncio.run_coroutine_threadsafe(_post_offer(state, target, offer, rec), loop)

        t0 = time.monotonic()
        result = await asyncio.wrap_future(state.scheduler.migrate(h.rid, offer_to))
        log.debug("%s: moved %s after %.3f s (%s)", h.rid, result["moved"],
                 time.monotonic() - t0, result["reason"])
        if result["moved"]:
            done: asyncio.Future = loop.create_future()
            h.sink.queue.put_nowait(HandoffMarker(rec, handoff_address(target["port"]), done))
            try:
                err = await asyncio.wait_for(done, HANDOFF_TIMEOUT_S)
            except asyncio.TimeoutError:
                err = "the response's connection was not handed over (the client left?)"
            return {"rid": h.rid, "moved": True, "to": target["url"], "connection": err or "ok"}
        reasons.append(f"{target['url']}: {result['reason']}")
        if "not a running request" in result["reason"]:
            break
    return {"rid": h.rid, "moved": False, "reasons": reasons}


async def _post_offer(state: ServerState, target: dict[str, Any], offer: MigrationOffer,
                      rec: MovableResponse) -> None:
    try:
        async with httpx.AsyncClient(timeout=OFFER_TIMEOUT_S) as client:
            r = await client.post(f"{target['url']}/pdtopo/migrate_in",
                                  json={"offer": offer.to_dict(), "response": rec.describe(),
                                        "layout": kv_layout(state)},
                                  headers={"Authorization": f"Bearer {state.ctx.token}"})
        if r.status_code != 202:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        mode = r.json().get("mode")
    except Exception as exc:  # the request stays here
        state.scheduler.cancel_migration(offer.rid, f"{target['url']} did not take the "
                                         f"offer: {exc}")
        return
    if mode == "replay":  # recomputed there: nothing to pull from here
        state.scheduler.migration_replayed(offer.rid)


def kv_layout(state: ServerState) -> dict[str, Any]:
    """What decides whether a request's KV can move between two Ds as it is."""
    return {"page_size": int(state.runner.page_size), "kv_dtype": str(state.runner.kv_dtype),
            "replay": state.ctx.settings.disaggregation.migration == "replay"}


def replay_reason(state: ServerState, source: Any) -> str | None:
    """Why a moved request is recomputed here rather than pulled (None: its KV comes)."""
    if not isinstance(source, dict):
        return "the source sent no KV layout"
    mine = kv_layout(state)
    if source.get("replay") or mine["replay"]:
        return "disaggregation.migration=replay"
    diff = [f"{k}: source {source.get(k)!r}, here {mine[k]!r}" for k in ("page_size", "kv_dtype")
            if source.get(k) != mine[k]]
    return "; ".join(diff) or None


@router.post("/pdtopo/migrate_in")
async def migrate_in(request: Request, state: ServerDep,
                     authorization: str | None = Header(None)) -> JSONResponse:
    problem = token_problem(state, authorization) or _migrating(state)
    if problem is not None:
        return problem
    if state.draining:
        return error_response(503, f"{state.ctx.name} is draining: it takes no moved requests")
    try:
        d = await request.json()
        offer = MigrationOffer.from_dict(d.get("offer") if isinstance(d, dict) else None)
        response = d.get("response")
        if not isinstance(response, dict) or not isinstance(response.get("scope"), dict) \
                or not isinstance(response["scope"].get("path"), str):
            raise MessageError("response: expected {\"scope\": {\"path\": ...}, \"body\": ...}")
    except (ValueError, MessageError) as exc:
        return error_response(400, f"migrate_in: {exc}")
    if offer.rid in state.resuming:
        return error_response(409, f"request {offer.rid!r} is already moving here")
    sampling = SamplingParams(**offer.sampling)
    req = Req(rid=offer.rid, prompt_ids=list(offer.prompt_ids), sampling=sampling,
              sink=NullSink(), output_ids=list(offer.output_ids))
    sink = AsyncSink()
    prefix = ReqOutput(rid=offer.rid, new_token_ids=list(offer.output_ids),
                       num_output_tokens=len(offer.output_ids),
                       prompt_tokens=len(offer.prompt_ids), cached_tokens=offer.cached_tokens,
                       new_logprobs=None if offer.output_logprobs is None
                       else list(offer.output_logprobs))
    sink.queue.put_nowait(prefix)
    ticket = ResumeTicket(req, sink, prefix, response)
    state.resuming[offer.rid] = ticket
    ttl = state.ctx.settings.disaggregation.kv_timeout_s + TICKET_SLACK_S
    asyncio.get_running_loop().call_later(ttl, expire, state, offer.rid, ticket)
    replay = replay_reason(state, d.get("layout"))
    if replay is None:
        state.scheduler.accept_migration(offer, sink)
    else:
        log.info("%s: recomputed here (%s)", offer.rid, replay)
        state.scheduler.accept_replay(offer, sink)
    return JSONResponse({"accepted": offer.rid, "mode": "kv" if replay is None else "replay",
                         **({"why": replay} if replay else {})}, status_code=202)
