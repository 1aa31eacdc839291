"""Migration of a running decode between two D schedulers (issue 50 item 1), in one process:
real model runners, real transfer servers, real ZMQ side channels. A request goes P -> D1, is
moved to D2 mid-decode (its KV pulled from D1 like a prompt's from P, resharded for a D2 of
another tp) and finishes there; its tokens, logprobs and finish reason equal an unmoved run's,
and the client's sink sees every token exactly once. A D2 without room refuses: the request
completes on D1."""

from __future__ import annotations

import random
import threading
import time

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.ports import free_port
from pdtopo.runtime.disagg.reshard.layout import same_layout
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.request import Req, SamplingParams, new_rid
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.scheduler_factory import make_scheduler
from pdtopo.runtime.settings import direct_process_context

pytestmark = pytest.mark.slow  # real model runners behind real schedulers

OVERRIDES = ["model=tiny_llama", "model.num_layers=2", "engine.num_pages=64", "engine.page_size=8",
             "engine.max_running_requests=4", "disaggregation.kv_timeout_s=15",
             "disaggregation.sender_expiry_s=15", "disaggregation.migration=true"]


def _sched(cfg, role, tok, name, tp=1):
    ports = {"http": free_port(), "transfer": free_port(), "zmq": free_port()}
    ctx = direct_process_context(cfg, role=role, name=name,
                                 extra={"ports": ports, "mesh": {"tp": tp}})
    return make_scheduler(ctx, ModelRunner(cfg.model, cfg.engine, build_mesh(tp)), tok)


@pytest.fixture(scope="module")
def cluster():
    cfg = compose_config(OVERRIDES)
    tok = load_tokenizer(cfg.model)
    made = {"ref": _sched(cfg, "colocated", tok, "ref"), "p": _sched(cfg, "prefill", tok, "p"),
            "d1": _sched(cfg, "decode", tok, "d1"), "d2": _sched(cfg, "decode", tok, "d2"),
            "d2tp2": _sched(cfg, "decode", tok, "d2tp2", tp=2)}
    made["tok"] = tok
    for s in made.values():
        if hasattr(s, "start"):
            s.start()
    yield made
    for s in made.values():
        if hasattr(s, "stop"):
            s.stop()


class StreamSink:
    """The client's sink: every output kept; `on_tokens(n)` called (once) when n tokens came."""

    def __init__(self, trigger_at: int | None = None, on_trigger=None):
        self.outs = []
        self.done = threading.Event()
        self.trigger_at, self.on_trigger = trigger_at, on_trigger
        self.fired = None

    def emit(self, out):
        self.outs.append(out)
        n = sum(len(o.new_token_ids) for o in self.outs)
        if self.fired is None and self.trigger_at is not None and n >= self.trigger_at \
                and not out.finished:
            self.fired = self.on_trigger()
        if out.finished:
            self.done.set()

    def wait(self, timeout=60):
        assert self.done.wait(timeout), [o.new_token_ids for o in self.outs]
        ids = [t for o in self.outs for t in o.new_token_ids]
        lps = [lp for o in self.outs for lp in (o.new_logprobs or [])]
        finals = [o for o in self.outs if o.finished]
        assert len(finals) == 1 and self.outs[-1].finished  # one end, nothing after it
        return ids, lps, finals[0]


def _sampling(n, **sp):
    s = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    for k, v in sp.items():
        setattr(s, k, v)
    return s


def _run_ref(cluster, prompt, n, **sp):
    sink = StreamSink()
    cluster["ref"].submit(Req(rid=new_rid(), prompt_ids=list(prompt), sampling=_sampling(n, **sp),
                              sink=sink))
    return sink.wait()


def _run_pd(cluster, prompt, n, room, d1, d2=None, migrate_at=None, replay=False, **sp):
    """P -> D1; with `d2`, the request moves to D2 once `migrate_at` tokens reached the sink
    (`replay`: D2 recomputes its KV, as the HTTP route decides for an incompatible source).
    Returns the sink's (ids, logprobs, final) and the migration's outcome."""
    p = cluster["p"]
    rid = new_rid()

    def replay_at_d2(offer, sink):
        d2.accept_replay(offer, sink)
        d1.migration_replayed(offer.rid)

    offer_to = replay_at_d2 if replay else (d2.accept_migration if d2 is not None else None)
    sink = StreamSink(migrate_at, (lambda: d1.migrate(rid, offer_to))
                      if d2 is not None else None)
    rd = Req(rid=rid, prompt_ids=list(prompt), sampling=_sampling(n, **sp), sink=sink)
    rp = Req(rid=rid, prompt_ids=list(prompt), sampling=_sampling(n, **sp))
    for r in (rd, rp):
        r.bootstrap_room = room
        r.bootstrap_host, r.bootstrap_port = "127.0.0.1", p.kv_manager.channel.port
    d1.submit(rd)
    p.submit(rp)
    got = sink.wait()
    outcome = sink.fired.result(30) if sink.fired is not None else None
    return got, outcome


def _idle(*scheds, timeout=10.0):
    deadline = time.monotonic() + timeout
    for s in scheds:
        while True:
            st = s.stats()
            if st["num_reqs"] == 0 and st["num_running"] == 0 and not s.page_problems() and \
                    st.get("pd_migrating_out", 0) == 0 and \
                    s.allocator.num_free + st["evictable_pages"] == s.allocator.num_total:
                break
            assert time.monotonic() < deadline, (s.ctx.name, st['num_reqs'], st['num_running'],
                                                   s.page_problems(), st.get('pd_migrating_out'), s.allocator.num_free, list(s.reqs.values()))
            time.sleep(0.02)


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) < 1e-4, (x, y)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


CASES = {
    "greedy": {},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234},
    "penalties_logprobs": {"temperature": 0.7, "seed": 99, "presence_penalty": 0.5,
                           "frequency_penalty": 0.3, "repetition_penalty": 1.2, "logprobs": 3},
}


@pytest.mark.parametrize("target", ["d2", "d2tp2"])
def test_migrated_outputs_equal_unmigrated(cluster, target):
    rng = random.Random(5)
    d1, d2 = cluster["d1"], cluster[target]
    assert same_layout(d1.kv_manager.layout, d2.kv_manager.layout) == (target == "d2")
    for k, (name, sp) in enumerate(CASES.items()):
        prompt = [rng.randrange(2, 256) for _ in range(13)]
        ref_ids, ref_lps, ref_final = _run_ref(cluster, prompt, 30, **sp)
        room = 7000 + 10 * k + (target == "d2tp2") * 100
        (ids, lps, final), outcome = _run_pd(cluster, prompt, 30, room, d1, d2, migrate_at=9,
                                             **sp)
        assert outcome == {"moved": True, "reason": "done"}, (name, outcome)
        assert ids == ref_ids, name  # every token once, in order, as unmoved
        assert final.finish_reason == ref_final.finish_reason, name
        assert final.num_output_tokens == len(ref_ids)
        if sp.get("logprobs", -1) >= 0:
            _close(lps, ref_lps)
    assert d2.stats()["pd_migrated_in"] >= len(CASES)
    assert d1.stats()["pd_migrated_out"] >= len(CASES)
    assert d1.num_overlapped_steps > 0  # D1 decodes ahead: a step was in flight to land ...
    assert d1.num_migration_landings > 0  # ... and the export landed it first
    _idle(d1, d2, cluster["p"])


def test_replayed_outputs_equal_unmigrated(cluster):
    """The replay fallback: D2 prefills the prompt and every token so far again and goes on;
    greedy, seeded, penalised answers and logprobs equal an unmoved run's."""
    rng = random.Random(17)
    d1, d2 = cluster["d1"], cluster["d2"]
    before = d2.stats()["pd_migrated_in"]
    for k, (name, sp) in enumerate(CASES.items()):
        prompt = [rng.randrange(2, 256) for _ in range(11)]
        ref_ids, ref_lps, ref_final = _run_ref(cluster, prompt, 30, **sp)
        (ids, lps, final), outcome = _run_pd(cluster, prompt, 30, 7500 + 10 * k, d1, d2,
                                             migrate_at=9, replay=True, **sp)
        assert outcome == {"moved": True, "reason": "done"}, (name, outcome)
        assert ids == ref_ids, name
        assert final.finish_reason == ref_final.finish_reason, name
        if sp.get("logprobs", -1) >= 0:
            _close(lps, ref_lps)
    assert d2.stats()["pd_migrated_in"] == before + len(CASES)
    _idle(d1, d2, cluster["p"])


def test_migrated_stop_string_equals_unmigrated(cluster):
    rng = random.Random(11)
    prompt = [rng.randrange(2, 256) for _ in range(9)]
    tok = cluster["tok"]
    sp = {"temperature": 0.8, "seed": 7, "repetition_penalty": 1.1, "logprobs": 0}
    ref_ids, _, _ = _run_ref(cluster, prompt, 40, **sp)
    stop = tok.decode(ref_ids[24:26]).strip()[:3] or tok.decode(ref_ids[24:26])
    assert stop
    ref_ids, ref_lps, ref_final = _run_ref(cluster, prompt, 40, stop=[stop], **sp)
    (ids, lps, final), outcome = _run_pd(cluster, prompt, 40, 7500, cluster["d1"], cluster["d2"],
                                         migrate_at=6, stop=[stop], **sp)
    assert ref_final.finish_reason["type"] == "stop" and len(ref_ids) > 8, (ref_final, ref_ids)
    assert outcome["moved"] is True
    assert ids == ref_ids and final.finish_reason == ref_final.finish_reason
    _close(lps, ref_lps)
    _idle(cluster["d1"], cluster["d2"])


def test_target_without_room_keeps_the_request_running(cluster):
    """D2 holds max_running_requests requests of its own: it refuses, the request completes
    on D1 with the same tokens, and D1 frees everything."""
    d1, d2 = cluster["d1"], cluster["d2"]
    rng = random.Random(3)
    prompt = [rng.randrange(2, 256) for _ in range(11)]
    ref_ids, _, ref_final = _run_ref(cluster, prompt, 24)
    fillers = []
    for i in range(4):  # D2's rows, long enough to outlast the migration attempt
        fp = [rng.randrange(2, 256) for _ in range(5)]
        fillers.append(threading.Thread(target=_run_pd, args=(cluster, fp, 100, 7600 + i, d2)))
    for t in fillers:
        t.start()
    deadline = time.monotonic() + 30
    while d2.stats()["num_running"] < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    refused = d2.stats()["pd_migrations_refused"]
    (ids, _, final), outcome = _run_pd(cluster, prompt, 24, 7700, d1, d2, migrate_at=5)
    assert outcome["moved"] is False and "no free decode row" in outcome["reason"], outcome
    assert ids == ref_ids and final.finish_reason == ref_final.finish_reason
    assert d2.stats()["pd_migrations_refused"] == refused + 1
    for t in fillers:
        t.join(120)
    _idle(d1, d2)


def test_client_abort_after_the_move_reaches_the_target(cluster):
    """The client is gone (abort at D1, where its connection is): D1 passes it on to D2, which
    ends the request; the client's sink gets one final abort and D2's pool is free again."""
    p, d1, d2 = cluster["p"], cluster["d1"], cluster["d2"]
    rid = new_rid()
    sink = StreamSink(4, lambda: d1.migrate(rid, d2.accept_migration, abort_at=d2.abort))
    prompt = list(range(3, 16))
    rd = Req(rid=rid, prompt_ids=prompt, sampling=_sampling(200), sink=sink)
    rp = Req(rid=rid, prompt_ids=prompt, sampling=_sampling(200))
    for r in (rd, rp):
        r.bootstrap_room = 7800
        r.bootstrap_host, r.bootstrap_port = "127.0.0.1", p.kv_manager.channel.port
    d1.submit(rd)
    p.submit(rp)
    deadline = time.monotonic() + 30
    while sink.fired is None or not sink.fired.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sink.fired.result()["moved"] is True
    d1.abort(rid)
    ids, _, final = sink.wait()
    assert final.finish_reason["type"] == "abort" and final.finish_reason["status_code"] == 499
    assert 4 <= len(ids) < 200
    _idle(d1, d2)


def test_failed_pull_keeps_the_request_running_on_the_source(cluster):
    """D2's pull fails (an injected fault on its transfer engine): D2 ends its copy without a
    word to the client, D1 (told `failed`) puts the request back in its decode batch and it
    completes there with the unmoved run's tokens."""
    d1, d2 = cluster["d1"], cluster["d2"]
    prompt = list(range(40, 57))
    sp = {"temperature": 0.6, "seed": 5, "frequency_penalty": 0.4, "logprobs": 1}
    ref_ids, ref_lps, ref_final = _run_ref(cluster, prompt, 20, **sp)
    faults = d2.kv_manager.engine.faults
    faults.prob = 1.0
    try:
        (ids, lps, final), outcome = _run_pd(cluster, prompt, 20, 7900, d1, d2, migrate_at=5,
                                             **sp)
    finally:
        faults.prob = 0.0
    assert outcome["moved"] is False and "injected" in outcome["reason"], outcome
    assert ids == ref_ids and final.finish_reason == ref_final.finish_reason
    _close(lps, ref_lps)
    _idle(d1, d2)


def test_an_offer_nobody_takes_keeps_the_request_after_kv_timeout(cluster, monkeypatch):
    """The offer is lost (the target never asks for the KV): after kv_timeout_s, not the
    sender's longer expiry, D1 takes the request back and it completes."""
    d1 = cluster["d1"]
    monkeypatch.setattr(d1.kv_manager, "kv_timeout_s", d1.kv_manager.kv_timeout_s)  # restored

    class Nobody:
        @staticmethod
        def accept_migration(offer, sink):
            d1.kv_manager.kv_timeout_s = 0.3  # from now on: P's pull to D1 is done

    prompt = list(range(60, 70))
    ref_ids, _, ref_final = _run_ref(cluster, prompt, 16)
    t0 = time.monotonic()
    (ids, _, final), outcome = _run_pd(cluster, prompt, 16, 7950, d1, Nobody, migrate_at=4)
    assert outcome["moved"] is False and "never asked" in outcome["reason"], outcome
    assert time.monotonic() - t0 < 10  # sender_expiry_s is 15 here
    assert ids == ref_ids and final.finish_reason == ref_final.finish_reason
    _idle(d1)
