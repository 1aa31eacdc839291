"""Migration of a running decode from one D scheduler to another (issue 50, item 1).

D1 stops scheduling a running request at a step boundary and offers it to D2; D2 pulls its KV
through the transfer machinery a P->D handoff uses (resharded when D2's TP differs) and goes on
decoding it; D1 frees the pages once D2 says `done`. On the scheduler threads, never blocking:

    D1  migrate(rid, offer_to)      thread-safe: ("migrate_out", ...) into D1's inbox
        _migrate_out               at the step boundary (drain_inbox): the step in flight lands
                                   first (overlap.py dispatches ahead), the request leaves the
                                   decode batch (HELD, its pages and its decode row kept), a
                                   sender for a fresh room gathers its pages (the KV of every
                                   token but the newest, `num_computed`) like a prompt's and
                                   the offer (messages.MigrationOffer: ids, logprobs, sampling
                                   with the settled seed) goes to `offer_to`
    D2  accept_migration(offer, sink)  thread-safe: ("migrate_in", ...) into D2's inbox
        _migrate_in                no free decode row or pages, or a rid it already runs: the
                                   room is refused at D1 (want + failed), D1 takes the request
                                   back. Else a Req rebuilt from the offer (everything already
                                   emitted counted as emitted), pages allocated, a receiver
                                   (`want` to D1's side channel) in the decode mixin's transfer
                                   queue: the same pull, scatter and `done` as a P's prompt
                                   -> ready queue -> the decode batch with num_computed set
                                   (its newest token is computed by D2's next step; seeded
                                   draws go on at token index len(output_ids); penalty counts
                                   and the stop-string window are rebuilt from the ids)
    D1  every step                 `done` from D2: the request's pages and sampler slot freed,
                                   its record dropped without a final output (D2 sends that);
                                   the sender failed (D2 refused, a pull error, expiry): the
                                   request rejoins D1's decode batch and completes there

Replay (the KV cannot come: another page size or KV dtype, or `migration=replay`): D1 offers
as usual; D2 takes the request into its waiting queue like a preempted one (`_replay_in`:
prompt and outputs prefilled again, the next token drawn at index len(output_ids)), and D1,
told so (`migration_replayed`), drops it as moved without any pull.

Emission: every output of the request, on D1 before the move and on D2 after, goes through one
`RelaySink` around the client's original sink: D2 starts with `num_emitted = len(output_ids)`
(no token twice), D1 emits nothing from the export on (no token lost in between: the landing
emitted the last one D1 sampled), and the relay passes nothing after a final output. In one
process D2 emits straight into it; between servers this is where D1 relays D2's stream to the
connection it holds (docs: see the module's report in issue 50).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from typing import Any

from pdtopo.runtime.disagg.transport.base import KVTransferError
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll
from pdtopo.runtime.disagg.transport.messages import MigrationOffer
from pdtopo.runtime.engine.request import (
    FinishReason,
    NullSink,
    OutputSink,
    Req,
    ReqOutput,
    ReqStatus,
    SamplingParams,
)

log = logging.getLogger("pdtopo.disagg.migration")

OfferFn = Callable[[MigrationOffer, OutputSink], None]


class RelaySink:
    """The client's sink, shared by D1 and D2 while a request moves (either thread may emit):
    each output token passes once, by its index in the request's output (an output carries
    `num_output_tokens`: its new tokens are the last of those), in order, and nothing passes
    after the final output, whichever side ends the request first. Should both sides ever
    decode it (D2's `done` lost after D2 started, and D1 taking the request back), the client
    still sees every token once."""

    def __init__(self, sink: OutputSink) -> None:
        self.sink = sink
        self.closed = False
        self.delivered = 0             # output tokens the client has
        self._lock = threading.Lock()

    def emit(self, out: ReqOutput) -> None:
        with self._lock:
            if self.closed:
                return
            first = out.num_output_tokens - len(out.new_token_ids)  # index of new_token_ids[0]
            skip = max(0, self.delivered - first)
            if skip and not out.finished and skip >= len(out.new_token_ids):
                return  # nothing new
            if skip:
                out = replace(out, new_token_ids=out.new_token_ids[skip:],
                              new_logprobs=None if out.new_logprobs is None
                              else out.new_logprobs[skip:])
            self.delivered = max(self.delivered, out.num_output_tokens)
            if out.finished:
                self.closed = True
            self.sink.emit(out)


@dataclass
class Outgoing:
    req: Req
    sender: Any
    result: Future
    started: float
    abort_at: Callable[[str], None] | None = None


class MigrationMixin:
    """Both ends of a migration, for the decode mixin (see the module docstring)."""

    def _init_migration(self) -> None:
        self._outgoing: dict[str, Outgoing] = {}
        self.num_migrated_out = 0
        self.num_migrated_in = 0
        self.num_migrations_refused = 0   # offers this D refused (no room, ...)
        self.num_migrations_kept = 0      # requests of this D that could not move
        self.num_migration_landings = 0   # exports that landed the step in flight first
        # moved requests whose client may still abort here: rid -> (req, relay, abort_at)
        self._moved_to: dict[str, tuple[Req, RelaySink, Callable[[str], None]]] = {}

    # ------------------------------------------------------------------ thread-safe API
    def migrate(self, rid: str, offer_to: OfferFn,
                abort_at: Callable[[str], None] | None = None) -> Future:
        """Move running request `rid` to the D that `offer_to(offer, sink)` reaches; once it
        moved, a client abort of `rid` here is passed on to `abort_at(rid)` (the target's
        `abort`). The future ends with {"moved": bool, "reason": str}: moved, or kept running
        here."""
        fut: Future = Future()
        self.inbox.put(("migrate_out", (rid, offer_to, fut, abort_at)))
        return fut

    def accept_migration(self, offer: MigrationOffer, sink: OutputSink) -> None:
        """An offer from another D (the `offer_to` of an in-process migration)."""
        self.inbox.put(("migrate_in", (offer, sink)))

    def accept_replay(self, offer: MigrationOffer, sink: OutputSink) -> None:
        """An offer to continue by recomputing its KV here (a source whose KV cannot come:
        another page size or KV dtype, or `disaggregation.migration=replay`)."""
        self.inbox.put(("migrate_replay", (offer, sink)))

    def migration_replayed(self, rid: str) -> None:
        """The target took `rid` to recompute: nothing is pulled, it is gone from here."""
        self.inbox.put(("migrate_replayed", rid))

    def cancel_migration(self, rid: str, why: str) -> None:
        """The offer of moving `rid` did not reach a D that takes it (an HTTP call failed):
        it stays here."""
        self.inbox.put(("migrate_cancel", (rid, why)))

    def dispatch(self, msg: tuple[Any, Any]) -> None:
        if msg[0] == "migrate_out":
            self._migrate_out(*msg[1])
        elif msg[0] == "migrate_in":
            self._migrate_in(*msg[1])
        elif msg[0] == "migrate_replay":
            self._replay_in(*msg[1])
        elif msg[0] == "migrate_replayed":
            o = self._outgoing.pop(msg[1], None)
            if o is not None:
                o.sender.abort("the target recomputes the request's KV", status=410)
                self._moved(o)
        elif msg[0] == "migrate_cancel":
            o = self._outgoing.get(msg[1][0])
            if o is not None and not o.sender.poll().terminal:
                o.sender.abort(msg[1][1], status=503)  # -> Failed: kept at the next poll
        else:
            super().dispatch(msg)

    # ------------------------------------------------------------------ D1: out
    def _migrate_out(self, rid: str, offer_to: OfferFn, fut: Future,
                     abort_at: Callable[[str], None] | None = None) -> None:
        req = self.reqs.get(rid)
        if req is not None and self.in_flight is not None and any(
                r is req for r in self.in_flight.reqs):
            flight, self.in_flight = self.in_flight, None
            self.land(flight)  # its tokens emitted here; the next step is formed afresh
            self.num_migration_landings += 1
        # every output emitted so far reaches the client's queue before the offer (which says
        # the client has all of req.output_ids) and before the move's result wakes the route
        self.flush_outputs()
        if req is None or req.finished or req.status != ReqStatus.RUNNING or \
                req not in self.running or rid in self._outgoing:
            fut.set_result({"moved": False, "reason": "not a running request here"})
            return
        if req.num_computed != req.seq_len - 1:
            fut.set_result({"moved": False, "reason": f"not at a step boundary ({req})"})
            return
        room = random.getrandbits(63)
        try:
            sender = self.kv_manager.create_sender(room)
        except (KVTransferError, ValueError) as exc:
            fut.set_result({"moved": False, "reason": str(exc)})
            return
        self.running.remove(req)
        req.status = ReqStatus.HELD
        if not isinstance(req.sink, RelaySink):
            req.sink = RelaySink(req.sink)
        pages = self.pages_for(req.num_computed)
        sender.send(req.page_ids[:pages], prompt_len=req.num_computed)
        self._outgoing[rid] = Outgoing(req, sender, fut, time.monotonic(), abort_at)
        if sender.poll() == KVPoll.Failed:
            return  # resumed by the next poll
        sp = asdict(req.sampling)
        offer = MigrationOffer(
            room=room, rid=req.rid, source=self.kv_manager.channel.address,
            prompt_ids=tuple(req.prompt_ids), output_ids=tuple(req.output_ids),
            num_computed=req.num_computed, page_count=pages, sampling=sp,
            output_logprobs=tuple(req.output_logprobs) if req.sampling.logprobs >= 0 else None,
            cached_tokens=req.cached_tokens)
        try:
            offer_to(offer, req.sink)
        except Exception as exc:  # the target is gone: keep the request
            log.warning("%s: migration offer failed: %s", rid, exc)
            sender.abort(f"offer failed: {exc}", status=503)

    def _poll_outgoing(self) -> None:
        self.kv_manager.progress()
        for rid, o in list(self._outgoing.items()):
            state = o.sender.last_state
            if state == KVPoll.Success:
                del self._outgoing[rid]
                self._moved(o)
            elif state == KVPoll.Failed:
                del self._outgoing[rid]
                self._keep(o, str(o.sender.failure_exception()))
            elif o.sender.peer is None and \
                    time.monotonic() - o.started > self.kv_manager.kv_timeout_s:
                # the offer never reached a D that took it: do not stall the request until
                # the sender expires (sender_expiry_s); it goes on here at the next poll
                o.sender.abort(f"the target D never asked for the KV within kv_timeout_s="
                               f"{self.kv_manager.kv_timeout_s:g}", status=504)

    def _moved(self, o: Outgoing) -> None:
        req = o.req
        kv_bytes = len(req.page_ids) * self.runner.page_bytes_per_device() * self.runner.tp
        self.sampler.release(req.serial)
        self.release_kv(req, keep=False)
        req.status = ReqStatus.FINISHED
        if self.reqs.get(req.rid) is req:
            del self.reqs[req.rid]
        self.num_migrated_out += 1
        self.metrics.migrations.labels("out", "moved").inc()
        self.metrics.migration_seconds.observe(time.monotonic() - o.started)
        self.metrics.migration_bytes.inc(kv_bytes)
        for gone in [k for k, v in self._moved_to.items() if v[1].closed]:
            del self._moved_to[gone]  # ended at the target
        if o.abort_at is not None and isinstance(req.sink, RelaySink):
            self._moved_to[req.rid] = (req, req.sink, o.abort_at)
        log.info("%s moved to another D in %.3fs", req.rid, time.monotonic() - o.started)
        o.result.set_result({"moved": True, "reason": "done"})

    def handle_abort(self, rid: str, only: Req | None = None) -> None:
        """A client abort of a request that moved away goes on to the D it moved to."""
        moved = self._moved_to.get(rid)
        if moved is None or rid in self.reqs:
            super().handle_abort(rid, only)
            return
        req, relay, abort_at = moved
        if only is not None and only is not req:
            return
        del self._moved_to[rid]
        if not relay.closed:
            abort_at(rid)

    def _keep(self, o: Outgoing, why: str) -> None:
        req = o.req
        self.num_migrations_kept += 1
        self.metrics.migrations.labels("out", "kept").inc()
        log.info("%s stays here: %s", req.rid, why)
        if not req.finished:
            req.status = ReqStatus.RUNNING
            self.running.append(req)
        o.result.set_result({"moved": False, "reason": why})

    def _end_outgoing(self, req: Req, reason: dict[str, Any]) -> None:
        """`req` ends here while it moves (aborted, shutdown): D2 is told to drop it."""
        o = self._outgoing.get(req.rid)
        if o is None or o.req is not req:
            return
        del self._outgoing[req.rid]
        if not o.sender.poll().terminal:
            o.sender.abort(reason.get("message", "request ended at the source D"),
                           status=reason.get("status_code", 500))
        o.result.set_result({"moved": False, "reason": "ended while moving"})

    # ------------------------------------------------------------------ D2: in
    def _migrate_in(self, offer: MigrationOffer, sink: OutputSink) -> None:
        busy = (len(self.running) + len(self.transfer_queue) + len(self.ready_queue)
                + len(self.prealloc_queue) + len(self._outgoing))
        sampling = SamplingParams(**offer.sampling)
        why = None
        if offer.rid in self.reqs:
            why = f"a request with rid {offer.rid!r} is live here"
        elif busy >= self.max_running:
            why = f"no free decode row ({busy} of {self.max_running} taken)"
        else:
            why = self.check_fits(len(offer.prompt_ids), sampling.max_new_tokens)
            if why is None and not self.ensure_free(offer.page_count + busy + 1):
                why = (f"no free pages ({offer.page_count} needed, "
                       f"{self.allocator.num_free} free)")
        if why is not None:
            self.num_migrations_refused += 1
            self.metrics.migrations.labels("in", "refused").inc()
            try:
                self.kv_manager.refuse_room(offer.room, offer.source,
                                            f"the target D cannot take the request: {why}", 503)
            except (KVTransferError, ValueError) as exc:
                log.warning("room %s: could not refuse at %s: %s", offer.room, offer.source, exc)
            return
        try:
            receiver = self.kv_manager.create_receiver(offer.room, offer.source)
        except (KVTransferError, ValueError) as exc:
            log.warning("room %s: cannot pull from %s: %s", offer.room, offer.source, exc)
            return  # D1's sender expires: it keeps the request
        now = time.monotonic()
        # the client's sink only once the KV is here: a failure before that (a pull error,
        # a timeout) ends the request here in silence, and D1 (told `failed`) carries on
        req = Req(rid=offer.rid, prompt_ids=list(offer.prompt_ids), sampling=sampling,
                  sink=NullSink(), output_ids=list(offer.output_ids))
        req.extra["client_sink"] = sink
        if sampling.logprobs >= 0:
            req.output_logprobs = list(offer.output_logprobs or [None] * len(offer.output_ids))
        req.num_emitted = len(req.output_ids)     # D1 emitted those
        req.cached_tokens = offer.cached_tokens
        req.first_token_time = req.last_token_time = now  # no second TTFT
        req.extra["migrated_in"] = offer.num_computed
        req.page_ids = self.alloc_pages(offer.page_count)
        receiver.init(req.page_ids)
        self.register_request(req)
        self.queue_transfer(req, receiver, offer.source)  # the decode mixin's transfer queue

    def _replay_in(self, offer: MigrationOffer, sink: OutputSink) -> None:
        """Continue a moved request by recomputing it: like a preempted request, it waits
        for pages and a row, its prompt and every output token are prefilled (one step or
        chunked), and the next token is drawn at index len(output_ids), as on the source."""
        sampling = SamplingParams(**offer.sampling)
        if offer.rid in self.reqs:
            self.num_migrations_refused += 1
            self.metrics.migrations.labels("in", "refused").inc()
            sink.emit(ReqOutput(offer.rid, [], len(offer.output_ids), len(offer.prompt_ids),
                                finished=True, finish_reason=FinishReason.abort(
                                    f"a request with rid {offer.rid!r} is live on the target "
                                    "D", 409)))
            return
        req = Req(rid=offer.rid, prompt_ids=list(offer.prompt_ids), sampling=sampling,
                  sink=sink, output_ids=list(offer.output_ids))
        if sampling.logprobs >= 0:
            req.output_logprobs = list(offer.output_logprobs or [None] * len(offer.output_ids))
        req.num_emitted = len(req.output_ids)
        req.cached_tokens = offer.cached_tokens
        req.first_token_time = req.last_token_time = time.monotonic()
        req.timeline = {"migrated_at_token": float(len(req.output_ids)), "migration_replayed": 1.0}
        self.register_request(req)
        self.waiting.append(req)
        self.num_migrated_in += 1
        self.metrics.migrations.labels("in", "replayed").inc()

    def _start_migrated(self, req: Req, ready_info: Any) -> None:
        """The KV of a migrated request is in the pool: into the decode batch."""
        computed = int(req.extra["migrated_in"])
        req.sink = req.extra.pop("client_sink")  # D1 has dropped it (`done`): ours from now
        if ready_info.prompt_len != computed:
            self.finish_request(req, FinishReason.abort(
                f"the source D sent the KV of {ready_info.prompt_len} tokens, the request has "
                f"{computed}", 500))
            return
        req.num_computed = computed
        # the request's timeline (the final output's pd_timeline) says where it moved
        req.timeline = {**(req.timeline or {}), "migrated_at_token": float(len(req.output_ids)),
                        "migration_ms": round((time.monotonic() - req.first_token_time) * 1e3,
                                              3)}
        self.num_migrated_in += 1
        self.metrics.migrations.labels("in", "moved").inc()
        self.add_to_running(req)

    def migration_state(self) -> dict[str, Any]:
        return {"pd_migrating_out": len(self._outgoing),
                "pd_migrated_out": self.num_migrated_out,
                "pd_migrated_in": self.num_migrated_in,
                "pd_migrations_refused": self.num_migrations_refused,
                "pd_migrations_kept": self.num_migrations_kept}
