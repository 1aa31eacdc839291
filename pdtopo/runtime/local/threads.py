"""Local mode's worker threads: the process-wide mechanism of `pdtopo.runtime.worker_threads`
(`WorkerThread`, `crash_process`, `InjectedCrash`, `FaultInjector`), re-exported under the
names local mode has always used. A local worker's crash ends the process; the
`local.fault_inject_thread` / `local.fault_inject_after_steps` knob makes the named worker
(prefill_K | transfer | decode_K) raise `InjectedCrash` at its N-th busy step.
"""

from __future__ import annotations

from pdtopo.runtime.worker_threads import (
    CRASH_EXIT_CODE,
    CrashHandler,
    FaultInjector,
    InjectedCrash,
    WorkerThread,
    crash_process,
)

__all__ = ["CRASH_EXIT_CODE", "CrashHandler", "FaultInjector", "InjectedCrash", "WorkerThread",
           "crash_process"]
