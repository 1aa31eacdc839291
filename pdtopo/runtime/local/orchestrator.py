"""`LocalOrchestrator`: the engines, queues and threads of a local-disaggregation process, and
the scheduler-like facade the HTTP app drives (`ServerState.scheduler`).

Threads (each a `WorkerThread`: its crash ends the process):
  prefill_K  one per prefill engine (the engine's event loop; owns the prefill pool)
  transfer   the `TransferWorker` (owns the items it is moving)
  decode_K   one per decode engine (the engine's event loop; owns that decode pool)
Queues: one bounded transfer backlog (prefill -> transfer), one bounded backlog per decode
engine (transfer -> decode_K), plus each engine's own inbox (new requests, aborts, wake-ups).
Shared state: `RequestBoard` and `DecodeLoad` (board.py), `TransferStats`, the gauge board,
each with its own lock. Nothing else crosses threads.

Facade (thread-safe, called from the HTTP event loop): `submit(req)` (round robin over prefill
engines), `abort(rid)` (marked on the board, sent to every engine), `check_fits`, `stats()`
(process totals plus `engines`: every engine's pool and queues; `attention`: the engines'
distinct attention paths), `alive`, `warmup()`,
`start()`, `stop()`, `flush_caches()`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any

from pdtopo.runtime.engine.attention_fallback import AttentionPath, attention_label
from pdtopo.runtime.engine.request import FinishReason
from pdtopo.runtime.local.board import DecodeLoad, RequestBoard
from pdtopo.runtime.local.transfer import TransferItem, TransferWorker
from pdtopo.runtime.worker_threads import CrashHandler, WorkerThread

log = logging.getLogger("pdtopo.local")

_SUMMED = ("free_pages", "total_pages", "num_running", "num_waiting", "num_tokens",
           "num_forward", "num_generated", "num_prefill_tokens", "num_preemptions",
           "gen_throughput", "tree_pages", "cached_tokens")


class LocalOrchestrator:
    role = "local"

    def __init__(self, prefills: list[Any], decodes: list[Any], *, transfer_backlog: queue.Queue,
                 transfer: TransferWorker, board: RequestBoard, load: DecodeLoad,
                 stopping: threading.Event, on_crash: CrashHandler) -> None:
        if not prefills or not decodes:
            raise ValueError("a local process needs at least one prefill and one decode engine")
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.transfer_backlog = transfer_backlog
        self.transfer = transfer
        self.board = board
        self.load = load
        self.stopping = stopping
        self._on_crash = on_crash
        self._rr = itertools.count()
        self._transfer_thread: WorkerThread | None = None
        self._crashed: list[str] = []
        self._crash_lock = threading.Lock()
        self._started = False
        self._stopped = False

    @property
    def engines(self) -> list[Any]:
        return self.prefills + self.decodes

    # ------------------------------------------------------------------ lifecycle
    def warmup(self) -> None:
        """Compile every engine's step and sampler shapes (before `start()`)."""
        for e in self.engines:
            e.warmup_engine()

    def compile_count(self) -> int:
        return sum(e.runner.compile_count() for e in self.engines)

    def attention_paths(self) -> list[AttentionPath]:
        """Every engine's attention path (each runner may fall back on its own)."""
        return [p for e in self.engines for p in e.attention_paths()]

    def _crash(self, name: str, exc: BaseException) -> None:
        with self._crash_lock:
            self._crashed.append(name)
        self._on_crash(name, exc)

    def start(self) -> None:
        for e in self.engines:
            e.on_crash = self._crash
            e.start()
        self._transfer_thread = WorkerThread("transfer", self.transfer.run, self._crash)
        self._transfer_thread.start()
        self._started = True
        log.info("local disaggregation: %s -> transfer -> %s",
                 ", ".join(e.engine_name for e in self.prefills),
                 ", ".join(e.engine_name for e in self.decodes))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop prefill, then transfer, then decode; end whatever is still queued (503)."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping.set()
        for e in self.prefills:
            e.stop(timeout)
        if self._transfer_thread is not None:
            self._transfer_thread.join(timeout)
        for e in self.decodes:
            e.stop(timeout)
        leftovers: list[TransferItem] = list(self.transfer.unplaced)
        for q in [self.transfer_backlog, *(d.backlog for d in self.decodes)]:
            while True:
                try:
                    leftovers.append(q.get_nowait())
                except queue.Empty:
                    break
        for d in self.decodes:
            if d.held is not None:
                leftovers.append(d.held)
                d.held = None
        for item in leftovers:  # every thread has ended: this thread owns them now
            self.decodes[0].finish_request(item.req,
                                           FinishReason.abort("server shutting down", 503))
        log.info("local disaggregation stopped (%d queued requests ended)", len(leftovers))

    @property
    def alive(self) -> bool:
        if self._crashed or self._stopped:
            return False
        if not self._started:
            return True
        t = self._transfer_thread
        return (t is not None and t.is_alive()
                and all(e.alive and e.thread_alive for e in self.engines))

    # ------------------------------------------------------------------ requests
    def submit(self, req) -> None:
        self.prefills[next(self._rr) % len(self.prefills)].submit(req)

    def abort(self, rid: str, only=None) -> None:
        """`only`: abort the live request with this rid only if it is that object."""
        self.board.abort(rid, only)
        for e in self.engines:
            e.abort(rid, only)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> str | None:
        for e in self.engines:
            err = e.check_fits(prompt_len, max_new_tokens)
            if err is not None:
                return f"{e.engine_name}: {err}"
        return None

    def flush_caches(self) -> list[Any]:
        """Every engine's `flush_cache()` future (POST /flush_cache)."""
        return [e.flush_cache() for e in self.engines]

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, Any]:
        per = {e.engine_name: {**e.stats(), **e.local_state(), "role": e.role}
               for e in self.engines}
        out: dict[str, Any] = {k: sum(s.get(k, 0) for s in per.values()) for k in _SUMMED}
        in_flight = self.transfer_backlog.qsize() + sum(
            s.get("backlog", 0) + int(bool(s.get("held"))) for s in per.values())
        out["num_waiting"] += in_flight
        out.update({
            "page_size": self.prefills[0].page_size,
            "prefix_cache": any(s.get("prefix_cache") for s in per.values()),
            "num_reqs": self.board.num_live(),
            "alive": self.alive,
            "attention": attention_label(self.attention_paths()),
            "crashed_threads": list(self._crashed),
            "local_transfer_backlog": self.transfer_backlog.qsize(),
            "local_transfer_backlog_capacity": self.transfer_backlog.maxsize,
            "local_decode_load": self.load.snapshot(),
            **{f"local_{k}": v for k, v in self.transfer.stats.snapshot().items()},
            "engines": per,
        })
        return out
