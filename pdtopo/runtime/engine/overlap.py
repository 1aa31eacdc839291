"""Overlap scheduling: in steady decode the host prepares and dispatches step N+1 while the
device runs step N, and reads step N's tokens while step N+1 runs.

Data flow (`OverlapMixin`, mixed into the `Scheduler`; `engine.overlap_schedule`):

    step()  -> with a step in flight (`InFlight`: a decode step dispatched, its sampled tokens
               still on the device):
                 run_ahead(in_flight)  the next step over the same requests, each fed its
                                       pending token on the device (`ModelRunner.forward(...,
                                       feed=)`), its page table grown for it, sampled with
                                       the token index one further; None when the next step
                                       is not a pure continuation (below)
                 land(in_flight)       read the tokens back; per request: num_computed + 1,
                                       process_new_token (emit, stop checks, finish)
               otherwise the synchronous path: schedule(), then a decode batch is launched
               (`launch`: dispatched, landed by the next step) and any other batch runs whole
               (`run_batch`)

A continuation needs the running set equal to the in-flight step's live requests (D adding a
request, a preemption: synchronous; a request aborted or finished since has no row), and free
pages for every request to grow without preempting. Load does not stop it:

- waiting requests: the scheduler's `can_admit` asks, without side effects, whether
  `schedule()` would start the queue's head now (a free row, counting out the requests that
  certainly end on their pending token; its pages after its cached prefix; a mixin's
  `may_start`). If so the step lands first and the synchronous path admits and prefills it
  (decoding ahead resumes at the next decode step); if not (running == max_running_requests,
  no pages, a mixin's hold) the running requests decode ahead and it waits, asked again
  at every step. A row freed by a foreseen end (length) is counted before the landing, so the
  request starts at the same step as in the synchronous loop, and so does one freed by an
  abort (the inbox is drained before the continuation is formed); one freed by an end found
  when step N lands (EOS, a stop string) has step N+1 in flight already: the request starts
  once that lands, one decode step later than in the synchronous loop.
- penalised rows: their counts live on the device (penalties.py) and the sampling program
  adds each sampled token to them, so the continuation's sample sees the in-flight token
  there. Only a row whose slot would be built now (from host ids that lack that token: the
  slot was given to another request) stops it (`Sampler.has_counts`).

A request whose pending token is certainly its last (max_new_tokens, the context length) is
left out; one that finishes on its pending token anyway (EOS, a stop string), or is aborted
while the continuation is in flight, had one more token computed, which is dropped (`land`
skips finished requests: nothing of theirs is emitted after their end): its pages are freed
when it ends, and the device runs steps in order, so the stale write lands before any later
owner of those pages writes them (the write is at the request's position num_computed, past
the full pages the prefix cache may adopt from it). Outputs equal the synchronous loop's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdtopo.runtime.engine.request import FinishReason, Req
from pdtopo.runtime.engine.sampling import PendingSample

log = logging.getLogger("pdtopo.scheduler")


@dataclass
class InFlight:
    """A decode step dispatched and not landed: its requests, in row order, and their sample."""

    reqs: list[Req]
    sample: PendingSample


class OverlapMixin:
    """The overlapped loop; the Scheduler provides the rest (`self.runner`, `sampler`, ...)."""

    in_flight: InFlight | None = None
    overlap: bool = False

    def overlap_step(self) -> bool:
        """Advance the in-flight step, if any: dispatch its continuation, then land it.
        Returns True when a continuation is now in flight (the step is done)."""
        if self.in_flight is None:
            return False
        ahead = self.run_ahead(self.in_flight)
        self.land(self.in_flight)
        self.in_flight = ahead
        return ahead is not None

    def may_launch(self, batch) -> bool:
        """Whether a scheduled batch may be left in flight (landed by the next step)."""
        return self.overlap and batch.kind == "decode"

    def dispatch_step(self, reqs: list[Req], chunks: list, kind: str, feed: tuple | None = None,
                      ahead: int = 0) -> PendingSample | None:
        """The step's forward and sampling, dispatched (nothing read back); a failure ends
        the step's requests (None), or is raised when it is fatal (`step_error_is_fatal`:
        the event loop ends the process). `feed`/`ahead`: a continuation (`run_ahead`)."""
        try:
            extra = {} if feed is None else {"feed": feed}  # a leader's runner takes no feed
            logits = self.runner.forward(chunks, padded=True, **extra)
            return self.sampler.dispatch(logits, [self.row_params(r, ahead) for r in reqs])
        except Exception as exc:
            if self.step_error_is_fatal(exc):
                raise
            self.fail_batch(reqs, kind, exc)
            return None

    def read_step(self, sample: PendingSample, reqs: list[Req], kind: str):
        """The step's sampled rows read back (SampleResult); a failure ends its requests, or
        is raised when fatal (a device error surfaces here: the programs ran asynchronously)."""
        try:
            return sample.result()
        except Exception as exc:
            if self.step_error_is_fatal(exc):
                raise
            self.fail_batch(reqs, kind, exc)
            return None

    def launch(self, batch) -> None:
        self.fault.tick()  # testing: a fault injected into the scheduler's thread fires here
        sample = self.dispatch_step(batch.reqs, batch.chunks, batch.kind)
        if sample is not None:
            self.in_flight = InFlight(list(batch.reqs), sample)

    def continuing(self, flight: InFlight) -> list[tuple[int, Req]]:
        """(row, request) of the in-flight requests the next step continues ([]: none, or the
        next step must be formed after the landing: synchronous)."""
        live = [r for r in flight.reqs if not r.finished]  # aborted since: no row, freed
        if {id(r) for r in self.running} != {id(r) for r in live}:
            return []  # D added a request, or one was preempted: schedule() forms the step
        rows = [(i, r) for i, r in enumerate(flight.reqs)
                if not r.finished and len(r.output_ids) + 1 < r.sampling.max_new_tokens
                and r.seq_len + 1 < self.max_model_len]
        if not rows:
            return []
        # a waiting request that can start now (or once the requests certainly ending on
        # their pending token are gone) is admitted after the landing; one that cannot
        # (no free row, no pages) waits while the running ones decode ahead
        if self.waiting and self.can_admit(leaving=len(live) - len(rows)):
            return []
        if any(r.sampling.penalised and not self.sampler.has_counts(r.serial) for _, r in rows):
            return []  # its counts would be built from host ids that lack the pending token
        return rows

    def run_ahead(self, flight: InFlight) -> InFlight | None:
        rows = self.continuing(flight)
        if not rows:
            return None
        self.fault.tick()
        needs = [self.pages_for(r.seq_len + 1) - len(r.page_ids) for _, r in rows]
        if not self.ensure_free(sum(needs)):
            return None
        reqs = [r for _, r in rows]
        for r, need in zip(reqs, needs, strict=True):
            if need > 0:
                r.page_ids.extend(self.alloc_pages(need))
        chunks = [self.make_chunk([0], r.seq_len, r.page_ids) for r in reqs]
        sample = self.dispatch_step(reqs, chunks, "decode", ahead=1,
                                    feed=(flight.sample.tokens, [i for i, _ in rows]))
        if sample is None:
            return None
        self.num_overlapped_steps += 1
        return InFlight(reqs, sample)

    def land(self, flight: InFlight) -> None:
        result = self.read_step(flight.sample, flight.reqs, "decode")
        if result is None:
            return
        self.num_forward += 1
        self.num_decode_steps += 1
        for i, req in enumerate(flight.reqs):
            if req.finished:
                continue  # aborted, or finished on the token before: this one is dropped
            req.num_computed += 1
            self.process_new_token(req, int(result.tokens[i]),
                                   self.token_logprob(result, i, req))

    def fail_batch(self, reqs: list[Req], kind: str, exc: BaseException) -> None:
        log.exception("%s batch of %d failed", kind, len(reqs), exc_info=exc)
        for req in reqs:
            if not req.finished:
                self.finish_request(req, FinishReason.abort(f"engine error: {exc}"))
