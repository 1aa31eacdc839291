"""Local disaggregation in one process (no HTTP): a prefill mesh and one or two decode meshes
over the 4 emulated test devices, real runners, real device_put transfer and insert_kv_chunks.
Greedy tokens must equal a colocated scheduler's, every pool must return to its baseline, and a
crashed worker thread must be reported (the server's handler then ends the process)."""

from __future__ import annotations

import random
import threading
import time

import jax
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.local.engine import build_local_engine
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.settings import direct_process_context
from pdtopo.runtime.worker_threads import InjectedCrash
from tests.support.e2e import baseline_problems

ENGINE = ["model=tiny_llama", "model.num_layers=2", "engine.num_pages=48", "engine.page_size=8",
          "engine.max_running_requests=4", "engine.max_prefill_tokens=64",
          "engine.max_model_len=128", "topology=local_cpu"]
N_NEW = 10


def _req(prompt_ids, n=N_NEW):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return Req(rid=new_rid(), prompt_ids=list(prompt_ids), sampling=sp, sink=QueueSink())


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in (5, 8, 17, 30, 41, 3)]


class Crashes:
    def __init__(self):
        self.seen: list[tuple[str, BaseException]] = []
        self.event = threading.Event()

    def __call__(self, name, exc):
        self.seen.append((name, exc))
        self.event.set()


def _local(extra, crashes=None):
    cfg = compose_config(ENGINE + extra)
    ctx = direct_process_context(cfg, role="local", name="local_0")
    orch = build_local_engine(ctx, load_tokenizer(cfg.model), devices=jax.devices()[:4],
                              on_crash=crashes or Crashes())
    orch.start()
    return orch


@pytest.fixture(scope="module")
def reference():
    cfg = compose_config(ENGINE)
    sched = Scheduler(direct_process_context(cfg), ModelRunner(cfg.model, cfg.engine,
                                                               build_mesh(1)),
                      load_tokenizer(cfg.model))
    sched.start()
    out = []
    for prompt in _prompts():
        r = _req(prompt)
        sched.submit(r)
        out.append(r.sink.collect(60)[0])
    sched.stop()
    return out


def _run_all(orch, prompts, n=N_NEW):
    reqs = [_req(p, n) for p in prompts]
    for r in reqs:
        orch.submit(r)
    return [r.sink.collect(120) for r in reqs]


def _wait_baseline(orch, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        st = orch.stats()
        if st["num_reqs"] == 0 and not baseline_problems(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not back to baseline: {st}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def layouts():
    """One running orchestrator per decode layout, shared by this module's tests."""
    made: dict[str, object] = {}

    def get(decode_slices: str):
        if decode_slices not in made:
            made[decode_slices] = _local(["topology.prefill_slices=2",
                                          f"topology.decode_slices={decode_slices}"])
        return made[decode_slices]

    yield get
    for orch in made.values():
        orch.stop()
        assert not orch.alive


@pytest.mark.slow
@pytest.mark.parametrize("decode_slices", ["[2]", "[1,1]"], ids=["2-2", "2-1-1"])
def test_greedy_equals_colocated_and_pools_return(reference, layouts, decode_slices):
    orch = layouts(decode_slices)
    base_transfers = orch.stats()["local_transfers"]
    results = _run_all(orch, _prompts())
    assert [ids for ids, _ in results] == reference
    assert all(out.finish_reason["type"] == "length" for _, out in results)
    st = _wait_baseline(orch)
    n_dec = len(orch.decodes)
    assert set(st["engines"]) == {"prefill_0", *(f"decode_{i}" for i in range(n_dec))}
    assert st["local_transfers"] - base_transfers == len(reference)
    assert st["local_decode_load"] == [0] * n_dec
    admitted = [st["engines"][f"decode_{i}"]["admitted"] for i in range(n_dec)]
    assert sum(admitted) == len(reference)
    if n_dec == 2:
        assert min(admitted) >= 1  # the least-loaded decode engine gets work
    # meshes are disjoint device sets of this process
    devs = [set(e.runner.mesh.devices.flat) for e in orch.engines]
    assert sum(len(d) for d in devs) == len(set().union(*devs)) == 4
    # a one-token request finishes on the prefill engine without a transfer
    ids, out = _run_all(orch, [_prompts()[0]], n=1)[0]
    assert ids == reference[0][:1] and out.finish_reason["type"] == "length"
    assert orch.stats()["local_transfers"] - base_transfers == len(reference)
    _wait_baseline(orch)
    assert orch.alive


@pytest.mark.slow
def test_backpressure_keeps_outputs_exact(reference, layouts):
    """12 requests at once into one decode engine (batch cap 4, backlog 2, transfer backlog
    4): prefill and transfer block, the decode engine holds the backlog head until a slot
    frees; every output still equals the reference."""
    orch = layouts("[2]")
    results = _run_all(orch, _prompts() * 2)
    assert [ids for ids, _ in results] == reference * 2
    st = _wait_baseline(orch)
    assert st["engines"]["decode_0"]["backlog_capacity"] == 2
    assert st["engines"]["decode_0"]["waits"] >= 1  # the backlog head did wait for room


@pytest.mark.slow
def test_abort_duplicate_and_too_long(reference, layouts):
    orch = layouts("[1,1]")
    assert "max_model_len" in orch.check_fits(100, 100)
    long_req = _req(_prompts()[4], n=80)
    orch.submit(long_req)
    first = long_req.sink.get(60)  # the first token comes from prefill
    assert first.new_token_ids
    dup = Req(rid=long_req.rid, prompt_ids=[1, 2], sampling=SamplingParams(
        max_new_tokens=2, temperature=0.0), sink=QueueSink())
    orch.submit(dup)
    _, dup_out = dup.sink.collect(30)
    assert dup_out.finish_reason["status_code"] == 400
    assert "duplicate" in dup_out.finish_reason["message"]
    orch.abort(long_req.rid)
    ids, out = long_req.sink.collect(60)
    assert out.finish_reason["status_code"] == 499
    assert len(ids) + len(first.new_token_ids) < 80
    # the engines keep serving
    ids, _ = _run_all(orch, [_prompts()[2]])[0]
    assert ids == reference[2]
    _wait_baseline(orch)


@pytest.mark.slow
def test_crashed_worker_thread_is_reported_not_silent():
    crashes = Crashes()
    orch = _local(["topology.prefill_slices=2", "topology.decode_slices=[2]",
                   "local.fault_inject_thread=decode_0", "local.fault_inject_after_steps=3"],
                  crashes)
    try:
        orch.submit(_req(_prompts()[1], n=20))
        assert crashes.event.wait(60)
        (name, exc), = crashes.seen
        assert name == "decode_0" and isinstance(exc, InjectedCrash)
        deadline = time.monotonic() + 5
        while orch.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not orch.alive
        assert orch.stats()["crashed_threads"] == ["decode_0"]
    finally:
        orch.stop(timeout=5)


def test_unknown_fault_thread_is_rejected():
    with pytest.raises(ValueError, match="local.fault_inject_thread='decode_7'"):
        _local(["topology.prefill_slices=2", "topology.decode_slices=[2]",
                "local.fault_inject_thread=decode_7"])
