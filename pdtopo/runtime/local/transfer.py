"""The transfer stage: prefill engines -> transfer thread -> decode engines' backlogs.

`TransferItem`: a request whose prompt was prefilled (first output token already emitted) and
its prompt KV as packed per-entry arrays `[rows, page_size, kv_heads, head_dim]` gathered
from the prefill pool (copies: the prefill pages are already free again; the prompt's pages
first, `rows` their power-of-two bucket, so every program on the way compiles per bucket).
`TransferWorker.run()` (the transfer thread) takes items from the bounded transfer backlog,
picks the decode engine with the fewest active requests (`DecodeLoad`), moves the packed arrays
onto that engine's KV sharding with `jax.device_put` (device to device inside the process: ICI
on a TPU host, a host copy between emulated CPU devices), waits for the copy, puts the item into
the engine's bounded decode backlog and wakes the engine's thread. Blocking puts give
backpressure: a full decode backlog stalls the transfer thread, a full transfer backlog stalls
prefill. Every blocking put gives up when the process is stopping (`put_until`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax

from pdtopo.kernels.kv_heads import convert_heads
from pdtopo.runtime.local.board import DecodeLoad
from pdtopo.runtime.worker_threads import FaultInjector

KV_READY = "local_kv_ready"  # inbox message that wakes a decode engine
_POLL_S = 0.1


@dataclass
class TransferItem:
    req: Any
    packed: list[Any]
    prompt_len: int
    source: str                       # prefill engine name
    prefilled_at: float = field(default_factory=time.monotonic)
    target: int | None = None         # decode engine index, set by the transfer thread


def put_until(q: queue.Queue, item: Any, stopping: threading.Event) -> bool:
    """Blocking put that gives up (False) once `stopping` is set."""
    while not stopping.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class TransferStats:
    """Counters the transfer thread writes and `/pdtopo/state` reads (under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_transfers = 0
        self.seconds = 0.0
        self.bytes = 0
        self.pages = 0

    def add(self, seconds: float, nbytes: int, pages: int) -> None:
        with self._lock:
            self.num_transfers += 1
            self.seconds += seconds
            self.bytes += nbytes
            self.pages += pages

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"transfers": self.num_transfers, "transfer_seconds": self.seconds,
                    "transfer_bytes": self.bytes, "transfer_pages": self.pages}


class TransferWorker:
    """Body of the transfer thread (see the module docstring)."""

    def __init__(self, backlog: queue.Queue, decodes: list[Any], load: DecodeLoad,
                 fault: FaultInjector, stopping: threading.Event) -> None:
        self.backlog = backlog
        self.decodes = decodes
        self.load = load
        self.fault = fault
        self.stopping = stopping
        self.stats = TransferStats()
        self.unplaced: list[TransferItem] = []  # read only after the thread has ended

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                item = self.backlog.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self.fault.tick()
            self.move(item)

    def move(self, item: TransferItem) -> None:
        i = self.load.pick_and_acquire()
        engine = self.decodes[i]
        t0 = time.perf_counter()
        runner = engine.runner  # its KV heads may be repeated differently from prefill's
        packed = convert_heads(item.packed, runner.model_config.num_kv_heads,
                               runner.config.num_kv_heads)
        item.packed = jax.block_until_ready(jax.device_put(packed, runner.kv_sharding))
        item.target = i
        self.stats.add(time.perf_counter() - t0, sum(int(a.nbytes) for a in item.packed),
                       -(-item.prompt_len // runner.page_size))  # rows past these: padding
        if not put_until(engine.backlog, item, self.stopping):
            self.unplaced.append(item)
            return
        engine.inbox.put((KV_READY, None))
