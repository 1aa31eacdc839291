"""The continuous-batching scheduler: the one thread that owns the model runner, the KV pool
(`runner.kv_caches`) and the page allocator.

Data flow. HTTP handlers (asyncio) build validated `Req`s and call `submit(req)` / `abort(rid)`;
both only put a message into the thread-safe `inbox`. The scheduler thread runs `event_loop()`,
whose iteration is `step()`:

    drain_inbox()            -> handle_new_request(req) / handle_abort(rid) / flush_cache
    schedule()               -> with engine.mixed_steps, requests running and more prompt
                                tokens waiting than one step's budget: schedule_mixed()
                                (schedule_decode's rows, then
                                schedule_prefill's chunks in the budget left); else
                                schedule_prefill() (waiting queue, token budget
                                engine.max_prefill_tokens, a new request starts after its
                                longest cached prefix (match_prefix), admission by free
                                pages, chunked when a prompt exceeds the budget), else
                                schedule_decode() (every running request, growing page
                                tables, preempting the newest requests when pages run out);
                                the prefix cache gives back unreferenced pages first
                                (ensure_free)
    run_batch(batch)         -> runner.forward(chunks), Sampler, then per request
                                on_prefill_finished(req, token) or process_new_token(req, token)
                                (with engine.overlap_schedule a decode batch is launched instead
                                and landed by the next step, which first dispatches its
                                continuation: overlap.py)
    publish_stats()          -> counters for /pdtopo/state, /get_load and Prometheus
    idle_wait()              -> when there is nothing to run: block on the inbox briefly

Outputs go to each request's sink (`ReqOutput`: new tokens; the finish reason at the end).
A step that fails ends its own requests (`fail_batch`), or everything when it cost the engine
its device state (a device error, the pool donated and lost: `step_error_is_fatal`): then
`fail_engine` answers every request 503 and ends the thread, and with it the process
(step_errors.py).

Extension points for the PD mixins (override, call super() where it makes sense):
- `handle_new_request(req)`: a validated request arrives (P/D may route it to their own queues);
  `reject_if_invalid(req)` and `register_request(req)` are its two halves, for mixins to reuse.
  A request refused before it is registered (never served, or its rid is live: a duplicate)
  ends through `refuse_request(req, reason)`, which touches nothing keyed by its rid.
- `on_prefill_finished(req, next_token)`: the prompt's KV is in the pool and the first output
  token is sampled. Default: `process_new_token` then `add_to_running`. P sends KV + token instead.
- `add_to_running(req)`: put a request whose prompt KV is in pages it owns (`req.page_ids`,
  `req.num_computed == len(req.prompt_ids)`) and whose first output token is known into the
  decode batch. D's path: call `process_new_token(req, first_token)` (it emits the token and
  checks stop conditions; it returns True if the request finished) and then `add_to_running`.
- `free_request(req)`: drop a request from the queues and release its pages (`release_kv`:
  its full computed pages go into the prefix cache first when `keeps_kv(req)`).
- `make_prefix_cache(eng)`: the engine's `PrefixCache` or None (D keeps none by default).
- `finish_request(req, reason)`: finish with a `FinishReason` dict, free, emit the final output.
- `may_start(req)`: whether `schedule_prefill` may start a waiting request now (P: its budget
  of held KV copies); a refusal keeps it and those behind it waiting.
- `has_work()`, `schedule()`, `step()`, `event_loop()`, `idle_wait()`: the loop itself; mixins
  with their own queues poll them in `step()` and report pending work in `has_work()`.
Helpers: `alloc_pages(n)`, `ensure_free(n)`, `pages_for(num_tokens)`, `make_chunk(...)`,
`emit(req)`, `page_problems()` (the allocator's references against the cache and every live
request's page table; docs/prefix-cache.md).
Requests carry `bootstrap_host/port/room` untouched for the mixins.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pdtopo.runtime.engine.host_kv import HostKVTier
from pdtopo.runtime.engine.metrics import EngineMetrics
from pdtopo.runtime.engine.model_runner import SeqChunk
from pdtopo.runtime.engine.overlap import OverlapMixin
from pdtopo.runtime.engine.page_allocator import OutOfPages, PageAllocator
from pdtopo.runtime.engine.penalties import PenaltyHistory
from pdtopo.runtime.engine.prefix_cache import PrefixCache, reference_problems
from pdtopo.runtime.engine.request import (
    FinishReason,
    Req,
    ReqOutput,
    ReqStatus,
    TokenLogprob,
)
from pdtopo.runtime.engine.sampling import RowParams, Sampler, SampleResult, penalty_slots_for
from pdtopo.runtime.engine.step_errors import (
    EngineStateLost,
    device_state_lost,
    is_device_error,
)
from pdtopo.runtime.worker_threads import CrashHandler, WorkerThread, crash_process, server_fault

log = logging.getLogger("pdtopo.scheduler")

_STOP = object()
EVICTABLE_REFRESH_S = 0.5  # how often a busy scheduler recounts the pages only its cache holds
ANSWER_GRACE_S = 0.5  # after a fatal step error: time the HTTP layer gets to send the answers


@dataclass
class ScheduledBatch:
    """One step's rows: `num_decode` decode rows (one token each) first, then prompt chunks."""

    kind: str                                  # "prefill" | "decode" | "mixed"
    reqs: list[Req]
    chunks: list[Any]
    completes: list[bool] = field(default_factory=list)  # per prompt chunk: the prompt's last?
    num_decode: int = 0

    @staticmethod
    def mixed(decode: ScheduledBatch, prefill: ScheduledBatch) -> ScheduledBatch:
        return ScheduledBatch("mixed", decode.reqs + prefill.reqs,
                              decode.chunks + prefill.chunks, prefill.completes,
                              num_decode=len(decode.reqs))


def stop_window(stops: list[str]) -> int:
    """How many trailing output tokens to decode to find any of `stops` ending in the newest
    token: a string of L characters spans at most 4L tokens (a byte-level token may carry one
    UTF-8 byte), plus a few so that the match never starts at the window's first token (where
    a decoder may drop a leading space). Earlier matches would have stopped earlier steps."""
    return 4 * max(len(s) for s in stops) + 4


def token_usage(stats: dict[str, Any]) -> float:
    """sglang's `token_usage`: the share of the pool requests hold. Pages only the prefix cache
    holds do not count (they are free on demand): a P with a warm cache is not a busy P, and
    routers that leave out workers above a usage ceiling must not see it as one."""
    total = max(1, stats["total_pages"])
    return max(0.0, (total - stats["free_pages"] - stats.get("evictable_pages", 0)) / total)


class Scheduler(OverlapMixin):
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
        self.max_model_len = eng.max_model_len
        self.max_prefill_tokens = eng.max_prefill_tokens
        self.mixed_steps = bool(eng.mixed_steps)
        # overlap.py: steady decode dispatches step N+1 before landing step N
        self.overlap = bool(eng.overlap_schedule) and getattr(runner, "supports_feed", False)
        self.in_flight = None
        self.max_running = eng.max_running_requests
        self.base_seed = eng.seed
        self.model_name = eng.served_model_name or str(ctx.cfg.model.name)
        self.metrics = metrics or EngineMetrics(self.model_name, getattr(ctx, "role", self.role))
        self.eos_ids = set(int(t) for t in (tokenizer.eos_token_ids or []))
        self.sampler = Sampler(penalty_slots=penalty_slots_for(self.max_running))
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._seed_rng = random.Random(self.base_seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self.num_forward = 0
        self.num_generated = 0
        self.num_prefill_tokens = 0
        self.num_mixed_steps = 0      # steps that carried decodes and prompt chunks together
        self.num_overlapped_steps = 0  # steps dispatched before the previous one landed
        self.num_preemptions = 0
        self.num_cached_tokens = 0    # prompt tokens whose KV came from the prefix cache
        self._page_check: tuple[int, list[str]] = (-1, [])  # (allocator version, problems)
        self._tput_window: deque[tuple[float, int]] = deque()
        self._evictable: tuple[float, int] = (-1e9, 0)  # (when counted, tree-only pages)
        self.alive = True
        # the loop runs as a WorkerThread: an exception that escapes its own recovery (or an
        # injected `server.fault_inject_thread=scheduler`) calls on_crash, which by default
        # ends the process (supervisord restarts it) instead of leaving /health 200
        self.on_crash: CrashHandler = crash_process
        self.fault = server_fault(ctx.settings, "scheduler")
        # testing: the runner's N-th step fails after the pool was donated (step_errors.py)
        self.step_fault_after = eng.fault_inject_step_error_after
        self.publish_stats()

    # ------------------------------------------------------------------ thread-safe API
    def submit(self, req: Req) -> None:
        """Hand a validated request to the scheduler thread."""
        self.inbox.put(("new", req))

    def abort(self, rid: str, only: Req | None = None) -> None:
        """Abort a request (client gone); its pages are freed on the scheduler thread.
        `only`: abort the live request with this rid only if it is that object (the HTTP layer
        passes its own request, so a refused duplicate's client cannot abort the original)."""
        self.inbox.put(("abort", (rid, only)))

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

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return dict(self._stats)

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
        self.inbox.put((_STOP, None))
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
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # a bug in one step must not kill the server ...
                if self.step_error_is_fatal(exc):  # ... unless its device state is lost
                    self.fail_engine(exc)
                log.exception("scheduler step failed; failing in-flight requests")
                for req in list(self.reqs.values()):
                    self.finish_request(req, FinishReason.abort(f"engine error: {exc}"))
        for req in list(self.reqs.values()):
            self.finish_request(req, FinishReason.abort("server shutting down", 503))
        self.alive = False
        self.publish_stats()
        log.info("scheduler loop stopped")

    def step_error_is_fatal(self, exc: BaseException) -> bool:
        """Whether a step's exception leaves this engine unable to run another step: a device
        error, or an array of its device state donated and not replaced (step_errors.py)."""
        return is_device_error(exc) or device_state_lost(self.device_state())

    def device_state(self) -> list[Any]:
        """The device arrays that steps donate: the KV pool and the penalty tables."""
        arrays = list(getattr(self.runner, "kv_caches", None) or [])
        tables = self.sampler.tables
        if tables is not None:
            arrays += [tables.counts, tables.seen]
        return arrays

    def fail_engine(self, exc: BaseException) -> NoReturn:
        """A step failed and took the engine's device state with it: /health 503 at once,
        every request held answered with a retryable 503, a moment for the HTTP layer to send
        those answers, then `EngineStateLost` ends this thread, and `on_crash` the process
        (status 70; supervisord starts a fresh one)."""
        self.alive = False
        log.critical("engine step failed and its device state is lost (%s: %s); answering "
                     "%d request(s) and ending the process", type(exc).__name__, exc,
                     len(self.reqs))
        reason = FinishReason.abort(f"engine error: {exc}; the server restarts (retry the "
                                    "request)", 503)
        answered = 0
        for req in list(self.reqs.values()):
            try:
                self.finish_request(req, reason)
                answered += 1
            except Exception:  # noqa: BLE001 - the others still get theirs; the exit follows
                log.exception("could not end %s", req.rid)
        self.in_flight = None
        try:
            self.publish_stats()
        except Exception:  # noqa: BLE001 - the exit follows
            log.exception("could not publish the final stats")
        if answered:
            time.sleep(ANSWER_GRACE_S)
        raise EngineStateLost(f"engine device state lost: {type(exc).__name__}: {exc}") from exc

    def step(self) -> None:
        self.drain_inbox()
        landing = self.in_flight is not None
        if self.overlap_step():  # a continuation of the step in flight was dispatched
            self.publish_stats()
            return
        batch = self.schedule()
        if batch is None:
            self.publish_stats()
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
        elif kind is _STOP:
            self._stop.set()
        else:
            raise ValueError(f"unknown scheduler message {kind!r}")

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

    def finish_request(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        self.free_request(req)
        req.status = ReqStatus.FINISHED
        if self.reqs.get(req.rid) is req:  # never another request that reuses the rid
            del self.reqs[req.rid]
        self.emit(req)
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)
        self.metrics.request_finished(reason.get("type", "unknown"))

    def free_request(self, req: Req) -> None:
        """Drop a request from the queues and return its pages to the pool."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.sampler.release(req.serial)
        self.release_kv(req, keep=self.keeps_kv(req))

    def emit(self, req: Req) -> None:
        new = req.output_ids[req.num_emitted:]
        if not new and not req.finished:
            return
        logprobs = (req.output_logprobs[req.num_emitted:len(req.output_ids)]
                    if req.sampling.logprobs >= 0 else None)
        req.num_emitted = len(req.output_ids)
        req.sink.emit(ReqOutput(
            rid=req.rid, new_token_ids=list(new), num_output_tokens=len(req.output_ids),
            prompt_tokens=len(req.prompt_ids), finished=req.finished,
            finish_reason=req.finish_reason, cached_tokens=req.cached_tokens,
            timeline=req.timeline, new_logprobs=logprobs))

    def add_to_running(self, req: Req) -> None:
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def on_prefill_finished(self, req: Req, next_token: int,
                            logprob: TokenLogprob | None = None) -> None:
        if not self.process_new_token(req, next_token, logprob):
            self.add_to_running(req)

    def process_new_token(self, req: Req, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Append a sampled token (and its logprob, when the request asked for them), emit it,
        finish the request if a stop condition holds."""
        now = time.monotonic()
        req.output_ids.append(int(token))
        if req.sampling.logprobs >= 0:
            req.output_logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.metrics.itl.observe(now - req.last_token_time)
            self.metrics.tpot.observe(now - req.last_token_time)
        req.last_token_time = now
        self.num_generated += 1
        self.metrics.generation_tokens.inc()
        reason = self.check_stop(req)
        if reason is not None:
            self.finish_request(req, reason)
            return True
        self.emit(req)
        return False

    def check_stop(self, req: Req) -> dict[str, Any] | None:
        sp = req.sampling
        tok = req.output_ids[-1]
        if len(req.output_ids) >= sp.max_new_tokens or req.seq_len >= self.max_model_len:
            return FinishReason.length(len(req.output_ids))
        if not sp.ignore_eos and tok in self.eos_ids:
            return FinishReason.stop_token(tok)
        if tok in sp.stop_token_ids:
            return FinishReason.stop_token(tok)
        if sp.stop:
            text = self.tokenizer.decode(req.output_ids[-stop_window(sp.stop):])
            for s in sp.stop:
                if s in text:
                    return FinishReason.stop_str(s)
        return None

    # ------------------------------------------------------------------ pages
    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def alloc_pages(self, n: int) -> list[int]:
        self.ensure_free(n)
        return self.allocator.alloc(n)

    def ensure_free(self, n: int) -> bool:
        """Whether `n` pages are free, after evicting unreferenced prefix-cache pages (LRU)
        if too few were: the cache gives way before any request is preempted or waits."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.num_free >= n

    # ------------------------------------------------------------------ prefix cache
    def make_prefix_cache(self, eng) -> PrefixCache | None:
        """The engine's prefix cache (`engine.prefix_cache`), with a host tier of
        `engine.host_kv_pages` pages when that is above 0; role mixins that keep none (D
        without `disaggregation.decode_prefix_cache`) return None."""
        if not eng.prefix_cache:
            return None
        host = HostKVTier(self.runner, eng.host_kv_pages) if eng.host_kv_pages else None
        return PrefixCache(self.allocator, self.page_size, host)

    @property
    def host_tier(self) -> HostKVTier | None:
        """The prefix cache's host tier, if it has one."""
        return self.prefix_cache.host if self.prefix_cache is not None else None

    def match_prefix(self, req: Req) -> None:
        """Start a request that holds no KV at its longest cached prefix: full pages only, and
        never its last token (the logits of the next token come from a forward pass)."""
        if self.prefix_cache is None or req.page_ids:
            return
        pages = self.prefix_cache.match(req.all_ids, (req.seq_len - 1) // self.page_size)
        req.page_ids = pages
        req.num_computed = len(pages) * self.page_size
        if not req.num_preemptions:  # what the client sees: the prompt's hit on arrival
            req.cached_tokens = min(req.num_computed, len(req.prompt_ids))

    def keeps_kv(self, req: Req) -> bool:
        """Whether a request's computed pages go into the prefix cache when it lets them go:
        when it finished normally or is preempted; never after an abort or a failure (its KV
        may be incomplete or the engine may be broken)."""
        reason = req.finish_reason
        return reason is None or reason.get("type") in ("length", "stop")

    def release_kv(self, req: Req, keep: bool) -> None:
        """Give up a request's pages: offer its full computed pages to the prefix cache first
        (`keep`), then drop the request's references (pages the cache or others hold stay)."""
        if req.page_ids:
            if keep and self.prefix_cache is not None:
                self.prefix_cache.insert(req.all_ids, req.page_ids, req.num_computed)
            self.allocator.free(req.page_ids)
            req.page_ids = []
        req.num_computed = 0

    def page_problems(self) -> list[str]:
        """Disagreements between the allocator's references and their holders (the prefix
        cache and every live request's page table); empty when consistent."""
        tables = [r.page_ids for r in self.reqs.values()]
        if self.prefix_cache is not None:  # the tree's structure and its host tier too
            return self.prefix_cache.problems(tables)
        return reference_problems(self.allocator, None, tables)

    def _idle_page_problems(self) -> list[str]:
        version = self.allocator.version
        if self._page_check[0] != version:
            self._page_check = (version, self.page_problems()[:5])
        return self._page_check[1]

    def flush_cache(self) -> Future:
        """Thread-safe: empty the prefix cache of every page no request holds (on the scheduler
        thread); the future's result says what was freed and what is still held."""
        fut: Future = Future()
        self.inbox.put(("flush_cache", fut))
        return fut

    def flush_caches(self) -> list[Future]:
        """The futures of every engine this object schedules (one here; see local mode)."""
        return [self.flush_cache()]

    def _flush_cache(self) -> dict[str, Any]:
        cache = self.prefix_cache
        host_pages = cache.num_host_pages if cache is not None else 0
        freed = cache.flush() if cache is not None else 0
        return {"prefix_cache": cache is not None, "flushed_pages": freed,
                "flushed_host_pages": host_pages,
                "tree_pages": cache.num_pages if cache is not None else 0,
                "num_reqs": len(self.reqs), "free_pages": self.allocator.num_free,
                "total_pages": self.allocator.num_total}

    def make_chunk(self, token_ids: list[int], start_pos: int, page_ids: list[int]):
        return SeqChunk(list(token_ids), int(start_pos), list(page_ids))

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

    # ------------------------------------------------------------------ batches
    def schedule(self) -> ScheduledBatch | None:
        if self.mixed_steps and self.running and self.prefill_backlog() > self.max_prefill_tokens:
            return self.schedule_mixed()
        return self.schedule_prefill() or self.schedule_decode()

    def prefill_backlog(self) -> int:
        """Prompt tokens the waiting requests still need. Mixing pays when prefilling them
        alone would hold the running decodes for more than one step; one short prefill step
        runs alone, as cheap for the decodes as a mixed one and cheaper for the batch."""
        return sum(r.seq_len - r.num_computed for r in self.waiting)

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
            remaining = req.seq_len - req.num_computed
            n = min(remaining, budget)
            tokens = req.all_ids[req.num_computed:req.num_computed + n]
            if req.prefill_start_time is None:
                req.prefill_start_time = time.monotonic()
            batch.reqs.append(req)
            batch.chunks.append(self.make_chunk(tokens, req.num_computed, req.page_ids))
            batch.completes.append(n == remaining)
            budget -= n
        return batch if batch.reqs else None

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
        for req in list(self.running):
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
        batch = ScheduledBatch("decode", list(self.running), [], num_decode=len(self.running))
        for req in batch.reqs:
            tokens = req.all_ids[req.num_computed:]
            batch.chunks.append(self.make_chunk(tokens, req.num_computed, req.page_ids))
        return batch

    def row_params(self, req: Req, ahead: int = 0) -> RowParams:
        """Row settings of req's next token; `ahead`: tokens sampled but not landed yet."""
        sp = req.sampling
        return RowParams(sp.temperature, sp.top_k, sp.top_p, int(sp.seed or 0),
                         len(req.output_ids) + ahead, min_p=sp.min_p,
                         presence_penalty=sp.presence_penalty,
                         frequency_penalty=sp.frequency_penalty,
                         repetition_penalty=sp.repetition_penalty, logprobs=sp.logprobs,
                         history=PenaltyHistory(req.serial, req.prompt_ids, req.output_ids))

    @staticmethod
    def token_logprob(result: SampleResult, i: int, req: Req) -> TokenLogprob | None:
        """Row i's logprob for `req`, if it asked for logprobs."""
        n = req.sampling.logprobs
        if n < 0 or result.logprobs is None:
            return None
        logprob, top = result.token_logprob(i, n)
        return TokenLogprob(logprob, tuple(top))

    def run_batch(self, batch: ScheduledBatch) -> None:
        self.fault.tick()  # testing: server.fault_inject_thread=scheduler kills the loop here
        sample = self.dispatch_step(batch.reqs, batch.chunks, batch.kind)
        result = sample and self.read_step(sample, batch.reqs, batch.kind)
        if result is None:
            return
        self.num_forward += 1
        self.num_mixed_steps += batch.kind == "mixed"
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            n = len(batch.chunks[i].token_ids)
            req.num_computed += n
            if i >= batch.num_decode:  # a prompt chunk
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
            else:
                self.process_new_token(req, int(result.tokens[i]),
                                       self.token_logprob(result, i, req))

    # ------------------------------------------------------------------ stats
    def _evictable_pages(self, now: float) -> int:
        """Pages only the prefix cache holds (it frees them on demand). With no request alive
        that is the whole tree; otherwise the count walks the tree, so it is refreshed at most
        every EVICTABLE_REFRESH_S (a load signal, read by routers every few seconds)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        if not self.reqs:
            self._evictable = (now, cache.num_pages)
        elif now - self._evictable[0] >= EVICTABLE_REFRESH_S:
            self._evictable = (now, cache.num_evictable())
        return min(self._evictable[1], cache.num_pages)

    def _host_tier_stats(self) -> dict[str, Any]:
        """The prefix cache's host tier: pages held and their bound, pages loaded back (hits)
        and copied out (spilled), bytes moved each way; zeros without a tier."""
        cache, host = self.prefix_cache, self.host_tier
        if host is None:
            return dict.fromkeys(("host_kv_pages", "host_kv_capacity", "host_hit_pages",
                                  "host_spilled_pages", "host_bytes_to_host",
                                  "host_bytes_to_device"), 0)
        return {"host_kv_pages": cache.num_host_pages, "host_kv_capacity": host.capacity,
                "host_hit_pages": cache.num_host_hits, "host_spilled_pages": cache.num_spilled,
                "host_bytes_to_host": host.bytes_to_host,
                "host_bytes_to_device": host.bytes_to_device}

    def extra_stats(self) -> dict[str, Any]:
        """More counters for the same snapshot (the PD mixins add theirs)."""
        return {}

    def publish_stats(self) -> None:
        now = time.monotonic()
        win = self._tput_window
        win.append((now, self.num_generated))
        while len(win) > 2 and now - win[0][0] > 5.0:
            win.popleft()
        dt = now - win[0][0]
        tput = (self.num_generated - win[0][1]) / dt if dt > 0 else 0.0
        num_tokens = sum(r.seq_len for r in self.running) + sum(r.seq_len for r in self.waiting)
        evictable = self._evictable_pages(now)
        stats = {
            "free_pages": self.allocator.num_free,
            "total_pages": self.allocator.num_total,
            "page_size": self.page_size,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_reqs": len(self.reqs),
            "num_tokens": num_tokens,
            "num_forward": self.num_forward,
            "num_generated": self.num_generated,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_mixed_steps": self.num_mixed_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
            "num_preemptions": self.num_preemptions,
            "prefix_cache": self.prefix_cache is not None,
            "tree_pages": self.prefix_cache.num_pages if self.prefix_cache is not None else 0,
            "cached_tokens": self.num_cached_tokens,
            "evicted_pages": self.prefix_cache.num_evicted if self.prefix_cache is not None else 0,
            "evictable_pages": evictable,
            **self._host_tier_stats(),
            # checked only when idle, and again only after the pool changed (the full check
            # runs in tests at any time)
            "page_problems": None if self.reqs else self._idle_page_problems(),
            "gen_throughput": tput,
            "alive": self.alive,
            **self.extra_stats(),
        }
        with self._stats_lock:  # one replacement: a reader never sees half of a snapshot
            self._stats = stats
        m = self.metrics
        m.num_running.set(stats["num_running"])
        m.num_queue.set(stats["num_waiting"])
        m.gen_throughput.set(tput)
        m.free_pages.set(stats["free_pages"])
        m.total_pages.set(stats["total_pages"])
        m.token_usage.set(token_usage(stats))
        m.tree_pages.set(stats["tree_pages"])
        m.set_host_tier(stats)
        m.evictable_pages.set(stats["evictable_pages"])
        m.set_cache_hits(self.num_cached_tokens, self.num_cached_tokens + self.num_prefill_tokens)
