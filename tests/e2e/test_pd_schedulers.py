"""P and D schedulers in one process: real model runners, real jax.experimental.transfer
servers, real ZMQ side channel, no HTTP. D's greedy tokens must equal a colocated server's,
every pool must return to its baseline, and failures on either side must end requests cleanly."""

from __future__ import annotations

import random
import threading
import time

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.ports import free_port
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.scheduler_factory import DecodeScheduler, PrefillScheduler, make_scheduler
from pdtopo.runtime.settings import direct_process_context
from tests.support.e2e import baseline_problems

pytestmark = pytest.mark.slow  # real model runners behind real schedulers

OVERRIDES = ["model=tiny_llama", "model.num_layers=2", "engine.num_pages=64", "engine.page_size=8",
             "engine.max_running_requests=8", "disaggregation.kv_timeout_s=15",
             "disaggregation.sender_expiry_s=15"]


def _ctx(cfg, role):
    ports = {"http": free_port(), "transfer": free_port(), "zmq": free_port()}
    return direct_process_context(cfg, role=role, name=f"{role}_0", extra={"ports": ports})


@pytest.fixture(scope="module")
def cluster():
    cfg = compose_config(OVERRIDES)
    tok = load_tokenizer(cfg.model)
    mesh = build_mesh(1)
    made = {}
    for role in ("colocated", "prefill", "decode"):
        ctx = _ctx(cfg, role)
        made[role] = make_scheduler(ctx, ModelRunner(cfg.model, cfg.engine, mesh), tok)
    for s in made.values():
        s.start()
    yield made
    for s in made.values():
        s.stop()


def _req(prompt_ids, n, room=None, p=None, **sp):
    sampling = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    for k, v in sp.items():
        setattr(sampling, k, v)
    req = Req(rid=new_rid(), prompt_ids=list(prompt_ids), sampling=sampling, sink=QueueSink())
    if room is not None:
        req.bootstrap_room = room
        req.bootstrap_host, req.bootstrap_port = "127.0.0.1", p.kv_manager.channel.port
    return req


def _pd_generate(cluster, prompt_ids, n, room, **sp):
    p, d = cluster["prefill"], cluster["decode"]
    rp, rd = _req(prompt_ids, n, room, p, **sp), _req(prompt_ids, n, room, p, **sp)
    d.submit(rd)
    p.submit(rp)
    p_ids, p_out = rp.sink.collect(30)
    d_ids, d_out = rd.sink.collect(30)
    return p_ids, p_out, d_ids, d_out


def _baseline(s: Scheduler, timeout: float = 5.0) -> None:
    """The pool is back at its baseline (stats are published at the end of a step, just
    after the outputs that a test waits for: poll briefly)."""
    deadline = time.monotonic() + timeout
    while True:
        st = s.stats()
        if not baseline_problems(st) and st["num_reqs"] == 0:
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.01)


def test_factory_assembles_mixins(cluster):
    assert isinstance(cluster["prefill"], PrefillScheduler)
    assert isinstance(cluster["decode"], DecodeScheduler)
    assert type(cluster["colocated"]) is Scheduler


def test_pd_greedy_equals_colocated_for_multi_page_prompts(cluster):
    rng = random.Random(0)
    for i, length in enumerate((5, 8, 17, 40)):
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        ref = _req(prompt, 12)
        cluster["colocated"].submit(ref)
        ref_ids, _ = ref.sink.collect(30)
        p_ids, p_out, d_ids, d_out = _pd_generate(cluster, prompt, 12, room=1000 + i)
        assert p_out.finish_reason["type"] == "length" and len(p_ids) == 1
        assert d_ids == ref_ids, (length, d_ids, ref_ids)
        assert p_ids[0] == ref_ids[0]
        assert d_out.finish_reason["type"] == "length"


def test_concurrent_rooms_and_pools_return_to_baseline(cluster):
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    refs = []
    for prompt in prompts:
        ref = _req(prompt, 6)
        cluster["colocated"].submit(ref)
        refs.append(ref.sink.collect(30)[0])
    results = [None] * len(prompts)

    def run(i):
        _, _, ids, out = _pd_generate(cluster, prompts[i], 6, room=2000 + i)
        results[i] = ids if out.finish_reason["type"] == "length" else out.finish_reason

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == refs
    for role in ("prefill", "decode"):
        _baseline(cluster[role])
    assert cluster["prefill"].kv_manager.num_registered() == 0


def test_prefill_rejection_reaches_decode_quickly(cluster):
    p, d = cluster["prefill"], cluster["decode"]
    too_long = list(range(200)) * 6  # beyond engine.max_model_len
    rp, rd = _req(too_long, 4, 3000, p), _req(too_long, 4, 3000, p)
    d.submit(rd)
    p.submit(rp)
    _, p_out = rp.sink.collect(10)
    _, d_out = rd.sink.collect(10)
    assert p_out.finish_reason["status_code"] == 400
    assert d_out.finish_reason["type"] == "abort" and d_out.finish_reason["status_code"] == 400
    assert "max_model_len" in d_out.finish_reason["message"]


def test_decode_fails_cleanly_when_prefill_never_answers(cluster):
    d = cluster["decode"]
    rd = _req([1, 2, 3], 4, 4000, cluster["prefill"])  # P never sees this room
    d.submit(rd)
    _, out = rd.sink.collect(40)
    assert out.finish_reason["type"] == "abort"
    assert out.finish_reason["status_code"] == 504
    assert "kv_timeout_s" in out.finish_reason["message"]
    _baseline(d)


def test_requests_without_bootstrap_fields_are_rejected(cluster):
    for role in ("prefill", "decode"):
        r = _req([1, 2, 3], 2)
        cluster[role].submit(r)
        _, out = r.sink.collect(10)
        assert out.finish_reason["status_code"] == 400
        assert "bootstrap_room" in out.finish_reason["message"]


def test_decode_admits_no_more_than_max_running(cluster):
    """With more PD requests than engine.max_running_requests (8), D pulls their KV but holds
    the extra requests in its ready queue instead of overfilling the decode batch."""
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 256) for _ in range(12)] for _ in range(12)]
    refs = []
    for prompt in prompts:
        ref = _req(prompt, 10)
        cluster["colocated"].submit(ref)
        refs.append(ref.sink.collect(30)[0])
    d = cluster["decode"]
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            st = d.stats()
            peak[0] = max(peak[0], st["num_running"])
            stop.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    results = [None] * len(prompts)

    def run(i):
        results[i] = _pd_generate(cluster, prompts[i], 10, room=5000 + i)[2]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    stop.set()
    watcher.join()
    assert results == refs
    assert 0 < peak[0] <= 8, peak[0]
    _baseline(d)


def test_a_room_d_gives_up_during_prefill_fails_alone(tmp_path):
    """D fails a room (its client left) while P is prefilling it: P ends that request with
    D's reason and the other requests of the same prefill batch go on (no engine error)."""
    from pdtopo.runtime.disagg.transport import messages as m
    from pdtopo.runtime.disagg.transport.side_channel import SideChannel

    cfg = compose_config(OVERRIDES)
    p = make_scheduler(_ctx(cfg, "prefill"), ModelRunner(cfg.model, cfg.engine, build_mesh(1)),
                       load_tokenizer(cfg.model))
    fake_d = SideChannel(bind=None, max_bytes=65536, name="fake-d")
    try:
        endpoint = f"127.0.0.1:{p.kv_manager.channel.port}"
        gone, kept = _req(list(range(3, 40)), 1, 5001, p), _req(list(range(3, 30)), 1, 5002, p)
        for r in (gone, kept):
            p.submit(r)
            fake_d.send_to(endpoint, m.Want(room=r.bootstrap_room))
        p.drain_inbox()  # both senders exist, nothing prefilled yet
        fake_d.send_to(endpoint, m.Failed(room=5001, reason="client disconnected", status=499))
        deadline = time.monotonic() + 10
        while p._senders[gone.rid].poll().name != "Failed":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gone in p.waiting and kept in p.waiting
        batch = p.schedule()  # prefill both, the failed room's request included
        assert batch.reqs == [gone, kept]
        p.run_batch(batch)
        for _ in range(20):
            p.step()
        _, out_gone = gone.sink.collect(5)
        _, out_kept = kept.sink.collect(5)
        assert out_gone.finish_reason["type"] == "abort"
        assert "client disconnected" in out_gone.finish_reason["message"]
        assert out_kept.finish_reason == {"type": "length", "length": 1}
        ready = fake_d.events.get(timeout=10).msg
        assert isinstance(ready, m.Ready) and ready.room == 5002
        fake_d.send_to(endpoint, m.Failed(room=5002, reason="this test D pulls nothing"))
        for _ in range(50):
            p.step()
        _baseline(p)
    finally:
        fake_d.close()
        p.kv_manager.close()


def test_decode_rejection_reaches_prefill_quickly(cluster):
    """A request D refuses (its pool is smaller than P's: per-role num_pages) fails at P too,
    at once: P drops the room instead of keeping its KV for a pull that never comes."""
    cfg = compose_config([*OVERRIDES, "engine.num_pages=8"])
    d = make_scheduler(_ctx(cfg, "decode"), ModelRunner(cfg.model, cfg.engine, build_mesh(1)),
                       load_tokenizer(cfg.model))
    p = cluster["prefill"]
    d.start()
    try:
        prompt = list(range(5, 105))  # 13 pages of 8 with its answer: more than D's 7
        rp, rd = _req(prompt, 4, 6001, p), _req(prompt, 4, 6001, p)
        d.submit(rd)
        _, d_out = rd.sink.collect(10)
        assert d_out.finish_reason["status_code"] == 400, d_out.finish_reason
        t0 = time.monotonic()
        p.submit(rp)
        _, p_out = rp.sink.collect(10)
        assert p_out.finish_reason["type"] == "abort"
        assert "D refused the request" in p_out.finish_reason["message"]
        assert time.monotonic() - t0 < 5  # not sender_expiry_s (15 s here)
        _baseline(p)
    finally:
        d.stop()


def _dup(req, prompt_ids, room, p):
    """Another request with `req`'s rid (its own prompt and room)."""
    dup = _req(prompt_ids, 4, room, p)
    dup.rid = req.rid
    return dup


def test_duplicate_rid_at_decode_leaves_the_original_transfer(cluster):
    """D refuses a request whose rid is live (400 naming it) without touching the original:
    the original's pending transfer completes with the colocated tokens, and a later abort of
    the original by its rid still ends it at once (not after kv_timeout_s)."""
    p, d = cluster["prefill"], cluster["decode"]
    prompt = list(range(7, 30))
    ref = _req(prompt, 8)
    cluster["colocated"].submit(ref)
    ref_ids, _ = ref.sink.collect(30)
    rp, rd = _req(prompt, 8, 7001, p), _req(prompt, 8, 7001, p)
    d.submit(rd)  # waits for P's KV: P has not seen the room yet
    dup = _dup(rd, [3, 4, 5], 7002, p)
    d.submit(dup)
    _, dup_out = dup.sink.collect(10)
    assert dup_out.finish_reason["status_code"] == 400
    assert f"duplicate request id rid={rd.rid!r}" in dup_out.finish_reason["message"]
    p.submit(rp)
    d_ids, d_out = rd.sink.collect(30)
    assert d_out.finish_reason["type"] == "length" and d_ids == ref_ids
    # the original's abort still works after a refused duplicate
    live = _req(prompt, 8, 7003, p)
    d.submit(live)
    dup2 = _dup(live, [3, 4, 5], 7004, p)
    d.submit(dup2)
    assert dup2.sink.collect(10)[1].finish_reason["status_code"] == 400
    t0 = time.monotonic()
    d.abort(live.rid, only=live)
    _, out = live.sink.collect(10)
    assert out.finish_reason["status_code"] == 499 and time.monotonic() - t0 < 5
    for role in ("prefill", "decode"):
        _baseline(cluster[role])


def test_duplicate_rid_at_prefill_leaves_the_original_sender(cluster):
    """P refuses a request whose rid is live (400 naming it) and fails the duplicate's room at
    D; the original keeps its sender: D receives its KV and answers with the colocated tokens."""
    cfg = compose_config(OVERRIDES)
    p = make_scheduler(_ctx(cfg, "prefill"), ModelRunner(cfg.model, cfg.engine, build_mesh(1)),
                       load_tokenizer(cfg.model))
    d = cluster["decode"]
    try:
        prompt = list(range(9, 40))
        ref = _req(prompt, 6)
        cluster["colocated"].submit(ref)
        ref_ids, _ = ref.sink.collect(30)
        rp, rd = _req(prompt, 6, 7101, p), _req(prompt, 6, 7101, p)
        dup = _dup(rp, [3, 4, 5], 7102, p)
        dup_d = _req([3, 4, 5], 4, 7102, p)  # D's half of the duplicate
        d.submit(rd)
        d.submit(dup_d)
        p.submit(rp)
        p.submit(dup)
        p.drain_inbox()  # both arrive before P prefills anything: the rid is live
        _, dup_out = dup.sink.collect(5)
        assert dup_out.finish_reason["status_code"] == 400
        assert f"duplicate request id rid={rp.rid!r}" in dup_out.finish_reason["message"]
        assert p.reqs.get(rp.rid) is rp and rp in p.waiting
        deadline = time.monotonic() + 30
        while not rp.finished:
            p.step()
            assert time.monotonic() < deadline
        p_ids, p_out = rp.sink.collect(5)
        assert p_out.finish_reason["type"] == "length" and p_ids == ref_ids[:1]
        deadline = time.monotonic() + 30
        while not (rd.finished and dup_d.finished):  # P's loop answers D (want, done)
            p.step()
            assert time.monotonic() < deadline
        d_ids, d_out = rd.sink.collect(5)
        assert d_out.finish_reason["type"] == "length" and d_ids == ref_ids
        _, dup_d_out = dup_d.sink.collect(5)  # the refused room fails at D, not at its timeout
        assert dup_d_out.finish_reason["status_code"] == 400
        assert "duplicate request id" in dup_d_out.finish_reason["message"]
        for _ in range(50):
            p.step()
        _baseline(p)
        _baseline(d)
    finally:
        p.kv_manager.close()
