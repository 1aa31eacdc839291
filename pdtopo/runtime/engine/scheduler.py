"""The continuous-batching scheduler: the one thread that owns the model runner, the KV pool
(`runner.kv_caches`) and the page allocator. This module holds the decisions (which requests
get rows in a step, who is preempted, what a step's tokens do next) and the loop; the state
they work on lives beside it:

    admission.py    requests in: the thread-safe inbox, checks, registration, the waiting
                    queue, aborts (AdmissionMixin)
    kv_pages.py     page accounting: the allocator and the prefix cache (KVPages, `pages`)
    batch.py        step forming: one step's rows (ScheduledBatch), a request's next chunk
    outputs.py      tokens out: landing, stop checks, outputs, a request's end (OutputMixin)
    stats.py        the counters and the published snapshot (StatsMixin)
    step_errors.py  a failed step: its requests end, or the whole engine (StepErrorsMixin)
    overlap.py      steady decode: step N+1 dispatched before step N lands (OverlapMixin)

Data flow. Other threads only `submit(req)` / `abort(rid)` into the inbox. The scheduler thread
runs `event_loop()`, whose iteration is `step()`:

    drain_inbox()     -> handle_new_request(req) / handle_abort(rid) / flush_cache
    schedule()        -> schedule_mixed() (decode rows, then prompt chunks in the budget left)
                         when engine.mixed_steps, requests run and more prompt tokens wait than
                         one step's budget; else schedule_prefill() (the waiting queue in
                         order, within engine.max_prefill_tokens: a new request starts after its
                         longest cached prefix, is admitted by free pages, chunked when long),
                         else schedule_decode() (every running request, page tables grown, the
                         newest requests preempted when pages run out; the prefix cache gives
                         back unreferenced pages first)
    run_batch(batch)  -> runner.forward(chunks), Sampler, then `land_batch`: the decode rows
                         at once (land_decode_rows), on_prefill_finished(req, token) per prompt
                         (engine.overlap_schedule: a decode batch, and in the colocated role a
                         prefill or mixed one whose prompt chunks all end their prompts, is
                         launched instead and landed by the next step: overlap.py)
    publish_stats()   -> the snapshot for /pdtopo/state, /get_load and Prometheus
    idle_wait()       -> nothing to run: block on the inbox briefly
The outputs a step emits wait in `outbox` until the loop next waits for the device or idles
(`flush_outputs`): the HTTP side streams them while the device works.

Extension points for the PD mixins (override, call super() where it makes sense), beside
admission.py's (`handle_new_request`, `refuse_request`, ...) and outputs.py's (`finish_request`,
`free_request`): `on_prefill_finished(req, token)` (the prompt's KV is in the pool and its first
token sampled: by default `process_new_token`, then `add_to_running`; P sends KV + token
instead), `add_to_running(req)` (D's path for a request whose prompt KV it pulled into pages it
owns: `process_new_token(req, first_token)`, then this unless that finished it),
`make_prefix_cache(eng)` (D keeps none by default), `may_start(req)` (P: its budget of held KV
copies; a refusal keeps it and those behind it waiting; the overlapped loop's `can_admit` asks
it too), and the loop itself: `has_work()`, `schedule()`, `step()`, `event_loop()`,
`idle_wait()` (mixins with their own queues poll them in `step()` and report pending work in
`has_work()`). Helpers: `alloc_pages(n)`,
`ensure_free(n)`, `pages_for(num_tokens)`, `make_chunk(...)`, `emit(req)`, `page_problems()`
(docs/prefix-cache.md). Requests carry `bootstrap_host/port/room` untouched for the mixins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from pdtopo.runtime.engine.admission import STOP, AdmissionMixin
from pdtopo.runtime.engine.batch import (
    DROPPED_ROW,
    ScheduledBatch,
    decode_piece,
    prompt_piece,
    sampler_row,
)
from pdtopo.runtime.engine.host_kv import HostKVTier
from pdtopo.runtime.engine.kv_pages import KVPages, keeps_kv
from pdtopo.runtime.engine.metrics import EngineMetrics
from pdtopo.runtime.engine.model_runner import SeqChunk
from pdtopo.runtime.engine.outputs import OutputMixin
from pdtopo.runtime.engine.overlap import OverlapMixin
from pdtopo.runtime.engine.page_allocator import OutOfPages, PageAllocator
from pdtopo.runtime.engine.prefix_cache import PrefixCache
from pdtopo.runtime.engine.request import FinishReason, Req, ReqStatus, TokenLogprob
from pdtopo.runtime.engine.sampling import RowParams, Sampler, SampleResult, penalty_slots_for
from pdtopo.runtime.engine.stats import StatsMixin
from pdtopo.runtime.engine.step_errors import StepErrorsMixin
from pdtopo.runtime.worker_threads import CrashHandler, WorkerThread, crash_process, server_fault

log = logging.getLogger("pdtopo.scheduler")


class Scheduler(AdmissionMixin, OutputMixin, StatsMixin, StepErrorsMixin, OverlapMixin):
    """Continuous batching over a paged KV pool (see the module docstring for the hooks)."""

    role = "colocated"

    def __init__(self, ctx, runner, tokenizer, metrics: EngineMetrics | None = None):
        self.ctx = ctx
        eng = ctx.settings.engine
        self.runner = runner
        self.tokenizer = tokenizer
        self.page_size = runner.page_size
        self.allocator = PageAllocator(runner.num_pages)
        self.prefix_cache = self.make_prefix_cache(eng)
        self.pages = KVPages(self.allocator, self.prefix_cache, self.page_size)
        self.max_model_len = eng.max_model_len
        self.max_prefill_tokens = eng.max_prefill_tokens
        self.mixed_steps = bool(eng.mixed_steps)
        # overlap.py: steady decode dispatches step N+1 before landing step N
        self.overlap = bool(eng.overlap_schedule) and getattr(runner, "supports_feed", False)
        # prefill/mixed steps launched too: only where their requests go on decoding here and
        # nothing else joins the running batch between steps (not P, D or the local engines)
        self.overlap_prefill = self.overlap and self.role == "colocated"
        self.in_flight = None
        self.max_running = eng.max_running_requests
        self.base_seed = eng.seed
        self.model_name = eng.served_model_name or str(ctx.cfg.model.name)
        self.metrics = metrics or EngineMetrics(self.model_name, getattr(ctx, "role", self.role))
        self.eos_ids = set(int(t) for t in (tokenizer.eos_token_ids or []))
        self.sampler = Sampler(penalty_slots=penalty_slots_for(self.max_running))
        self.init_admission(self.base_seed)  # inbox, waiting, reqs
        self.running: list[Req] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.init_stats()  # counters, the published snapshot
        self.alive = True
        # the loop runs as a WorkerThread: an exception that escapes its own recovery (or an
        # injected `server.fault_inject_thread=scheduler`) calls on_crash, which by default
        # ends the process (supervisord restarts it) instead of leaving /health 200
        self.on_crash: CrashHandler = crash_process
        self.fault = server_fault(ctx.settings, "scheduler")
        # testing: the runner's N-th step fails after the pool was donated (step_errors.py)
        self.step_fault_after = eng.fault_inject_step_error_after
        self.publish_stats()

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self._thread = WorkerThread("scheduler", self.event_loop, self._thread_died)
        self._thread.start()

    def _thread_died(self, name: str, exc: BaseException) -> None:
        """The loop's thread ended with an exception: not alive (/health 503), then on_crash."""
        self.alive = False
        try:
            self.publish_stats()
        finally:
            self.on_crash(name, exc)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put((STOP, None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("scheduler thread did not stop within %.0fs", timeout)

    def warmup(self) -> None:
        """Compile the sampler for every row count of logits the loop can produce (call before
        `start()`): the batch buckets of one-token steps and the flat layout's rows; with
        overlap, the fed unpacking of every one-token step (`ModelRunner.warmup_feeds`). One real
        step runs (on one borrowed page, then freed) for logits shaped and sharded like
        serving's; the other row counts compile on zeros like them, without running steps."""
        (page,) = self.allocator.alloc(1)
        try:
            chunk = SeqChunk([0], 0, [page])
            logits = self.runner.forward([chunk], padded=True)
        finally:
            self.allocator.free([page])
        self.sampler.warmup(self.runner.sampling_row_counts(), like=logits)
        if self.overlap:
            self.runner.warmup_feeds()
        if self.host_tier is not None:
            self.host_tier.warmup()

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        log.info("scheduler loop started (pages=%d, page_size=%d)", self.allocator.num_total,
                 self.page_size)
        if self.step_fault_after is not None:
            self.runner.arm_step_fault(self.step_fault_after)
        self.outbox = []  # outputs wait for the step's device wait (flush_outputs)
        try:
            self.serve_steps()
        finally:
            self.flush_outputs()
            self.outbox = None
        for req in list(self.reqs.values()):
            self.finish_request(req, FinishReason.abort("server shutting down", 503))
        self.alive = False
        self.publish_stats()
        log.info("scheduler loop stopped")

    def serve_steps(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # a bug in one step must not kill the server ...
                if self.step_error_is_fatal(exc):  # ... unless its device state is lost
                    self.fail_engine(exc)
                log.exception("scheduler step failed; failing in-flight requests")
                for req in list(self.reqs.values()):
                    self.finish_request(req, FinishReason.abort(f"engine error: {exc}"))
                self.flush_outputs()

    def step(self) -> None:
        self.drain_inbox()
        landing = self.in_flight is not None
        if self.overlap_step():  # a continuation of the step in flight was dispatched
            self.publish_stats()
            return
        batch = self.schedule()
        if batch is None:
            self.publish_stats()
            self.flush_outputs()
            if not landing:  # a step that landed tokens did work: no wait before the next
                self.idle_wait()
            return
        if self.may_launch(batch):
            self.launch(batch)  # landed by the next step
        else:
            self.run_batch(batch)
        self.publish_stats()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    # ------------------------------------------------------------------ requests
    def add_to_running(self, req: Req) -> None:
        """Into the decode batch: a request whose prompt KV is in pages it owns
        (`req.num_computed == len(req.prompt_ids)`) and whose first output token is known."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def on_prefill_finished(self, req: Req, next_token: int,
                            logprob: TokenLogprob | None = None) -> None:
        if not self.process_new_token(req, next_token, logprob):
            self.add_to_running(req)

    def preempt(self, req: Req) -> None:
        """Free a request's pages and requeue it at the front; it is recomputed later."""
        log.info("preempting %s (free pages %d)", req, self.allocator.num_free)
        Scheduler.free_request(self, req)  # the engine's own release, not a mixin's override
        req.num_preemptions += 1
        req.status = ReqStatus.WAITING
        self.num_preemptions += 1
        self.metrics.preemptions.inc()
        self.waiting.appendleft(req)

    def pick_victim(self, exclude: Req) -> Req | None:
        for req in reversed(self.running):
            if req is not exclude:
                return req
        for req in reversed(self.waiting):  # partially prefilled requests hold pages too
            if req.page_ids and req is not exclude:
                return req
        return None

    # ------------------------------------------------------------------ pages (kv_pages.py)
    def make_prefix_cache(self, eng) -> PrefixCache | None:
        """The engine's prefix cache (`engine.prefix_cache`), with a host tier of
        `engine.host_kv_pages` pages when that is above 0; role mixins that keep none (D
        without `disaggregation.decode_prefix_cache`) return None."""
        if not eng.prefix_cache:
            return None
        host = HostKVTier(self.runner, eng.host_kv_pages) if eng.host_kv_pages else None
        return PrefixCache(self.allocator, self.page_size, host)

    def keeps_kv(self, req: Req) -> bool:
        return keeps_kv(req)

    @property
    def host_tier(self) -> HostKVTier | None:
        return self.pages.host

    def pages_for(self, num_tokens: int) -> int:
        return self.pages.pages_for(num_tokens)

    def alloc_pages(self, n: int) -> list[int]:
        return self.pages.alloc(n)

    def ensure_free(self, n: int) -> bool:
        return self.pages.ensure_free(n)

    def match_prefix(self, req: Req) -> None:
        self.pages.match(req)

    def release_kv(self, req: Req, keep: bool) -> None:
        self.pages.release(req, keep)

    def page_problems(self) -> list[str]:
        return self.pages.problems([r.page_ids for r in self.reqs.values()])

    def make_chunk(self, token_ids: list[int], start_pos: int, page_ids: list[int]):
        return SeqChunk(list(token_ids), int(start_pos), list(page_ids))

    # ------------------------------------------------------------------ batches
    def schedule(self) -> ScheduledBatch | None:
        if self.mixed_steps and self.running and self.prefill_backlog() > self.max_prefill_tokens:
            return self.schedule_mixed()
        return self.schedule_prefill() or self.schedule_decode()

    def prefill_backlog(self, queue=None) -> int:
        """Prompt tokens the waiting requests (or `queue`) still need. Mixing pays when
        prefilling them alone would hold the running decodes for more than one step; one short
        prefill step runs alone, as cheap for the decodes as a mixed one and cheaper for the
        batch."""
        return sum(r.seq_len - r.num_computed for r in (self.waiting if queue is None else queue))

    def schedule_mixed(self) -> ScheduledBatch | None:
        """Every running decode, then prompt chunks in what is left of the token budget: a
        long prompt no longer stops the running requests while it prefills."""
        decode = self.schedule_decode()
        if decode is None:  # all preempted
            return self.schedule_prefill()
        budget = self.max_prefill_tokens - len(decode.reqs)
        prefill = self.schedule_prefill(budget) if budget > 0 else None
        return ScheduledBatch.mixed(decode, prefill) if prefill else decode

    def schedule_prefill(self, budget: int | None = None) -> ScheduledBatch | None:
        """Prompt chunks of waiting requests within `budget` tokens (default
        engine.max_prefill_tokens), first come first served."""
        budget = self.max_prefill_tokens if budget is None else budget
        batch = ScheduledBatch("prefill", [], [])
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) + len(batch.reqs) >= self.max_running:
                break
            if self.awaits_leader(req):
                break  # FCFS: an n > 1 completion waits for its prompt's pages in the cache
            if not self.may_start(req):
                break  # FCFS: a mixin holds it back (P: its held-KV budget)
            fresh = not req.page_ids
            if fresh:
                self.match_prefix(req)
            need = self.pages_for(req.seq_len) - len(req.page_ids)
            if need > 0:
                # Keep one page per decoding request in reserve so admission does not force
                # an immediate preemption; with nothing running, any request that fits goes.
                reserve = len(self.running) + len(batch.reqs)
                if not self.ensure_free(need + reserve):
                    if fresh:  # hold no cached pages while waiting
                        self.release_kv(req, keep=False)
                    break  # FCFS: wait for pages
                req.page_ids.extend(self.alloc_pages(need))
            if fresh and req.num_computed:  # tokens served by the cache (also on recompute)
                self.num_cached_tokens += req.num_computed
                self.metrics.cached_tokens.inc(req.num_computed)
            tokens, complete = prompt_piece(req, budget)
            if req.prefill_start_time is None:
                req.prefill_start_time = time.monotonic()
            batch.add_prompt(req, self.make_chunk(tokens, req.num_computed, req.page_ids),
                             complete)
            budget -= len(tokens)
        return batch if batch.reqs else None

    def can_admit(self, leaving: int = 0, landing: Sequence[Req] = ()) -> bool:
        """Whether `schedule()` would start a waiting request's prompt once the step in flight
        lands: `landing` (its prompt requests, still waiting) running then, and `leaving` of
        the running requests gone: `schedule_prefill`'s test of the queue's head (FCFS: when
        the head waits, all do), without matching, evicting or taking pages. The overlapped
        loop asks it before dispatching a continuation (overlap.py): yes lands the step in
        flight first and admits; no (no free row, no pages, a mixin's hold) keeps decoding
        ahead while the request waits. `may_start` is asked as schedule_prefill asks it."""
        queue = [r for r in self.waiting if not any(r is q for q in landing)] if landing else (
            self.waiting)
        if not queue:
            return False
        running = len(self.running) + len(landing) - leaving
        if running >= self.max_running:
            return False
        if (self.mixed_steps and running >= self.max_prefill_tokens
                and self.prefill_backlog(queue) > self.max_prefill_tokens):
            return False  # schedule_mixed: the decode rows leave no prompt budget
        req = queue[0]
        if req.leader is not None and any(req.leader is q for q in landing):
            return True  # its leader's pages enter the prefix cache as it lands: schedule()
        if self.awaits_leader(req) or not self.may_start(req):
            return False
        return self.pages.admits(req, reserve=running)

    def awaits_leader(self, req: Req) -> bool:
        """Whether an n > 1 follower must wait: its leader (the first completion of the same
        prompt) is still waiting for its prefill here, and a prefix cache will hold the
        prompt's pages when it is done. Once it need not, it never waits again."""
        leader = req.leader
        if leader is None:
            return False
        if (self.prefix_cache is not None and leader.status == ReqStatus.WAITING
                and self.reqs.get(leader.rid) is leader):
            return True
        req.leader = None
        return False

    def may_start(self, req: Req) -> bool:
        """Whether a waiting request may be scheduled now (always here; P holds back requests
        whose KV copies would exceed `disaggregation.max_held_kv_pages`)."""
        return True

    def schedule_decode(self) -> ScheduledBatch | None:
        ps = self.page_size
        for req in [r for r in self.running if -(-r.seq_len // ps) > len(r.page_ids)]:
            if req not in self.running:
                continue  # preempted while growing an earlier request
            need = self.pages_for(req.seq_len) - len(req.page_ids)
            while need > 0 and not self.ensure_free(need):
                victim = self.pick_victim(exclude=req)
                if victim is None:
                    break
                self.preempt(victim)
            if need > 0:
                try:
                    req.page_ids.extend(self.alloc_pages(need))
                except OutOfPages:
                    self.finish_request(req, FinishReason.abort(
                        f"out of KV pages mid-decode ({self.allocator.num_free} free, "
                        f"{need} needed)", 503))
        if not self.running:
            return None
        make_chunk = self.make_chunk
        return ScheduledBatch("decode", list(self.running),
                              [make_chunk(decode_piece(r), r.num_computed, r.page_ids)
                               for r in self.running], num_decode=len(self.running))

    def row_params(self, req: Req, ahead: int = 0) -> RowParams:
        return sampler_row(req, ahead)

    def batch_rows(self, batch: ScheduledBatch) -> list[RowParams]:
        """The sampler's row of each request of `batch`. A prompt chunk that does not end its
        prompt samples a token nobody reads: it gets `DROPPED_ROW` (greedy, no penalty, no
        logprobs), so no penalty slot is built from a half-computed prompt and no dropped
        token is counted in one."""
        return [DROPPED_ROW if i >= batch.num_decode and not batch.completes[i - batch.num_decode]
                else self.row_params(req) for i, req in enumerate(batch.reqs)]

    def run_batch(self, batch: ScheduledBatch) -> None:
        self.fault.tick()  # testing: server.fault_inject_thread=scheduler kills the loop here
        sample = self.dispatch_step(batch, self.batch_rows(batch))
        result = sample and self.read_step(sample, batch.reqs, batch.kind)
        if result is not None:
            self.land_batch(batch, result)

    def land_batch(self, batch: ScheduledBatch, result: SampleResult) -> None:
        """A step's sampled tokens, read back (`run_batch`, or overlap.py's `land`): per
        decode row the token; per prompt chunk the computed tokens counted and, when it ends
        the prompt, the request out of `waiting` and `on_prefill_finished` with its first
        token. Requests that finished meanwhile (aborted) are skipped."""
        self.num_forward += 1
        self.num_mixed_steps += batch.kind == "mixed"
        self.num_decode_steps += batch.kind == "decode"
        self.land_decode_rows(batch, result)
        for i in range(batch.num_decode, len(batch.reqs)):  # prompt chunks
            req = batch.reqs[i]
            if req.finished:
                continue
            n = len(batch.chunks[i].token_ids)
            req.num_computed += n
            self.num_prefill_tokens += n
            self.metrics.prompt_tokens.inc(n)
            self.metrics.computed_tokens.inc(n)
            if not batch.completes[i - batch.num_decode]:
                continue
            if req.num_followers and self.prefix_cache is not None:
                # the other completions of this prompt start from these pages
                self.prefix_cache.insert(req.all_ids, req.page_ids, req.num_computed)
            self.waiting.remove(req)
            self.on_prefill_finished(req, int(result.tokens[i]),
                                     self.token_logprob(result, i, req))
