"""Decode (D) side of PD serving: `SchedulerDisaggregationDecodeMixin` (docs/protocol.md#one-request-step-by-step).

A request reaching D carries `bootstrap_host:bootstrap_port` (the P instance's side channel)
and `bootstrap_room`. Per request, on the scheduler thread, never blocking:

    handle_new_request -> validate like any request (a refused request fails the room at P
                          too); with D's own prefix cache (decode_prefix_cache) hold the
                          prompt's cached pages; create a KV receiver (sends `want` to P at
                          once, with the count and hash of those pages) and queue the request
                          for preallocation
    prealloc queue     -> once the peer directory has checked P's registration against ours
                          (page size, dtype, model, KV layout) and pages for the rest of the
                          prompt's KV are free, give them to the receiver (`init`) -> transfer
                          queue
    transfer queue     -> `receiver.poll()`: on P's `ready` the pull runs on the engine's
                          pull_executor; when it completes, poll() scatters the packed pages into
                          the pool (this thread owns it) and tells P `done` -> ready queue
    ready queue        -> as soon as the decode batch has room (engine.max_running_requests)
                          the request joins it with P's first token as output 0. Transfers do
                          not wait for decode slots, so a slow decode batch never makes KV
                          time out; they only wait for pages.
    failure            -> P's `failed`, a pull error or no KV within kv_timeout_s: the request
                          ends with a clear error and its pages go back to the pool.
    health check       -> `/health_generate` (req.extra["health_check"]) prefills locally like a
                          colocated server: it proves this engine works without needing a P.

Decoding itself is the engine's ordinary continuous batching (pages grow as tokens come).
A running request can move to another D, KV and all (migration.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pdtopo.runtime.disagg.migration import MigrationMixin
from pdtopo.runtime.disagg.mixin_base import PENDING_POLL_S, DisaggregationMixinBase
from pdtopo.runtime.disagg.observability import decode_timeline
from pdtopo.runtime.disagg.transport.base import KVTransferError
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll
from pdtopo.runtime.disagg.transport.messages import prefix_digest
from pdtopo.runtime.disagg.transport.peers import PeerDirectory
from pdtopo.runtime.engine.request import (
    FinishReason,
    InvalidRequest,
    Req,
    check_bootstrap_fields,
)

log = logging.getLogger("pdtopo.disagg.decode")


@dataclass
class PendingTransfer:
    req: Req
    receiver: Any
    peer_addr: str


class SchedulerDisaggregationDecodeMixin(MigrationMixin, DisaggregationMixinBase):
    role = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_disaggregation()
        lookup = self.bootstrap.find_prefill if self.bootstrap is not None else None
        channel = self.kv_manager.channel  # its resolver and bound serve the peer checks too
        self.peers = PeerDirectory(lookup, self.registration_info,
                                   on_lookup=self.pd_metrics.lookup_seconds.observe,
                                   resolver=channel.resolver, max_entries=4 * channel.max_peers,
                                   max_pending=channel.max_peers)
        self.prealloc_queue: deque[PendingTransfer] = deque()
        self.transfer_queue: list[PendingTransfer] = []
        self.ready_queue: deque[PendingTransfer] = deque()  # KV in the pool, awaiting a slot
        self._pending: dict[str, PendingTransfer] = {}
        self.num_pulled_pages = 0
        self.num_pulled_bytes = 0
        self.num_decode_cached_pages = 0   # prompt pages D's own prefix cache held (not pulled)
        self._init_migration()

    def make_prefix_cache(self, eng):
        """D keeps no prefix cache by default (the RFC's chunk cache: every prompt's KV comes
        from P); `disaggregation.decode_prefix_cache` turns D's own cache on."""
        if not self.ctx.settings.disaggregation.decode_prefix_cache:
            return None
        return super().make_prefix_cache(eng)

    def warmup(self) -> None:
        """The sampler (Scheduler.warmup), then the KV scatter for every page count (with
        migration on, the gather too)."""
        super().warmup()
        pages = self.runner.max_pages_per_seq
        if not self.ctx.settings.disaggregation.migration:
            self.kv_manager.warmup_kernels("decode", pages, self.peer_layouts("prefill"))
            return
        # a D that migrates also gathers (and cuts) its pages for the other D instances, and
        # scatters what they send it (migration.py)
        others = self.peer_layouts("decode")
        self.kv_manager.warmup_kernels("decode", pages, [*self.peer_layouts("prefill"), *others])
        self.kv_manager.warmup_kernels("prefill", pages, others)

    # ------------------------------------------------------------------ loop
    def step(self) -> None:
        if self._outgoing:
            self._poll_outgoing()
        if self._pending:
            self._process_prealloc_queue()
            self._process_transfer_queue()
            self._process_ready_queue()
        super().step()

    def has_work(self) -> bool:
        return bool(self._pending or self._outgoing) or super().has_work()

    def idle_wait(self, timeout: float | None = None) -> None:
        if timeout is None and (self._pending or self._outgoing):
            timeout = PENDING_POLL_S
        super().idle_wait(timeout)

    # ------------------------------------------------------------------ requests
    def handle_new_request(self, req: Req) -> None:
        if req.extra.get("health_check"):
            super().handle_new_request(req)  # /health_generate: local prefill + decode, no P
            return
        if req.bootstrap_room is None or req.bootstrap_host is None or req.bootstrap_port is None:
            self.refuse_request(req, FinishReason.abort(
                "this is a decode server: requests need bootstrap_host, bootstrap_port and "
                "bootstrap_room (send them through the PD proxy)", 400))
            return
        try:  # checked at the HTTP layer; a Req built elsewhere is checked here, before any socket
            check_bootstrap_fields(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
        except InvalidRequest as exc:
            self.refuse_request(req, FinishReason.abort(exc.message, 400))
            return
        addr = f"{req.bootstrap_host}:{int(req.bootstrap_port)}"
        if self.reject_if_invalid(req):  # a live request with its rid keeps its transfer
            self._tell_prefill(req, addr)
            return
        held, digest = self._match_decode_prefix(req)
        try:
            receiver = self.kv_manager.create_receiver(int(req.bootstrap_room), addr,
                                                       cached_pages=held, prefix_hash=digest)
        except (KVTransferError, ValueError) as exc:
            self.refuse_request(req, FinishReason.abort(f"bootstrap fields: {exc}", 400))
            return
        self.register_request(req)
        pending = PendingTransfer(req, receiver, addr)
        self._pending[req.rid] = pending
        self.prealloc_queue.append(pending)

    def queue_transfer(self, req: Req, receiver: Any, addr: str) -> None:
        """A request whose pages are allocated and given to `receiver` (a migration's):
        straight into the transfer queue."""
        pending = PendingTransfer(req, receiver, addr)
        self._pending[req.rid] = pending
        self.transfer_queue.append(pending)

    def _tell_prefill(self, req: Req, addr: str) -> None:
        """D refused the request before asking for its KV: fail the room at P too, so P stops
        (or never starts) prefilling it and frees what it holds at once."""
        reason = req.finish_reason or {}
        try:
            self.kv_manager.refuse_room(int(req.bootstrap_room), addr,
                                        f"D refused the request: {reason.get('message')}",
                                        reason.get("status_code", 400))
        except (KVTransferError, ValueError) as exc:
            log.warning("room %s: could not tell P at %s: %s", req.bootstrap_room, addr, exc)

    def _match_decode_prefix(self, req: Req) -> tuple[int, str | None]:
        """With D's own prefix cache: hold the prompt's longest cached prefix (full pages, never
        the last token's page) and say so in `want`, so that P sends only the rest."""
        if self.prefix_cache is None:
            return 0, None
        req.page_ids = self.prefix_cache.match(req.prompt_ids,
                                               (len(req.prompt_ids) - 1) // self.page_size)
        held = len(req.page_ids)
        if held:
            self.num_decode_cached_pages += held
        return held, prefix_digest(req.prompt_ids, held, self.page_size) if held else None

    def _process_prealloc_queue(self) -> None:
        for p in list(self.prealloc_queue):
            if p.receiver.poll() == KVPoll.Failed:
                self._fail(p, p.receiver.failure_exception())
                continue
            status, detail = self.peers.status(p.peer_addr)
            if status == "pending":
                continue
            if status == "error":
                p.receiver.abort(detail, status=500)
                self._fail(p, KVTransferError(detail, status=500))
                continue
            need = self.pages_for(len(p.req.prompt_ids)) - len(p.req.page_ids)
            will_decode = len(self.running) + len(self.transfer_queue) + len(self.ready_queue)
            if not self.ensure_free(need + will_decode):
                break  # FCFS: wait for pages (one spare page per request that will decode)
            pulled_into = self.alloc_pages(need)
            p.req.page_ids.extend(pulled_into)  # after the cached pages D holds, if any
            p.receiver.init(pulled_into)
            self.prealloc_queue.remove(p)
            self.transfer_queue.append(p)

    def _process_transfer_queue(self) -> None:
        for p in list(self.transfer_queue):
            state = p.receiver.poll()
            if state == KVPoll.Success:
                self.transfer_queue.remove(p)
                self.ready_queue.append(p)
                self.num_pulled_pages += p.receiver.pulled_pages
                self.num_pulled_bytes += p.receiver.pulled_bytes
                self._observe_transfer(p.receiver)
            elif state == KVPoll.Failed:
                self._fail(p, p.receiver.failure_exception())

    def _observe_transfer(self, receiver: Any) -> None:
        m, t = self.pd_metrics, receiver.times
        m.transfer_bytes.inc(receiver.pulled_bytes)
        m.transfer_pages.inc(receiver.pulled_pages)
        if "pull_start" in t:
            both_there = max(t.get("ready", t["pull_start"]), t.get("pages", t["pull_start"]))
            m.pull_queue_seconds.observe(max(0.0, t["pull_start"] - both_there))
            if "pull_end" in t:
                m.transfer_seconds.observe(max(0.0, t["pull_end"] - t["pull_start"]))

    def _process_ready_queue(self) -> None:
        # a request moving away keeps its decode row until it is gone (it may come back)
        while self.ready_queue and len(self.running) + len(self._outgoing) < self.max_running:
            p = self.ready_queue.popleft()
            self._pending.pop(p.req.rid, None)
            self._start_decoding(p)

    def _start_decoding(self, p: PendingTransfer) -> None:
        req, info = p.req, p.receiver.ready_info
        if "migrated_in" in req.extra:
            self._start_migrated(req, info)
            return
        if info.first_token is None or info.prompt_len != len(req.prompt_ids):
            self.finish_request(req, FinishReason.abort(
                f"P's KV does not match this request: P prefilled {info.prompt_len} tokens "
                f"(first token {info.first_token}), D has a {len(req.prompt_ids)}-token prompt",
                500))
            return
        req.num_computed = len(req.prompt_ids)
        req.cached_tokens = int(info.cached_tokens)  # P's prefix-cache hit, reported by D
        now = time.monotonic()
        ready_at = p.receiver.times.get("ready")
        if ready_at is not None:
            self.pd_metrics.handoff_seconds.observe(max(0.0, now - ready_at))
        req.timeline = decode_timeline(req.arrival_time, p.receiver.times, info.p_stages, now)
        if not self.process_new_token(req, int(info.first_token), info.first_token_logprob):
            self.add_to_running(req)

    def _fail(self, p: PendingTransfer, exc: BaseException | None) -> None:
        status = getattr(exc, "status", None) or 502
        self.pd_metrics.failed(status)
        self.finish_request(p.req, FinishReason.abort(f"KV transfer failed: {exc}", status))

    def finish_request(self, req: Req, reason: dict[str, Any]) -> None:
        if self._outgoing:
            self._end_outgoing(req, reason)
        p = self._pending.get(req.rid)
        if p is not None and p.req is req:  # never the transfer of a live duplicate's rid
            del self._pending[req.rid]
            if p in self.prealloc_queue:
                self.prealloc_queue.remove(p)
            if p in self.transfer_queue:
                self.transfer_queue.remove(p)
            if p in self.ready_queue:
                self.ready_queue.remove(p)
            if not p.receiver.poll().terminal:
                p.receiver.abort(reason.get("message", "decode request ended"),
                                 status=reason.get("status_code", 500))
        super().finish_request(req, reason)

    def pd_state(self) -> dict[str, Any]:
        self.pd_metrics.rooms_in_flight.set(len(self._pending))
        stats = self.kv_manager.channel.stats()
        return {**super().pd_state(),
                "pd_prealloc": len(self.prealloc_queue), "pd_transfers": len(self.transfer_queue),
                "pd_ready": len(self.ready_queue), "pd_pulled_pages": self.num_pulled_pages,
                "pd_pulled_bytes": self.num_pulled_bytes,
                "pd_decode_cached_pages": self.num_decode_cached_pages,
                "pd_side_channel_peers": stats.get("peers_open", 0),
                "pd_side_channel_peers_closed": stats.get("peers_closed", 0),
                "pd_side_channel_peers_refused": stats.get("peer_refused", 0),
                "pd_peer_cache": self.peers.cached(), **self.migration_state()}

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
        self.peers.close()
