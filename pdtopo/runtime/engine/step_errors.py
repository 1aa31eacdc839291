"""Which failures of an engine step the server survives, and which end its process.

A step hands device state to its programs: the KV pool (`ModelRunner.kv_caches`, donated to
every layer program, to D's KV scatter and to the host tier's loads) and the sampler's penalty
tables (donated to `_sample` and to a slot's rebuild). JAX deletes a donated array when the
program is dispatched; the program's outputs replace it only when the call returns. The
scheduler sorts a step's exception (`Scheduler.step_error_is_fatal`) into

  per request: raised before anything was donated, or after the donated state was taken back
      whole: host-side packing and validation (`ModelRunner._validate`, `prepare_step`, the
      sampler's row parameters and slot map), a bug in the step's bookkeeping. The step's
      requests fail (`fail_batch`: 500 `engine error: ...`) and the server goes on.
  fatal: a device error (`is_device_error`: jaxlib's `JaxRuntimeError`, `XlaRuntimeError` in
      older releases: an XLA runtime failure, device memory exhausted), or any error after which
      an array the engine holds was donated and not replaced (`device_state_lost`): every later
      step would fail on it while /health answered 200. The scheduler answers every request it
      holds (503, retryable), then its thread ends with `EngineStateLost`: /health 503 and the
      process exits with status 70 (`worker_threads.crash_process`); supervisord restarts it.

`StepErrorsMixin`, mixed into the `Scheduler`, does both: `step_error_is_fatal` sorts (the
donated arrays are `device_state()`), `fail_engine` answers and ends the thread.

`StepFault` is the testing knob `engine.fault_inject_step_error_after`: the runner's N-th step
raises `InjectedStepError` (a plain RuntimeError, not a device error) after its programs took
the pool and before the runner takes their output pool back, so the pool is gone exactly as
after a real mid-step failure, and only the donation check can tell.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, NoReturn

from pdtopo.runtime.engine.request import FinishReason

log = logging.getLogger("pdtopo.scheduler")

# class names of jaxlib's runtime errors (JaxRuntimeError; XlaRuntimeError before it)
DEVICE_ERROR_NAMES = frozenset({"JaxRuntimeError", "XlaRuntimeError"})
STEP_FAULT_SETTING = "engine.fault_inject_step_error_after"
ANSWER_GRACE_S = 0.5  # after a fatal step error: time the HTTP layer gets to send the answers


class EngineStateLost(RuntimeError):
    """The engine's device state is unusable: raised to end the scheduler thread."""


class InjectedStepError(RuntimeError):
    """Raised by `StepFault` in the middle of a step (testing)."""


def is_device_error(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from, is a jaxlib runtime error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in DEVICE_ERROR_NAMES for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def device_state_lost(arrays: Iterable[Any]) -> bool:
    """Whether any of `arrays` (the engine's donated device state) has been deleted."""
    for a in arrays:
        is_deleted = getattr(a, "is_deleted", None)
        if is_deleted is not None and is_deleted():
            return True
    return False


class StepFault:
    """Counts a runner's steps; its `after`-th step raises `InjectedStepError` (None: never)."""

    def __init__(self, after: int | None = None):
        self.after = None if after is None else int(after)
        self.steps = 0

    def tick(self) -> None:
        if self.after is None:
            return
        self.steps += 1
        if self.steps == self.after:
            raise InjectedStepError(
                f"injected failure of step {self.steps} after its KV pool was donated "
                f"({STEP_FAULT_SETTING}={self.after})")


class StepErrorsMixin:
    """How the `Scheduler` sorts a step's exception and ends an engine that lost its device
    state; the Scheduler provides the rest (`runner`, `sampler`, `reqs`, `finish_request`,
    `publish_stats`, ...)."""

    def step_error_is_fatal(self, exc: BaseException) -> bool:
        """Whether a step's exception leaves this engine unable to run another step: a device
        error, or an array of its device state donated and not replaced (see above)."""
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
        try:
            self.flush_outputs()  # the answers go to the HTTP side before the grace starts
        except Exception:  # noqa: BLE001 - the exit follows
            log.exception("could not hand the answers over")
        if answered:
            time.sleep(ANSWER_GRACE_S)
        raise EngineStateLost(f"engine device state lost: {type(exc).__name__}: {exc}") from exc
