"""A failed engine step either fails its own requests or ends the process (issue 45, item 2).

The scheduler loop runs on a fake runner that holds real JAX arrays as its KV pool. A step that
fails after the pool was donated (the arrays deleted, as a donating program leaves them) or
with a device error (jaxlib's JaxRuntimeError) must take the fatal path: every request held is
answered 503, /health's `alive` turns false and the thread dies through `on_crash` (which ends
a server's process with status 70). An error raised before anything was donated (host-side
packing or validation) fails only the step's requests and the engine keeps serving.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import pytest
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import runtime_settings
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.engine.step_errors import (
    EngineStateLost,
    InjectedStepError,
    StepFault,
    device_state_lost,
    is_device_error,
)
from pdtopo.runtime.settings import direct_process_context
from tests.support.scheduler_fakes import FakeRunner, FakeTokenizer, reference

TRIGGER = 0  # a prompt token the fake model never generates: a step carrying it fails


def ctx(**engine):
    eng = {"max_model_len": 64, "max_prefill_tokens": 32, "max_running_requests": 4, **engine}
    cfg = OmegaConf.merge(compose_config(["model=tiny_llama"]),
                          {"engine": eng, "model": {"name": "fake"}})
    return direct_process_context(cfg)


class DonatingRunner(FakeRunner):
    """The fake model with a pool of device arrays; a step carrying TRIGGER fails as `mode`
    says: "donated" (the pool deleted, then a plain RuntimeError), "device" (a JaxRuntimeError,
    nothing deleted) or "host" (ValueError before anything is touched, like `_validate`)."""

    def __init__(self, mode: str):
        super().__init__(64, 4)
        self.mode = mode
        self.kv_caches = [jnp.zeros((4, 2)) for _ in range(4)]

    def forward(self, chunks, padded=False):
        if any(TRIGGER in c.token_ids for c in chunks):
            if self.mode == "host":
                raise ValueError("chunk 1: token id out of range")
            if self.mode == "device":
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of device memory")
            for a in self.kv_caches:
                a.delete()  # what dispatching a program that donates them does
            raise RuntimeError("the layer program failed")
        if device_state_lost(self.kv_caches):  # what the next step meets on a lost pool
            raise RuntimeError("Array has been deleted with shape=float32[4,2].")
        return super().forward(chunks, padded)


class Crashes:
    def __init__(self) -> None:
        self.seen: list[tuple[str, BaseException]] = []
        self.event = threading.Event()

    def __call__(self, name: str, exc: BaseException) -> None:
        self.seen.append((name, exc))
        self.event.set()


def req(rid: str, prompt: list[int], n: int) -> Req:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, prompt_ids=prompt, sampling=sp, sink=QueueSink())


def started(mode: str) -> tuple[Scheduler, Crashes]:
    s = Scheduler(ctx(), DonatingRunner(mode), FakeTokenizer())
    crashes = Crashes()
    s.on_crash = crashes
    s.start()
    return s, crashes


def wait_tokens(r: Req, n: int, timeout: float = 10) -> None:
    t0 = time.monotonic()
    while len(r.output_ids) < n:
        assert time.monotonic() - t0 < timeout, f"{r.rid} has {len(r.output_ids)} tokens"
        time.sleep(0.002)


@pytest.mark.parametrize("mode", ["donated", "device"])
def test_a_step_that_loses_the_device_state_answers_everything_and_ends_the_loop(mode):
    s, crashes = started(mode)
    try:
        running = req("running", [3, 4, 5], 50)  # decoding when the step fails
        s.submit(running)
        wait_tokens(running, 2)
        t0 = time.monotonic()
        s.submit(req("failing", [3, TRIGGER, 5], 4))
        assert crashes.event.wait(10), "the loop went on after losing its device state"
        name, exc = crashes.seen[0]
        assert name == "scheduler" and isinstance(exc, EngineStateLost), exc
        assert (is_device_error(exc) if mode == "device"
                else "the layer program failed" in str(exc)), exc
        assert s.alive is False and s.stats()["alive"] is False  # /health 503
        _, last = running.sink.collect(timeout=1)  # answered before the thread ended
        assert last.finished and last.finish_reason["status_code"] == 503, last.finish_reason
        assert "retry" in last.finish_reason["message"], last.finish_reason
        assert time.monotonic() - t0 < 5
        assert not s.reqs  # every request it held was answered
    finally:
        s.stop(2)


def test_an_error_before_donation_fails_only_its_step():
    s, crashes = started("host")
    try:
        running = req("running", [3, 4, 5], 12)
        s.submit(running)
        wait_tokens(running, 2)
        bad = req("bad", [3, TRIGGER, 5], 4)
        s.submit(bad)
        _, last = bad.sink.collect(timeout=10)
        assert last.finish_reason["status_code"] == 500
        assert "token id out of range" in last.finish_reason["message"]
        # the failed step was the bad prompt's prefill: the running request is untouched
        ids, last = running.sink.collect(timeout=10)
        assert last.finish_reason["type"] == "length" and ids == reference([3, 4, 5], 12)
        later = req("later", [6, 7, 8], 6)
        s.submit(later)
        ids, last = later.sink.collect(timeout=10)
        assert last.finish_reason["type"] == "length" and ids == reference([6, 7, 8], 6)
        assert not crashes.seen and s.alive
    finally:
        s.stop(2)


def test_device_errors_are_recognised_through_the_exception_chain():
    device = jax.errors.JaxRuntimeError("INTERNAL: program failed")
    try:
        try:
            raise device
        except RuntimeError as inner:
            raise RuntimeError("sampling failed") from inner
    except RuntimeError as outer:
        assert is_device_error(outer)
    assert not is_device_error(ValueError("bad chunk"))
    assert not is_device_error(RuntimeError("Array has been deleted"))


def test_step_fault_fires_once_at_its_step():
    fault = StepFault(3)
    fault.tick()
    fault.tick()
    with pytest.raises(InjectedStepError, match="engine.fault_inject_step_error_after=3"):
        fault.tick()
    fault.tick()  # once only
    StepFault(None).tick()


def test_step_fault_setting_is_checked():
    cfg = compose_config(["model=tiny_llama", "engine.fault_inject_step_error_after=0"])
    with pytest.raises(TopologyError, match="engine.fault_inject_step_error_after"):
        runtime_settings(cfg)
    ok = compose_config(["model=tiny_llama", "engine.fault_inject_step_error_after=7"])
    assert runtime_settings(ok).engine.fault_inject_step_error_after == 7
