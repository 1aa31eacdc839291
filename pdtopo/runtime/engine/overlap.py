"""Overlap scheduling: the host prepares and dispatches step N+1 while the device runs step N,
and reads step N's tokens while step N+1 runs.

Data flow (`OverlapMixin`, mixed into the `Scheduler`; `engine.overlap_schedule`):

    step()  -> with a step in flight (`InFlight`: a step dispatched, its sampled tokens still on
               the device):
                 run_ahead(in_flight)  the next step, a decode step over the requests running
                                       once the step in flight lands: each that step sampled
                                       a token for is fed it on the device (`ModelRunner.
                                       forward(..., feed=)`), its page table grown for it,
                                       sampled with the token index one further; a running
                                       request the step did not carry (a prefill step's
                                       bystander) decodes its newest token from the host.
                                       None when the next step is not a pure continuation
                                       (below)
                 land(in_flight)       read the tokens back and do what `run_batch` does with
                                       them (`Scheduler.land_batch`): per decode row
                                       num_computed + 1, process_new_token (emit, stop checks,
                                       finish); per prompt chunk its prefill bookkeeping and
                                       on_prefill_finished (first token: TTFT, into running)
               otherwise the synchronous path: schedule(), then the batch is launched
               (`launch`: dispatched, landed by the next step) when `may_launch` says so, or
               runs whole (`run_batch`)

What is launched: every decode step, and (`overlap_prefill`: the colocated role) a prefill or
mixed step whose prompt chunks all end their prompts, i.e. every request in it gets a token,
so that the next step can be a decode step over them. A step with a chunk that does not end its
prompt runs whole: that request's next step is its next chunk (a prompt step, formed by
`schedule()`). P keeps `overlap` off (its first token leaves with the KV transfer); D and the
local decode engine add requests whose KV arrived to the running batch in their own `step()`
(`running < max_running` counted without a prefill in flight), and the local prefill engine
hands its requests away in on_prefill_finished: those roles launch decode steps only.

A continuation needs the running set equal to the running requests when the step in flight was
dispatched (`InFlight.before`) less those that ended since (D adding a request, a preemption:
synchronous), every prompt chunk in flight ending its prompt, and free pages for every request
to grow without preempting. The requests running once the step lands are `before`, then the
step's prompt requests (that order: `land_batch` appends them, like `schedule_decode` would see
them). Load does not stop it:

- waiting requests: the scheduler's `can_admit` asks, without side effects, whether
  `schedule()` would start the queue's head once the step lands (a free row, counting the
  prompt requests landing in as running and out the requests that certainly end on their
  pending token; its pages after its cached prefix; a mixin's `may_start`; an n > 1 follower
  whose leader's prompt is in flight: yes, the landing puts its pages in the prefix cache). If
  so the step lands first and the synchronous path admits and prefills it (decoding ahead
  resumes at the next decode step); if not (running == max_running_requests, no pages, a
  mixin's hold) the running requests decode ahead and it waits, asked again at every step. A
  row freed by a foreseen end (length) is counted before the landing, so the request starts at
  the same step as in the synchronous loop, and so does one freed by an abort (the inbox is
  drained before the continuation is formed); one freed by an end found when step N lands
  (EOS, a stop string) has step N+1 in flight already: the request starts once that lands, one
  decode step later than in the synchronous loop.
- penalised rows: their counts live on the device (penalties.py) and the sampling program
  adds each sampled token to them, so the continuation's sample sees the in-flight token
  there (a prompt's first token too: its slot is built, from the prompt, by the step that ends
  the prompt; a chunk that does not end it samples nothing that counts, `Scheduler.
  batch_rows`). Only a row whose slot would be built now (from host ids that lack that token:
  the slot was given to another request) stops it (`Sampler.has_counts`).

A request whose pending token is certainly its last (max_new_tokens, the context length) is
left out; one that finishes on its pending token anyway (EOS, a stop string: a prompt's first
token too), or is aborted while the continuation is in flight, had one more token computed,
which is dropped (`land_batch` skips finished requests: nothing of theirs is emitted after
their end): its pages are freed when it ends, and the device runs steps in order, so the stale
write lands before any later owner of those pages writes them (the write is at the request's
position num_computed, past the full pages the prefix cache may adopt from it). A prompt
request aborted while its prefill is in flight is skipped the same way when it lands (its
first token is never emitted). Outputs equal the synchronous loop's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdtopo.runtime.engine.batch import ScheduledBatch, decode_piece
from pdtopo.runtime.engine.request import FinishReason, Req
from pdtopo.runtime.engine.sampling import PendingSample, RowParams

log = logging.getLogger("pdtopo.scheduler")


@dataclass
class InFlight:
    """A step dispatched and not landed: its batch (decode rows, then prompt chunks that end
    their prompts), its sample, and the running requests when it was dispatched (`before`;
    for a decode step, its own requests)."""

    batch: ScheduledBatch
    sample: PendingSample
    before: list[Req]

    @property
    def reqs(self) -> list[Req]:
        """The step's requests, in row order."""
        return self.batch.reqs


class OverlapMixin:
    """The overlapped loop; the Scheduler provides the rest (`self.runner`, `sampler`, ...)."""

    in_flight: InFlight | None = None
    overlap: bool = False
    overlap_prefill: bool = False  # prefill/mixed steps launched too (the colocated role)

    def overlap_step(self) -> bool:
        """Advance the in-flight step, if any: dispatch its continuation, then land it.
        Returns True when a continuation is now in flight (the step is done)."""
        if self.in_flight is None:
            return False
        ahead = self.run_ahead(self.in_flight)
        self.land(self.in_flight)
        self.in_flight = ahead
        return ahead is not None

    def may_launch(self, batch: ScheduledBatch) -> bool:
        """Whether a scheduled batch may be left in flight (landed by the next step): a decode
        batch, or with `overlap_prefill` one whose prompt chunks all end their prompts."""
        if not self.overlap:
            return False
        return batch.kind == "decode" or (self.overlap_prefill and all(batch.completes))

    def dispatch_step(self, batch: ScheduledBatch, rows: list[RowParams],
                      feed: tuple | None = None) -> PendingSample | None:
        """The step's forward and sampling (`rows`: one per request), dispatched (nothing read
        back); a failure ends the step's requests (None), or is raised when it is fatal
        (`step_error_is_fatal`: the event loop ends the process). `feed`: a continuation's
        (`run_ahead`)."""
        try:
            extra = {} if feed is None else {"feed": feed}  # a leader's runner takes no feed
            logits = self.runner.forward(batch.chunks, padded=True, **extra)
            return self.sampler.dispatch(logits, rows)
        except Exception as exc:
            if self.step_error_is_fatal(exc):
                raise
            self.fail_batch(batch.reqs, batch.kind, exc)
            return None

    def read_step(self, sample: PendingSample, reqs: list[Req], kind: str):
        """The step's sampled rows read back (SampleResult); a failure ends its requests, or
        is raised when fatal (a device error surfaces here: the programs ran asynchronously)."""
        self.flush_outputs()  # what earlier steps emitted goes out while the device works
        try:
            return sample.result()
        except Exception as exc:
            if self.step_error_is_fatal(exc):
                raise
            self.fail_batch(reqs, kind, exc)
            return None

    def launch(self, batch: ScheduledBatch) -> None:
        self.fault.tick()  # testing: a fault injected into the scheduler's thread fires here
        before = list(self.running)
        sample = self.dispatch_step(batch, self.batch_rows(batch))
        if sample is not None:
            self.in_flight = InFlight(batch, sample, before)

    def continuing(self, flight: InFlight) -> list[tuple[int, Req]]:
        """(row, request) of the next step, in running order: row is the request's row in the
        step in flight (its token is fed from there), -1 for a running request that step did
        not carry (its newest token is on the host). [] when there is none, or the next step
        must be formed after the landing: synchronous."""
        batch = flight.batch
        if not all(batch.completes):
            return []  # a prompt continues with its next chunk: schedule() forms that step
        before = [r for r in flight.before if not r.finished]  # aborted since: no row, freed
        if len(self.running) != len(before) or any(
                a is not b for a, b in zip(self.running, before, strict=False)):
            return []  # D added a request, or one was preempted: schedule() forms the step
        prompts = [r for r in batch.reqs[batch.num_decode:] if not r.finished]
        rows = {id(r): i for i, r in enumerate(batch.reqs)}
        after = before + prompts  # running once the step lands (less those ending on it)
        nxt = []
        for r in after:
            i = rows.get(id(r), -1)
            if i < 0 or (len(r.output_ids) + 1 < r.sampling.max_new_tokens
                         and r.seq_len + 1 < self.max_model_len):
                nxt.append((i, r))
        if not nxt:
            return []
        # a waiting request that can start now (or once the requests certainly ending on
        # their pending token are gone) is admitted after the landing; one that cannot
        # (no free row, no pages) waits while the running ones decode ahead
        if self.waiting and self.can_admit(leaving=len(after) - len(nxt), landing=prompts):
            return []
        if any(i >= 0 and r.sampling.penalised and not self.sampler.has_counts(r.serial)
               for i, r in nxt):
            return []  # its counts would be built from host ids that lack the pending token
        return nxt

    def run_ahead(self, flight: InFlight) -> InFlight | None:
        rows = self.continuing(flight)
        if not rows:
            return None
        self.fault.tick()
        # a fed request's pending token goes at position seq_len; a host row's newest token
        # (not computed yet) is already counted in seq_len
        needs = [max(0, self.pages_for(r.seq_len + (i >= 0)) - len(r.page_ids))
                 for i, r in rows]
        if not self.ensure_free(sum(needs)):
            return None
        reqs = [r for _, r in rows]
        for r, need in zip(reqs, needs, strict=True):
            if need > 0:
                r.page_ids.extend(self.alloc_pages(need))
        chunks = [self.make_chunk([0], r.seq_len, r.page_ids) if i >= 0 else
                  self.make_chunk(decode_piece(r), r.num_computed, r.page_ids)
                  for i, r in rows]
        src = [i for i, _ in rows]
        feed = (flight.sample.tokens, src) if any(i >= 0 for i in src) else None
        batch = ScheduledBatch("decode", reqs, chunks, num_decode=len(reqs))
        sample = self.dispatch_step(batch, [self.row_params(r, int(i >= 0)) for i, r in rows],
                                    feed=feed)
        if sample is None:
            return None
        self.num_overlapped_steps += 1
        return InFlight(batch, sample, list(reqs))

    def land(self, flight: InFlight) -> None:
        result = self.read_step(flight.sample, flight.reqs, flight.batch.kind)
        if result is not None:
            self.land_batch(flight.batch, result)

    def fail_batch(self, reqs: list[Req], kind: str, exc: BaseException) -> None:
        log.exception("%s batch of %d failed", kind, len(reqs), exc_info=exc)
        for req in reqs:
            if not req.finished:
                self.finish_request(req, FinishReason.abort(f"engine error: {exc}"))
