"""Prefill (P) side of PD serving: `SchedulerDisaggregationPrefillMixin` (docs/protocol.md#one-request-step-by-step).

A request reaching P carries `bootstrap_room` (and host/port, which name this P). Per request:

    handle_new_request   -> create a KV sender for the room (D's `want` may already be waiting),
                            then the engine's normal admission into the waiting queue
    prefill (engine)     -> on_prefill_finished(req, first_token) (with
                            disaggregation.decode_prefix_cache: once D's `want` has said which
                            leading pages D holds; those are checked and skipped):
                            sender.send(prompt pages, prompt_len, first_token) gathers the pages
                            into packed copies, registers them for D's pull and sends `ready`;
                            the request then finishes at once with that one token (the router
                            reads P's whole answer before relaying D's stream), and its pool pages
                            are freed immediately because the packed arrays are copies
    every step           -> poll in-flight senders: done from D releases the packed copies;
                            D's failure or the expiry (`disaggregation.sender_expiry_s`) too
    held-KV budget       -> a waiting request starts its prefill only while the copies held
                            for D plus those of the admitted requests plus its own fit in
                            `disaggregation.max_held_kv_pages` (held_budget.py); one held
                            back longer than `held_kv_wait_s` fails with a retryable 503
    P-side failure       -> rejected, aborted or failed requests abort their sender, which tells
                            D over the side channel so D fails the request at once
    health check         -> `/health_generate` requests (req.extra["health_check"]) run as
                            ordinary local requests: no room, no sender

The in-flight senders are owned by the scheduler thread like everything else in the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdtopo.runtime.disagg.held_budget import HeldKVBudget
from pdtopo.runtime.disagg.mixin_base import PENDING_POLL_S, DisaggregationMixinBase
from pdtopo.runtime.disagg.transport.base import KVTransferError, wire_rows
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll
from pdtopo.runtime.disagg.transport.messages import first_logprob_fields, prefix_digest
from pdtopo.runtime.engine.request import FinishReason, Req, ReqStatus, TokenLogprob

log = logging.getLogger("pdtopo.disagg.prefill")


class SchedulerDisaggregationPrefillMixin(DisaggregationMixinBase):
    role = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_disaggregation()
        self.overlap = False  # P decodes nothing but local health checks: no steps to overlap
        self._senders: dict[str, Any] = {}     # rid -> sender, until the request finishes
        self._inflight: list[Any] = []         # senders whose KV awaits D's pull
        self.num_skipped_pages = 0             # prompt pages not sent: D's cache held them
        # wait for D's `want` before registering the KV (holding the pages meanwhile) when it
        # says something the registration depends on: which pages D's prefix cache holds, or
        # D's KV layout where the plan has decode instances laid out unlike this one (their
        # pieces are cut for that layout, reshard/)
        self.decode_layouts = self.peer_layouts("decode")
        self.waits_for_decode_claim = bool(
            self.ctx.settings.disaggregation.decode_prefix_cache or self.decode_layouts)
        self._awaiting_want: dict[str, float] = {}  # rid -> deadline: prefilled, before want
        d = self.ctx.settings.disaggregation
        self.held_budget = HeldKVBudget(d.max_held_kv_pages, d.held_kv_wait_s)
        self.pd_metrics.max_held_kv_pages.set(self.held_budget.max_pages)

    def warmup(self) -> None:
        """The sampler (Scheduler.warmup: P's runner runs no decode layout, so its logits
        always have the flat layout's rows), then the KV gather for every bucket of page
        counts."""
        super().warmup()
        self.kv_manager.warmup_kernels("prefill", self.runner.max_pages_per_seq,
                                       self.decode_layouts)

    # ------------------------------------------------------------------ loop
    def step(self) -> None:
        self._poll_senders()
        if self._awaiting_want:
            self._poll_awaiting_want()
        if self.held_budget.blocked:
            self._fail_overdue_waits()
        super().step()

    def has_work(self) -> bool:
        return bool(self._inflight or self._awaiting_want) or super().has_work()

    def idle_wait(self, timeout: float | None = None) -> None:
        if timeout is None and (self._inflight or self._senders or self._awaiting_want):
            timeout = PENDING_POLL_S
        super().idle_wait(timeout)

    def _poll_senders(self) -> None:
        self.kv_manager.progress()  # once: the loops below read each room's resulting state
        still = []
        for sender in self._inflight:
            state = sender.last_state
            if state == KVPoll.Failed:
                log.warning("room %d: %s", sender.room, sender.failure_exception())
                self.pd_metrics.failed(getattr(sender.failure_exception(), "status", None))
            elif state == KVPoll.Success:
                self._observe_handoff(sender.times)
            else:
                still.append(sender)
        self._inflight = still
        for rid, sender in list(self._senders.items()):
            # D gave up on a room whose request P has not sent yet (client gone at D, D's
            # timeout or rejection): stop spending prefill on it
            if sender.ready_msg is None and sender.last_state == KVPoll.Failed:
                req = self.reqs.get(rid)
                if req is not None and not req.finished:
                    self._fail_request(req, sender)

    # ------------------------------------------------------------------ held-KV budget
    def held_kv_pages(self) -> int:
        """Pages of the packed copies announced for D's pull and not yet released (their
        rows: the KV pages and the padding to the wire's bucket, transport.base.wire_rows)."""
        return sum(s.ready_msg.pools[0].rows for s in self._inflight
                   if s.ready_msg is not None and not s.last_state.terminal)

    def held_pages_for(self, prompt_len: int) -> int:
        """The most pages the packed copy of a `prompt_len`-token prompt can hold."""
        return wire_rows(self.pages_for(prompt_len))

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> str | None:
        err = super().check_fits(prompt_len, max_new_tokens)
        if err is None:
            err = self.held_budget.prompt_problem(self.held_pages_for(prompt_len), prompt_len)
        return err

    def may_start(self, req: Req) -> bool:
        budget = self.held_budget
        # a health check makes no copy; an admitted request (a later chunk) holds its place:
        # only a new one sums the held pages (once per waiting request per step at most)
        if req.rid in self._senders and not budget.is_admitted(req.rid) and not budget.admits(
                req.rid, self.held_pages_for(len(req.prompt_ids)), self.held_kv_pages()):
            return False
        return super().may_start(req)

    def _budget_waiting(self) -> list[Req]:
        """The waiting requests that the budget holds back (none while it is not full)."""
        if not self.held_budget.blocked:
            return []
        return [r for r in self.waiting
                if r.rid in self._senders and not self.held_budget.is_admitted(r.rid)]

    def _fail_overdue_waits(self) -> None:
        """Fail the requests held back by the budget for `held_kv_wait_s` (503, retryable),
        unless the first of them fits now (the copies it waited for are gone)."""
        waiting = self._budget_waiting()
        held = self.held_kv_pages()
        if not waiting or self.held_budget.fits(self.held_pages_for(len(waiting[0].prompt_ids)),
                                                held):
            return
        now = time.monotonic()
        for req in waiting:
            if self.held_budget.overdue(req.arrival_time, now):
                message = self.held_budget.wait_error(held + self.held_budget.committed(),
                                                      now - req.arrival_time)
                log.warning("%s: %s", req.rid, message)
                self.pd_metrics.failed(503)
                self.finish_request(req, FinishReason.abort(message, 503))

    @staticmethod
    def _stages(req: Req, sender) -> dict[str, float]:
        """P's queue and prefill durations (seconds, this process's clock) for D's timeline."""
        start, done = req.prefill_start_time, sender.times.get("prefill_done")
        if start is None or done is None:
            return {}
        return {"queue": max(0.0, start - req.arrival_time), "prefill": max(0.0, done - start)}

    def _observe_handoff(self, t: dict[str, float]) -> None:
        if "ready_sent" not in t:
            return
        if "prefill_done" in t:
            self.pd_metrics.prefill_to_ready_seconds.observe(
                max(0.0, t["ready_sent"] - t["prefill_done"]))
        if "done" in t:
            self.pd_metrics.wait_for_pull_seconds.observe(max(0.0, t["done"] - t["ready_sent"]))

    def _fail_request(self, req: Req, sender) -> None:
        exc = sender.failure_exception()
        self.pd_metrics.failed(getattr(exc, "status", None))
        self.finish_request(req, FinishReason.abort(
            f"KV transfer failed: {exc}", getattr(exc, "status", None) or 502))

    # ------------------------------------------------------------------ requests
    def handle_new_request(self, req: Req) -> None:
        if req.extra.get("health_check"):
            super().handle_new_request(req)  # /health_generate: a local prefill, no sender
            return
        if req.bootstrap_room is None:
            self.refuse_request(req, FinishReason.abort(
                "this is a prefill server: requests need bootstrap_host, bootstrap_port and "
                "bootstrap_room (send them through the PD proxy)", 400))
            return
        if self.reject_if_invalid(req):  # never served, or a duplicate of a live rid: the
            # live request keeps its sender; the refused one's room fails at D too
            self._reject_room(int(req.bootstrap_room), req.finish_reason["message"], 400)
            return
        try:
            sender = self.kv_manager.create_sender(int(req.bootstrap_room))
        except (KVTransferError, ValueError) as exc:
            self.refuse_request(req, FinishReason.abort(f"bootstrap_room: {exc}", 400))
            return
        self._senders[req.rid] = sender
        self.register_request(req)
        self.waiting.append(req)

    def _reject_room(self, room: int, message: str, status: int) -> None:
        """The HTTP layer rejected this room's request: fail the room so that D (whose `want`
        may be waiting, or may come later and meet the tombstone) ends it with `status`."""
        try:
            sender = self.kv_manager.create_sender(room)
        except (KVTransferError, ValueError):
            return  # the room already has a sender: it reports its own outcome
        sender.abort(message, status=status)

    def on_prefill_finished(self, req: Req, next_token: int,
                            logprob: TokenLogprob | None = None) -> None:
        sender = self._senders.get(req.rid)
        if sender is None:  # a health check (no room): an ordinary local request
            super().on_prefill_finished(req, next_token, logprob)
            return
        req.output_ids.append(int(next_token))
        req.output_logprobs.append(logprob)  # D reports it (the ready message carries it)
        sender.times["prefill_done"] = time.monotonic()
        if self.waits_for_decode_claim and sender.peer is None:
            # D's `want` says which pages it holds or how it is laid out: wait for it (holding
            # the pages) rather than send pages D has or cut for the wrong layout; bounded by
            # kv_timeout_s
            req.status = ReqStatus.HELD
            self._awaiting_want[req.rid] = time.monotonic() + self.kv_manager.kv_timeout_s
            return
        self._send_kv(req, sender)

    def _poll_awaiting_want(self) -> None:
        now = time.monotonic()
        for rid, deadline in list(self._awaiting_want.items()):
            req, sender = self.reqs.get(rid), self._senders.get(rid)
            if req is None or sender is None:
                self._awaiting_want.pop(rid, None)
                continue
            if sender.last_state == KVPoll.Failed:  # _poll_senders ran progress() just before
                self._fail_request(req, sender)
            elif sender.peer is not None or now >= deadline:
                del self._awaiting_want[rid]
                self._send_kv(req, sender)

    def _send_kv(self, req: Req, sender) -> None:
        """Register the prompt's pages (those D lacks) for D's pull, announce them, and finish
        P's side of the request with its one token."""
        if sender.poll() == KVPoll.Failed:  # D gave up while P was prefilling
            self._fail_request(req, sender)
            return
        prompt_len = len(req.prompt_ids)
        skip = self._pages_decode_holds(req, sender)
        if skip is None:
            return
        sender.send(req.page_ids[skip: self.pages_for(prompt_len)], prompt_len=prompt_len,
                    first_token=int(req.output_ids[0]), cached_tokens=req.cached_tokens,
                    **first_logprob_fields(req.output_logprobs[0]),
                    skip_pages=skip, p_stages=self._stages(req, sender))
        if sender.poll() == KVPoll.Failed:
            exc = sender.failure_exception()
            status = getattr(exc, "status", None) or 500
            self.pd_metrics.failed(status)
            self.finish_request(req, FinishReason.abort(f"KV transfer setup failed: {exc}", status))
            return
        self.metrics.ttft.observe(max(0.0, time.monotonic() - req.arrival_time))
        self.finish_request(req, FinishReason.length(1))

    def _pages_decode_holds(self, req: Req, sender) -> int | None:
        """How many leading prompt pages D said it holds (its prefix cache; 0 without one),
        after checking the claim against this prompt's token ids. A claim that does not match
        (another prompt, another page size, too many pages) fails the room at once: P never
        sends a partial KV that D would complete with the wrong pages. None: failed."""
        k = sender.peer_cached_pages
        if not k:
            return 0
        prompt_len = len(req.prompt_ids)
        problem = None
        if k > (prompt_len - 1) // self.page_size:
            problem = (f"D claims {k} cached pages of a {prompt_len}-token prompt (at most "
                       f"{(prompt_len - 1) // self.page_size} full pages before the last token)")
        elif sender.peer_prefix_hash != prefix_digest(req.prompt_ids, k, self.page_size):
            problem = (f"D's {k} cached pages hold other tokens than this prompt's first "
                       f"{k * self.page_size} (prefix hash mismatch)")
        if problem is None:
            self.num_skipped_pages += k
            return k
        sender.abort(problem, status=500)
        self.pd_metrics.failed(500)
        self.finish_request(req, FinishReason.abort(f"KV transfer refused: {problem}", 500))
        return None

    def finish_request(self, req: Req, reason: dict[str, Any]) -> None:
        sender = None
        if self.reqs.get(req.rid) is req:  # its rid's sender, never a live duplicate's
            self._awaiting_want.pop(req.rid, None)
            sender = self._senders.pop(req.rid, None)
        if sender is not None:
            self.held_budget.settle(req.rid)  # its copy counts through the sender from now on
            if sender.ready_msg is None and not sender.poll().terminal:
                sender.abort(reason.get("message", "prefill failed"),
                             status=reason.get("status_code", 500))
            elif not sender.poll().terminal:
                self._inflight.append(sender)
        super().finish_request(req, reason)

    def pd_state(self) -> dict[str, Any]:
        self.pd_metrics.rooms_in_flight.set(len(self._senders) + len(self._inflight))
        held = {"pd_held_kv_pages": self.held_kv_pages(),
                "pd_held_kv_bytes": self.kv_manager.engine.registered_bytes(),
                "pd_held_kv_device_bytes": self.kv_manager.engine.registered_device_bytes(),
                "pd_max_held_kv_pages": self.held_budget.max_pages,
                "pd_held_kv_waiting": len(self._budget_waiting())}
        m = self.pd_metrics
        m.held_kv_pages.set(held["pd_held_kv_pages"])
        m.held_kv_bytes.set(held["pd_held_kv_bytes"])
        m.held_kv_device_bytes.set(held["pd_held_kv_device_bytes"])
        m.held_kv_waiting.set(held["pd_held_kv_waiting"])
        # pd_inflight_senders: rooms whose KV waits for D's pull, counted by the drain
        # (api/drain_routes.py `in_flight`): P must not stop while D may still pull
        return {**super().pd_state(), "pd_inflight_senders": len(self._inflight),
                "pd_registered_kv": self.kv_manager.num_registered(),
                "pd_skipped_pages": self.num_skipped_pages, **held}

