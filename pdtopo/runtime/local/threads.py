"""Worker threads whose crash fails the whole process loudly (tpu-inference's JetThread).

`WorkerThread(name, target, on_crash)` runs `target()`; if it raises anything (an exception, or
`InjectedCrash`) the thread calls `on_crash(name, exc)`. The default, `crash_process`, logs the
traceback at CRITICAL and ends the process with exit status `CRASH_EXIT_CODE` via `os._exit`, so
supervisord (autorestart) starts a fresh one: a serving process never keeps running with a
silently dead prefill, transfer or decode thread. In-process tests pass their own `on_crash`.

`FaultInjector` is the `local.fault_inject_thread` / `local.fault_inject_after_steps` knob:
the named worker raises `InjectedCrash` at its N-th busy step (a batch run, a transfer). It
derives from BaseException on purpose: the engine loop recovers from ordinary step errors by
failing the batch's requests, and the injected fault models a failure that escapes that
recovery, i.e. a thread that dies.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable

log = logging.getLogger("pdtopo.local")

CRASH_EXIT_CODE = 70  # EX_SOFTWARE

CrashHandler = Callable[[str, BaseException], None]


class InjectedCrash(BaseException):
    """Raised by `FaultInjector` inside the worker it targets."""


def crash_process(name: str, exc: BaseException) -> None:
    """Log and end the process at once with a non-zero status (no cleanup: it is broken)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log.critical("worker thread %s crashed; exiting the process with status %d:\n%s",
                 name, CRASH_EXIT_CODE, tb)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)


class WorkerThread(threading.Thread):
    """A daemon thread that reports (never swallows) the exception that ends its target."""

    def __init__(self, name: str, target: Callable[[], None], on_crash: CrashHandler):
        super().__init__(name=name, daemon=True)
        self._work = target
        self._on_crash = on_crash
        self.crashed: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # noqa: BLE001 - every death must be loud
            self.crashed = exc
            self._on_crash(self.name, exc)


class FaultInjector:
    """Counts a worker's busy steps; raises `InjectedCrash` at step `after` if it is the target."""

    def __init__(self, worker: str, target: str | None, after: int):
        self.worker = worker
        self.armed = target is not None and target == worker
        self.after = max(1, int(after))
        self.steps = 0

    def tick(self) -> None:
        if not self.armed:
            return
        self.steps += 1
        if self.steps >= self.after:
            self.armed = False
            raise InjectedCrash(f"fault injected into {self.worker} at step {self.steps} "
                                f"(local.fault_inject_thread={self.worker})")
