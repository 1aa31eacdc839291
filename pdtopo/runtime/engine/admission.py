"""Requests into the scheduler: the thread-safe inbox, the checks a request must pass, its
registration and the waiting queue, refusals and aborts (`AdmissionMixin`, mixed into the
`Scheduler` like overlap.py).

Data flow. Other threads (HTTP handlers, local mode's orchestrator) only put messages into
`inbox`: `submit(req)` -> ("new", req), `abort(rid)` -> ("abort", (rid, only)),
`flush_cache()` -> ("flush_cache", future), `Scheduler.stop()` -> (STOP, None). The scheduler
thread takes them each step (`drain_inbox`) or while idle (`idle_wait`) and `dispatch`es them:

    ("new", req)     -> handle_new_request(req): reject_if_invalid (400: never fits, or its rid
                        is live) -> register_request (seed settled, indexed in `reqs`) ->
                        appended to `waiting`, where the scheduler's schedule_prefill finds it
    ("abort", ...)   -> handle_abort: the live request with that rid finishes with a 499
    ("flush_cache")  -> the prefix cache emptied (kv_pages.py), the answer in the future

State it holds on the scheduler: `inbox`, `waiting` (FIFO of admitted requests whose prompt is
not yet computed), `reqs` (every live request by rid) and the seed generator of requests that
name no seed. P/D mixins override `handle_new_request`, `dispatch`, `idle_wait`, `check_fits`
and `refuse_request`, and reuse `reject_if_invalid` and `register_request`.
"""

from __future__ import annotations

import logging
import queue
import random
from collections import deque
from concurrent.futures import Future
from typing import Any

from pdtopo.runtime.engine.request import FinishReason, Req, ReqStatus

log = logging.getLogger("pdtopo.scheduler")

STOP = object()  # the inbox message that ends the loop (Scheduler.stop)


class AdmissionMixin:
    """The inbox and admission; the Scheduler provides the rest (`pages`, `finish_request`,
    `emit`, ...)."""

    def init_admission(self, base_seed: int) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Req] = deque()
        self.reqs: dict[str, Req] = {}
        self._seed_rng = random.Random(base_seed)

    # ------------------------------------------------------------------ thread-safe API
    def submit(self, req: Req) -> None:
        """Hand a validated request to the scheduler thread."""
        self.inbox.put(("new", req))

    def abort(self, rid: str, only: Req | None = None) -> None:
        """Abort a request (client gone); its pages are freed on the scheduler thread.
        `only`: abort the live request with this rid only if it is that object (the HTTP layer
        passes its own request, so a refused duplicate's client cannot abort the original)."""
        self.inbox.put(("abort", (rid, only)))

    def flush_cache(self) -> Future:
        """Thread-safe: empty the prefix cache of every page no request holds (on the scheduler
        thread); the future's result says what was freed and what is still held."""
        fut: Future = Future()
        self.inbox.put(("flush_cache", fut))
        return fut

    def flush_caches(self) -> list[Future]:
        """The futures of every engine this object schedules (one here; see local mode)."""
        return [self.flush_cache()]

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a request can never be served (None if it can). Reads constants only."""
        if prompt_len <= 0:
            return "the prompt is empty"
        total = prompt_len + max_new_tokens
        if total > self.max_model_len:
            return (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                    f"exceeds the context length engine.max_model_len={self.max_model_len}")
        pages = self.pages_for(total)
        if pages > self.allocator.num_total:
            return (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs "
                    f"{pages} KV pages, the pool has {self.allocator.num_total}")
        return None

    # ------------------------------------------------------------------ the inbox
    def idle_wait(self, timeout: float | None = None) -> None:
        """Block until a message arrives (or `timeout`), and handle it."""
        if timeout is None:
            timeout = 0.005 if self.has_work() else 0.1
        try:
            msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        self.dispatch(msg)

    def drain_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.dispatch(msg)

    def dispatch(self, msg: tuple[Any, Any]) -> None:
        kind, payload = msg
        if kind == "new":
            self.handle_new_request(payload)
        elif kind == "abort":
            self.handle_abort(*payload)
        elif kind == "flush_cache":
            if payload.set_running_or_notify_cancel():
                payload.set_result(self._flush_cache())
        elif kind is STOP:
            self._stop.set()
        else:
            raise ValueError(f"unknown scheduler message {kind!r}")

    def _flush_cache(self) -> dict[str, Any]:
        return self.pages.flush(len(self.reqs))

    # ------------------------------------------------------------------ requests
    def handle_new_request(self, req: Req) -> None:
        if self.reject_if_invalid(req):
            return
        self.register_request(req)
        self.waiting.append(req)

    def reject_if_invalid(self, req: Req) -> bool:
        """Refuse `req` with a 400 if it can never be served or reuses a live rid; the live
        request with that rid is left untouched (`refuse_request`)."""
        err = self.check_fits(len(req.prompt_ids), req.sampling.max_new_tokens)
        if err is not None:
            self.refuse_request(req, FinishReason.abort(err, 400))
        elif req.rid in self.reqs:
            self.refuse_request(req, FinishReason.duplicate(req.rid))
        return req.finished

    def refuse_request(self, req: Req, reason: dict[str, Any]) -> None:
        """End a request this scheduler never admitted: its final output goes to its own sink
        and nothing keyed by its rid is touched (a live request may carry the same rid). Its
        pages, if a mixin gave it some before refusing, go back to the pool."""
        req.finish_reason = reason
        self.release_kv(req, keep=False)
        req.status = ReqStatus.FINISHED
        self.emit(req)
        self.metrics.request_finished(reason.get("type", "unknown"))

    def register_request(self, req: Req) -> None:
        """Own an admitted request: settle its seed, mark it waiting, index it by rid."""
        if req.sampling.seed is None:
            req.sampling.seed = self.default_seed(req)
        req.status = ReqStatus.WAITING
        self.reqs[req.rid] = req

    def default_seed(self, req: Req) -> int:
        """Seed of a request that gave none: from the PD room when present (P and D agree)."""
        if req.bootstrap_room is not None:
            return (self.base_seed * 0x9E3779B97F4A7C15 + int(req.bootstrap_room)) % 2**63
        return self._seed_rng.getrandbits(63)

    def handle_abort(self, rid: str, only: Req | None = None) -> None:
        req = self.reqs.get(rid)
        if only is not None and req is not only:
            return  # the request that asked is not the live one (a refused duplicate)
        if req is not None and not req.finished:
            log.info("aborting %s", req)
            self.finish_request(req, FinishReason.abort("aborted by client", 499))
