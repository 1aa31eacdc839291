"""P's budget of held KV copies (`disaggregation.max_held_kv_pages`, `held_kv_wait_s`) and the
drain count of rooms whose KV waits for D's pull.

A real P scheduler (model runner, transfer server, ZMQ side channel) faces a fake D (a bare side
channel) that asks for every room and pulls nothing until the test says `done`: P's held pages
never pass the budget, the requests past it wait and complete once D releases copies, or fail
with a retryable 503 naming the keys when they wait too long; the drain's `in_flight` counts the
held rooms (in device memory, or in host memory with `d2h_staging`: mode B). The memory sizing
keeps the budget out of a pool sized by `kv_memory_fraction`."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.config.pool_reserve import gather_bucket, reserved_pages
from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import runtime_settings
from pdtopo.kernels import select_from_kv_caches
from pdtopo.kernels.runs import bucket_size
from pdtopo.ports import free_port
from pdtopo.runtime.api.drain_routes import in_flight
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, tightest_memory
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.scheduler_factory import make_scheduler
from pdtopo.runtime.settings import direct_process_context

BUDGET = 16  # two 17-token prompts: 3 pages of 8 tokens each, held as the wire's 8 rows
OVERRIDES = ["model=tiny_llama", "model.num_layers=2", "engine.num_pages=64", "engine.page_size=8",
             "engine.max_running_requests=8", "disaggregation.kv_timeout_s=15",
             "disaggregation.sender_expiry_s=15", f"disaggregation.max_held_kv_pages={BUDGET}"]


@pytest.mark.parametrize("key, value", [("max_held_kv_pages", 0), ("max_held_kv_pages", 1.5),
                                        ("held_kv_wait_s", 0)])
def test_budget_keys_are_checked_with_their_name(key, value):
    with pytest.raises(TopologyError, match=f"disaggregation.{key}"):
        runtime_settings(compose_config([f"disaggregation.{key}={value}"]), "prefill")


def test_pool_sized_by_memory_leaves_room_for_held_copies(monkeypatch):
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2", "engine.page_size=8",
                          "disaggregation.max_held_kv_pages=10"])
    settings = runtime_settings(cfg, "prefill")
    assert reserved_pages(settings, "prefill") == 10
    assert reserved_pages(settings, "decode") == reserved_pages(settings, "colocated") == 0
    mesh = build_mesh(1)
    plain = ModelRunner(cfg.model, cfg.engine, mesh)
    page = plain.page_bytes_per_device()
    # the largest step's own buffers and the sampler's come off the budget
    step = plain.step_memory_bytes() + plain.sampler_memory_bytes()
    assert step > 0
    # half of the limit, less those buffers, is 50 pages
    monkeypatch.setattr(ModelRunner, "_memory_stats",
                        lambda self: {"bytes_limit": 100 * page + 2 * step, "bytes_in_use": 0})
    eng = OmegaConf.merge(cfg.engine, {"kv_memory_fraction": 0.5})
    assert ModelRunner(cfg.model, eng, mesh).num_pages == 50
    assert ModelRunner(cfg.model, eng, mesh, reserve_pages=10).num_pages == 40
    with pytest.raises(ValueError, match="49 of them are kept.*disaggregation.max_held_kv_pages"):
        ModelRunner(cfg.model, eng, mesh, reserve_pages=49)


@pytest.mark.parametrize("running", [8, 64])
def test_pool_sizing_counts_the_sampler(monkeypatch, running):
    """The pool, the largest step's buffers and the sampler (penalty tables + the full
    sampling program's temporaries, measured on the scheduler's own compiled programs after
    warmup) fit the fraction of injected device memory."""
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2", "model.vocab_size=4096",
                          "engine.page_size=8", f"engine.max_running_requests={running}",
                          "engine.max_prefill_tokens=256"])
    mesh = build_mesh(1)
    plain = ModelRunner(cfg.model, cfg.engine, mesh)
    page, step = plain.page_bytes_per_device(), plain.step_memory_bytes()
    limit = 400 * page + 4 * step + 8 * plain.sampler_memory_bytes()
    monkeypatch.setattr(ModelRunner, "_memory_stats",
                        lambda self: {"bytes_limit": limit, "bytes_in_use": 0})
    eng = OmegaConf.merge(cfg.engine, {"kv_memory_fraction": 0.5})
    runner = ModelRunner(cfg.model, eng, mesh)
    ctx = direct_process_context(cfg, role="colocated", name="colocated_0",
                                 extra={"ports": {"http": free_port()}})
    sched = make_scheduler(ctx, runner, load_tokenizer(cfg.model))
    sched.warmup()
    sampler = sched.sampler
    tables = sampler.tables.counts.nbytes + sampler.tables.seen.nbytes
    assert sampler.tables.counts.shape == (running, 4096)
    programs = []
    for key, program in sampler._compiled.items():
        stats = program.memory_analysis()
        if key[0] == "_sample":
            programs.append(stats.temp_size_in_bytes + stats.output_size_in_bytes
                            - stats.alias_size_in_bytes)
    assert runner.sampler_memory_bytes() == tables + max(programs)
    pool = runner.num_pages * page
    assert pool + step + tables + max(programs) <= 0.5 * limit
    assert pool + step + tables + max(programs) > 0.5 * limit - page  # and uses the rest


def test_mode_b_reserves_only_the_packing():
    """With d2h_staging, P's held copies live in host memory: the pool keeps back two packed
    copies of a longest prompt (each padded to its gather bucket), not max_held_kv_pages;
    the reserve covers two of the gather's real outputs."""
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2", "engine.page_size=8",
                          "engine.max_model_len=200", "disaggregation.max_held_kv_pages=500",
                          "disaggregation.d2h_staging=true"])
    settings = runtime_settings(cfg, "prefill")
    reserve = reserved_pages(settings, "prefill")
    assert reserve == 2 * 32  # 200 tokens: 25 pages, gathered in a bucket of 32
    assert all(gather_bucket(n) == bucket_size(n) for n in range(0, 300))
    assert reserved_pages(runtime_settings(cfg, "decode"), "decode") == 0
    mode_a = compose_config(["model=tiny_llama", "disaggregation.max_held_kv_pages=500"])
    assert reserved_pages(runtime_settings(mode_a, "prefill"), "prefill") == 500
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    longest = list(range(1, 26))
    packed = select_from_kv_caches(runner.kv_caches, longest, padded=True)  # what P stages
    measured = sum(int(a.nbytes) for a in packed)
    assert measured == 32 * runner.page_bytes_per_device()
    assert 2 * measured <= reserve * runner.page_bytes_per_device()


def test_pool_sizing_takes_the_tightest_device():
    stats = [{"bytes_limit": 100, "bytes_in_use": 10}, {"bytes_limit": 80, "bytes_in_use": 0},
             {"bytes_limit": 100, "bytes_in_use": 40}]
    assert tightest_memory(stats) == {"bytes_limit": 80, "bytes_in_use": 20}  # 60 free
    assert tightest_memory([*stats, None]) is None
    assert tightest_memory([]) is None


def _prefill(cfg):
    ports = {"http": free_port(), "transfer": free_port(), "zmq": free_port()}
    ctx = direct_process_context(cfg, role="prefill", name="prefill_0", extra={"ports": ports})
    return make_scheduler(ctx, ModelRunner(cfg.model, cfg.engine, build_mesh(1)),
                          load_tokenizer(cfg.model))


def _req(p, room: int, length: int = 17) -> Req:
    req = Req(rid=new_rid(), prompt_ids=[(room * 7 + i) % 250 + 1 for i in range(length)],
              sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
              sink=QueueSink())
    req.bootstrap_room = room
    req.bootstrap_host, req.bootstrap_port = "127.0.0.1", p.kv_manager.channel.port
    return req


class FakeDecode:
    """A D that asks P for rooms and pulls nothing: it only says `done` when told to."""

    def __init__(self, p) -> None:
        self.p = p
        self.endpoint = f"127.0.0.1:{p.kv_manager.channel.port}"
        self.channel = SideChannel(bind=None, max_bytes=65536, name="fake-d")
        self.got: dict[int, object] = {}  # room -> P's ready / failed

    def want(self, room: int) -> None:
        self.channel.send_to(self.endpoint, m.Want(room=room))

    def send(self, msg) -> None:
        self.channel.send_to(self.endpoint, msg)

    def drain(self) -> None:
        while True:
            try:
                ev = self.channel.events.get_nowait()
            except Exception:
                return
            self.got[ev.msg.room] = ev.msg

    def close(self) -> None:
        self.channel.close()


def _steps(p, d: FakeDecode, until, timeout: float = 30.0) -> None:
    """Run P's loop on this thread until `until()`; the budget holds after every step."""
    deadline = time.monotonic() + timeout
    while True:
        p.step()
        d.drain()
        assert p.held_kv_pages() <= BUDGET, p.stats()
        if until():
            return
        assert time.monotonic() < deadline, p.stats()


def _metric(p, name: str) -> float:
    value = p.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


@pytest.mark.slow  # a real model runner behind a real P scheduler
@pytest.mark.parametrize("staging", [False, True], ids=["mode_a", "mode_b"])
def test_held_copies_stay_within_the_budget_and_waiting_requests_complete(staging):
    """Mode A holds the copies in device memory; mode B (`d2h_staging`) in host memory, so
    that the device bytes P holds for the pulls D is slow to make stay 0."""
    cfg = compose_config([*OVERRIDES, f"disaggregation.d2h_staging={str(staging).lower()}"])
    p = _prefill(cfg)
    d = FakeDecode(p)
    try:
        reqs = [_req(p, room) for room in (1, 2, 3, 4)]
        for r in reqs:
            d.want(r.bootstrap_room)
            p.submit(r)
        _steps(p, d, lambda: len(d.got) >= 2 and p.stats()["pd_held_kv_waiting"] == 2)
        time.sleep(0.3)  # D pulls nothing: P stays at its budget and starts nothing more
        _steps(p, d, lambda: True)
        st = p.stats()
        assert sorted(d.got) == [1, 2] and all(isinstance(v, m.Ready) for v in d.got.values())
        assert st["pd_held_kv_pages"] == BUDGET and st["num_waiting"] == 2, st
        assert st["pd_held_kv_bytes"] == p.kv_manager.engine.registered_bytes() > 0
        assert st["pd_held_kv_device_bytes"] == (0 if staging else st["pd_held_kv_bytes"])
        assert _metric(p, "pdtopo:held_kv_device_bytes") == st["pd_held_kv_device_bytes"]
        held = [a for room in (1, 2) for a in p.kv_manager.engine.registered_arrays(room)]
        assert {a.sharding.memory_kind for a in held} == (
            {p.kv_manager.engine.staging_memory_kind} if staging else {"device"})
        assert _metric(p, "pdtopo:held_kv_pages") == BUDGET
        assert _metric(p, "pdtopo:held_kv_bytes") == st["pd_held_kv_bytes"]
        assert _metric(p, "pdtopo:max_held_kv_pages") == BUDGET
        assert _metric(p, "pdtopo:held_kv_waiting_requests") == 2
        # the drain waits for the two announced rooms although no request is left for them
        assert st["num_reqs"] == 2 and st["pd_inflight_senders"] == 2
        assert in_flight(SimpleNamespace(scheduler=p, http_in_flight=0)) == 4

        d.send(m.Done(room=1))  # D pulled room 1: room 3 may start, room 4 still waits
        _steps(p, d, lambda: 3 in d.got)
        assert 4 not in d.got and p.stats()["num_waiting"] == 1
        d.send(m.Done(room=2))
        _steps(p, d, lambda: 4 in d.got)
        for room in (3, 4):
            d.send(m.Done(room=room))
        _steps(p, d, lambda: p.stats()["pd_inflight_senders"] == 0)
        for r in reqs:  # nothing lost: every request sent its KV and its first token
            ids, out = r.sink.collect(5)
            assert out.finish_reason == {"type": "length", "length": 1}, out.finish_reason
        st = p.stats()
        assert st["pd_held_kv_pages"] == st["pd_held_kv_bytes"] == st["num_reqs"] == 0
        assert in_flight(SimpleNamespace(scheduler=p, http_in_flight=0)) == 0
    finally:
        d.close()
        p.kv_manager.close()


@pytest.mark.slow
def test_a_request_waiting_too_long_fails_retryably_and_oversized_prompts_are_refused():
    cfg = compose_config([*OVERRIDES, "disaggregation.held_kv_wait_s=0.5"])
    p = _prefill(cfg)
    d = FakeDecode(p)
    try:
        # 9 pages held as 16 wire rows: the budget; 3 more pages (8 rows) do not fit
        first, late = _req(p, 11, 72), _req(p, 12, 17)
        for r in (first, late):
            d.want(r.bootstrap_room)
            p.submit(r)
        _steps(p, d, lambda: isinstance(d.got.get(12), m.Failed))
        _, out = late.sink.collect(5)
        assert out.finish_reason["status_code"] == 503, out.finish_reason
        for key in (f"disaggregation.max_held_kv_pages={BUDGET}", "disaggregation.held_kv_wait_s=0.5",
                    "retry"):
            assert key in out.finish_reason["message"], out.finish_reason
        assert d.got[12].status == 503 and "max_held_kv_pages" in d.got[12].reason
        assert isinstance(d.got[11], m.Ready) and p.held_kv_pages() == BUDGET

        huge = _req(p, 13, 8 * BUDGET + 1)  # 17 pages (32 rows): can never start here
        p.submit(huge)
        _steps(p, d, lambda: huge.finished)
        _, out = huge.sink.collect(5)
        assert out.finish_reason["status_code"] == 400
        assert f"disaggregation.max_held_kv_pages={BUDGET}" in out.finish_reason["message"]

        d.send(m.Done(room=11))
        _steps(p, d, lambda: p.stats()["pd_inflight_senders"] == 0)
        assert first.sink.collect(5)[1].finish_reason["type"] == "length"
    finally:
        d.close()
        p.kv_manager.close()
