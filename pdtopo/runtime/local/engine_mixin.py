"""What every engine of a local-disaggregation process shares: `LocalEngineMixin`.

It sits in front of the ordinary `Scheduler` (behind the role mixin) and adds: the engine's
name, its warmup, its thread as a `WorkerThread` (a crash ends the process), its fault
injector (`local.fault_inject_thread`; the engine ticks it at every batch), the process-wide
`RequestBoard` (every finished or refused request is dropped from it) and the process's
`stopping` event.
"""

from __future__ import annotations

import threading
from typing import Any

from pdtopo.runtime.engine.request import Req
from pdtopo.runtime.local.board import RequestBoard
from pdtopo.runtime.worker_threads import CrashHandler, FaultInjector, WorkerThread


class LocalEngineMixin:
    def __init__(self, *args: Any, engine_name: str, board: RequestBoard,
                 fault: FaultInjector, on_crash: CrashHandler, stopping: threading.Event,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine_name = engine_name
        self.board = board
        self.fault = fault
        self.on_crash = on_crash
        self.stopping = stopping

    def warmup_engine(self) -> None:
        """Compile the runner's step buckets and the sampler (before `start()`)."""
        self.runner.warmup()
        self.warmup()

    def start(self) -> None:
        self._thread = WorkerThread(self.engine_name, self.event_loop, self.on_crash)
        self._thread.start()

    @property
    def thread_alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def finish_request(self, req: Req, reason: dict[str, Any]) -> None:
        super().finish_request(req, reason)
        self.board.finished(req)

    def refuse_request(self, req: Req, reason: dict[str, Any]) -> None:
        super().refuse_request(req, reason)
        self.board.finished(req)  # by identity: a refused duplicate leaves the live request

    def local_state(self) -> dict[str, Any]:
        return {}
