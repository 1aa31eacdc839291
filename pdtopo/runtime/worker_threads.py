"""Worker threads whose death fails the whole process loudly (tpu-inference's JetThread).

Every long-lived thread of a serving process runs as a `WorkerThread(name, target, on_crash)`:
if `target()` raises anything (an exception, or `InjectedCrash`) the thread calls
`on_crash(name, exc)`. The default, `crash_process`, logs the traceback at CRITICAL and ends the
process with exit status `CRASH_EXIT_CODE` via `os._exit`: its /health stops answering, the
router drops it and supervisord (autorestart) starts a fresh one. A serving process never keeps
running, and answering /health 200, with a silently dead scheduler, side-channel, transfer
sweep, bootstrap keeper or lockstep control thread. In-process tests pass their own `on_crash`.

`FaultInjector(worker, target, after)` is the testing knob behind `server.fault_inject_thread`
/ `server.fault_inject_after_steps` (P/D/colocated servers; the threads
`pdtopo.config.settings.FAULT_THREADS` names) and
`local.fault_inject_thread` / `local.fault_inject_after_steps` (local mode): the named worker
raises `InjectedCrash` at its N-th busy step (a batch, a side-channel wake-up, a sweep with
registered KV, a heartbeat, a control-channel wake-up). `InjectedCrash` derives from
BaseException on purpose: the loops recover from ordinary errors, and the injected fault models
a failure that escapes that recovery, i.e. a thread that dies.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pdtopo.threads")

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
    try:  # also on the process's own stderr: a handler may write to a replaced or closed
        # stream (a test runner's capture), and the exit must never be silent
        sys.__stderr__.write(f"worker thread {name} crashed; exiting with status "
                             f"{CRASH_EXIT_CODE}:\n{tb}")
        sys.__stderr__.flush()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
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

    def __init__(self, worker: str, target: str | None, after: int,
                 setting: str = "local.fault_inject_thread"):
        self.worker = worker
        self.setting = setting
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
                                f"({self.setting}={self.worker})")


NO_FAULT = FaultInjector("none", None, 1)  # a worker nobody targets


def server_fault(settings: Any, worker: str) -> FaultInjector:
    """The injector of one server thread (`worker` in FAULT_THREADS) from the process's
    `RuntimeSettings` (`server.fault_inject_thread`, `server.fault_inject_after_steps`)."""
    srv = settings.server
    return FaultInjector(worker, srv.fault_inject_thread, srv.fault_inject_after_steps,
                         setting="server.fault_inject_thread")
