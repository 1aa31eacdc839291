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

`StepFault` is the testing knob `engine.fault_inject_step_error_after`: the runner's N-th step
raises `InjectedStepError` (a plain RuntimeError, not a device error) after its programs took
the pool and before the runner takes their output pool back, so the pool is gone exactly as
after a real mid-step failure, and only the donation check can tell.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# class names of jaxlib's runtime errors (JaxRuntimeError; XlaRuntimeError before it)
DEVICE_ERROR_NAMES = frozenset({"JaxRuntimeError", "XlaRuntimeError"})
STEP_FAULT_SETTING = "engine.fault_inject_step_error_after"


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
