"""From engine outputs to HTTP bodies: text assembly, waiting with disconnect checks, SSE.

`TextView` turns a request's output ids into the text a client may see: while generating it
holds back an incomplete UTF-8 tail (U+FFFD) and the last len(stop)-1 characters (they might
start a stop string), decoding only the newest ids (`IncrementalText`); at the end it trims
the matched stop token / stop string (sglang's default, unless `no_stop_trim`).
`collect(handles, request)` awaits every handle's final output,
checking for a disconnected client every DISCONNECT_CHECK_S seconds and aborting on it (pages are freed by the
scheduler). `merged_outputs(handles)` yields `(index, output)` from several handles as they
come (each handle's as `latest_outputs` gives them: a consumer that falls behind gets the newest
of its queued outputs, one event for them all), and aborts whatever is unfinished if the
consumer goes away (client disconnect cancels the streaming task). Both hand the response to
another D when they meet a `HandoffMarker` (movable.py). `sse(obj)` frames one Server-Sent
Event; `SSE_DONE` ends a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from starlette.requests import Request

from pdtopo.runtime.api.movable import HandoffMarker
from pdtopo.runtime.api.state import Handle
from pdtopo.runtime.engine.request import ReqOutput

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON (UTF-8, non-ASCII as is): orjson, about
    15x faster than the standard library's encoder at a stream event's size."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ClientDisconnected(Exception):
    pass


class IncrementalText:
    """`decode(ids)` of a request's growing output ids that decodes only the newest of them:
    the text of the ids up to the kept point is kept, and the ids from the point before it
    (`prefix`, so that a token's text comes out as inside the sequence: word-joining spaces)
    are decoded and diffed against that window's old part. The kept point moves only past
    text that does not end in U+FFFD (a split UTF-8 character). Ids that do not extend the
    kept ones, or a window whose text does not extend its old part's, are decoded whole."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the kept ids
        self.text = ""            # their text
        self.prefix = 0

    def decode(self, ids: list[int]) -> str:
        kept = len(self.ids)
        if len(ids) < kept or ids[:kept] != self.ids:
            return self.tokenizer.decode(ids)
        if len(ids) == kept:
            return self.text
        old = self.tokenizer.decode(self.ids[self.prefix:])
        window = self.tokenizer.decode(ids[self.prefix:])
        if window.startswith(old):
            text = self.text + window[len(old):]
        else:  # not prefix-stable here: decode it all (and keep that)
            text = window = self.tokenizer.decode(ids)
        if not window.endswith("\ufffd"):
            self.ids, self.text, self.prefix = list(ids), text, kept
        return text


class TextView:
    def __init__(self, tokenizer, handle: Handle):
        self.tokenizer = tokenizer
        self.sampling = handle.req.sampling
        self.holdback = max((len(s) for s in self.sampling.stop), default=1) - 1
        self.sent = ""
        self.streamed = IncrementalText(tokenizer)

    def visible(self, ids: list[int], final: ReqOutput | None) -> str:
        sp = self.sampling
        reason = (final.finish_reason or {}) if final is not None else {}
        matched = reason.get("matched")
        if (isinstance(matched, int) and not sp.no_stop_trim and ids and ids[-1] == matched):
            ids = ids[:-1]
        # while streaming only the newest ids are decoded; the final text is decoded whole
        text = self.tokenizer.decode(ids) if final is not None else self.streamed.decode(ids)
        if final is not None:
            if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
                text = text[:text.index(matched)]
            return text
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        if self.holdback:
            text = text[:max(0, len(text) - self.holdback)]
        return text

    def delta(self, ids: list[int], final: ReqOutput | None) -> str:
        """New visible text since the previous call."""
        text = self.visible(ids, final)
        if not text.startswith(self.sent):
            return ""  # decoding was not prefix-stable here (rare): never resend text
        out = text[len(self.sent):]
        self.sent = text
        return out


DISCONNECT_CHECK_S = 0.25


async def collect(handles: Sequence[Handle], request: Request | None) -> None:
    """Wait for every handle to finish; abort all if the client disconnects."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_CHECK_S
    try:
        for h in handles:
            while h.final is None:
                try:
                    out = await h.next(timeout=DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    out = None
                while out is not None:  # and every output queued by now, without a wait
                    if isinstance(out, HandoffMarker):  # nothing was written yet
                        await out.perform(streamed=False)
                        raise ClientDisconnected()      # the target answers it now
                    out = None if h.final is not None else h.next_nowait()
                # Check on a clock, not only when outputs pause: a request that keeps
                # generating must still notice that its client went away.
                if request is not None and loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        raise ClientDisconnected()
    finally:
        for h in handles:
            h.abort()  # no-op for finished handles


async def latest_outputs(h: Handle) -> AsyncIterator[ReqOutput]:
    """One handle's outputs as its consumer can keep up with them: when several are queued by
    the time it asks, it gets the newest and the superseded ones are skipped (every event is
    built from the handle's cumulative state: `h.output_ids`, counters of what was sent), so
    a consumer that falls behind the scheduler writes one event per wake-up, not one per
    token. Never skipped: the first output (a resumed response's, which holds what the client
    already has, resume_context.py), a final one, a `HandoffMarker` (what came before it is
    yielded first)."""
    first = True
    while h.final is None:
        out = await h.next()
        while not first and not out.finished and not isinstance(out, HandoffMarker):
            nxt = h.next_nowait()
            if nxt is None:
                break
            if isinstance(nxt, HandoffMarker):
                yield out
                out = nxt
                break
            out = nxt
        first = False
        yield out
        if isinstance(out, HandoffMarker):
            return


async def merged_outputs(handles: Sequence[Handle]) -> AsyncIterator[tuple[int, ReqOutput]]:
    """Outputs of several handles in arrival order (each as `latest_outputs` gives them).
    Unfinished handles are aborted when the consumer stops early (client disconnect -> task
    cancelled -> this generator closed)."""
    try:
        if len(handles) == 1:  # the common case: no pump task, no second queue
            async for out in latest_outputs(handles[0]):
                await _consume(handles[0], out)
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, ReqOutput]] = asyncio.Queue()

        async def pump(i: int, h: Handle) -> None:
            async for out in latest_outputs(h):
                queue.put_nowait((i, out))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        try:
            remaining = len(handles)
            while remaining:
                i, out = await queue.get()
                remaining -= bool(out.finished)
                await _consume(handles[i], out)
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for h in handles:
            h.abort()


async def _consume(h: Handle, out: ReqOutput) -> None:
    """`out` becomes what `h`'s events are built from; a `HandoffMarker` hands the response
    away instead (every earlier event is written by now) and waits to be cancelled with the
    connection."""
    if isinstance(out, HandoffMarker):
        await out.perform(streamed=True)
        await asyncio.Event().wait()
    h.last_out = out


def abort_error(final: ReqOutput) -> tuple[int, str] | None:
    """(HTTP status, message) if the request ended in an abort, else None."""
    reason = final.finish_reason or {}
    if reason.get("type") != "abort":
        return None
    return int(reason.get("status_code") or 500), str(reason.get("message", "aborted"))


def openai_finish_reason(final: ReqOutput | None) -> str | None:
    if final is None:
        return None
    t = (final.finish_reason or {}).get("type")
    return {"length": "length", "stop": "stop"}.get(t, t)
