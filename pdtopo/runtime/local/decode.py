"""Decode engine of a local-disaggregation process: `LocalDecodeMixin` (+ `LocalEngineMixin`).

The engine is the ordinary scheduler on one decode mesh; its thread owns that mesh's pool.
It takes requests only from its bounded decode backlog (filled by the transfer thread, which
wakes it with a KV_READY inbox message). Each step, before the engine's own scheduling:

    admit            -> head of the backlog (held while it waits, FCFS): aborted by the client
                        meanwhile -> finish it; else, once the decode batch has room
                        (engine.max_running_requests) and the prompt's pages are free (one spare
                        page per running request, as in PD decode), allocate them, scatter the
                        packed KV into them with `insert_kv_chunks` (kernels.impl) and put the
                        request (first token already emitted by prefill) into the running batch
    decode (engine)  -> ordinary continuous batching, preemption and recompute included
    finish           -> the request leaves the process-wide RequestBoard and this engine's
                        DecodeLoad count
"""

from __future__ import annotations

import logging
import queue
from typing import Any

from pdtopo.kernels import insert_kv_chunks
from pdtopo.runtime.engine.request import FinishReason, Req
from pdtopo.runtime.local.board import DecodeLoad
from pdtopo.runtime.local.engine_mixin import LocalEngineMixin
from pdtopo.runtime.local.transfer import KV_READY, TransferItem

log = logging.getLogger("pdtopo.local.decode")


class LocalDecodeMixin(LocalEngineMixin):
    role = "decode"

    def __init__(self, *args: Any, index: int, backlog: queue.Queue, load: DecodeLoad,
                 kernels_impl: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index = index
        self.backlog = backlog
        self.load = load
        self.kernels_impl = kernels_impl
        self.held: TransferItem | None = None  # backlog head waiting for pages
        self._assigned: set[str] = set()       # rids counted in load for this engine
        self.num_admitted = 0
        self.num_waits = 0                     # backlog heads that had to wait for room
        self._held_waiting = False

    def make_prefix_cache(self, eng):
        """Decode engines keep no prefix cache: every prompt's KV comes from prefill."""
        return None

    def warmup_engine(self) -> None:
        """Decode batches only: the scheduler's warmup compiles a one-token step (and the
        sampler) at every batch size; prefill-sized steps (recompute after preemption) compile
        when first needed."""
        self.warmup()

    # ------------------------------------------------------------------ loop
    def step(self) -> None:
        self._admit()
        super().step()

    def has_work(self) -> bool:
        return self.held is not None or not self.backlog.empty() or super().has_work()

    def dispatch(self, msg: tuple[Any, Any]) -> None:
        if msg[0] == KV_READY:
            return  # a wake-up: the next step admits from the backlog
        super().dispatch(msg)

    def handle_new_request(self, req: Req) -> None:
        self.finish_request(req, FinishReason.abort(
            f"{self.engine_name} takes requests from the transfer thread only", 500))

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        while True:
            if self.held is None:
                try:
                    self.held = self.backlog.get_nowait()
                except queue.Empty:
                    return
            item = self.held
            req = item.req
            if self.board.is_aborted(req.rid):
                self.held, self._held_waiting = None, False
                self._take(req)
                self.finish_request(req, FinishReason.abort("aborted by client", 499))
                continue
            need = self.pages_for(item.prompt_len)
            if (len(self.running) >= self.max_running
                    or not self.ensure_free(need + len(self.running))):
                if not self._held_waiting:
                    self._held_waiting = True
                    self.num_waits += 1
                return  # FCFS: wait for a batch slot and pages
            self.held, self._held_waiting = None, False
            self._take(req)
            req.page_ids = self.alloc_pages(need)
            self.runner.kv_caches = insert_kv_chunks(self.runner.kv_caches, item.packed,
                                                     req.page_ids, impl=self.kernels_impl)
            req.num_computed = item.prompt_len
            self.num_admitted += 1
            self.add_to_running(req)

    def _take(self, req: Req) -> None:
        """This engine now owns `req` (and must release its DecodeLoad count at the end)."""
        self.reqs[req.rid] = req
        self._assigned.add(req.rid)

    def finish_request(self, req: Req, reason: dict[str, Any]) -> None:
        super().finish_request(req, reason)
        if req.rid in self._assigned:
            self._assigned.discard(req.rid)
            self.load.release(self.index)

    def local_state(self) -> dict[str, Any]:
        return {"backlog": self.backlog.qsize(), "backlog_capacity": self.backlog.maxsize,
                "held": self.held is not None, "admitted": self.num_admitted,
                "waits": self.num_waits}
