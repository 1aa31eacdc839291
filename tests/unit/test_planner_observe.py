"""What the planner reads: a server's /metrics text (generated here by the servers' own metric
definitions, not written by hand) turned into one interval's observation, and the measured
capacity profiles on disk (a `pdtopo tune` result dir, a profile JSON)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdtopo.planner.capacity import InstanceProfile, LiveCapacity, Slo, select_capacity
from pdtopo.planner.observe import Observation, observe_instance, parse_metrics
from pdtopo.planner.profile import ProfileError, load_profile
from pdtopo.runtime.disagg.observability import PDMetrics
from pdtopo.runtime.engine.metrics import EngineMetrics
from pdtopo.tune.candidates import Candidate
from pdtopo.tune.store import ResultStore


def _server(role: str) -> EngineMetrics:
    m = EngineMetrics("tiny-llama", role=role)
    PDMetrics(m.registry, lambda: 0)  # a PD server exports both on one registry
    return m


def test_two_scrapes_of_a_prefill_server_make_its_window():
    m = _server("prefill")
    m.num_queue.set(2)
    older = parse_metrics(m.render().decode(), at=100.0)
    m.prompt_tokens.inc(5000)
    m.generation_tokens.inc(10)
    for _ in range(10):
        m.request_finished("length")
    for _ in range(9):
        m.ttft.observe(0.2)
    m.ttft.observe(3.0)
    m.num_queue.set(3)
    m.num_running.set(2)
    m.free_pages.set(400)
    m.total_pages.set(512)
    newer = parse_metrics(m.render().decode(), at=110.0)
    o = observe_instance("prefill_0", "prefill", older, newer)
    assert (o.prompt_tps, o.decode_tps, o.requests_per_s) == (500.0, 1.0, 1.0)
    assert (o.queue_depth, o.running, o.free_pages, o.total_pages) == (3, 2, 400, 512)
    assert o.waiting_s == pytest.approx(3.0)  # Little's law: 3 queued at 1 request/s
    assert o.busy  # requests waited at both scrapes
    assert 100 < o.ttft_ms["p50"] <= 250 and 2500 < o.ttft_ms["p99"] <= 5000
    assert o.itl_ms == {"p50": None, "p90": None, "p99": None}  # no token gaps in the window
    obs = Observation(110.0, 10.0, (o,))
    assert obs.total("prefill", "prompt_tps") == 500 and obs.of("decode") == ()
    assert obs.worst("prefill", "ttft", 99) == o.ttft_ms["p99"]
    json.dumps(obs.to_dict())


def test_a_decode_window_and_a_queue_time_histogram_when_exported():
    m = _server("decode")
    extra = CollectorRegistry()
    queue_time = Histogram("sglang:queue_time_seconds", "Queue wait", registry=extra)
    text = lambda: m.render().decode() + generate_latest(extra).decode()  # noqa: E731
    older = parse_metrics(text(), at=0.0)
    m.generation_tokens.inc(640)
    for _ in range(640):
        m.itl.observe(0.03)
    queue_time.observe(0.5)
    queue_time.observe(1.5)
    m.num_running.set(16)
    o = observe_instance("decode_0", "decode", older, parse_metrics(text(), at=2.0))
    assert (o.decode_tps, o.running, o.busy) == (320.0, 16, False)
    assert o.waiting_s == pytest.approx(1.0)  # the histogram's mean over the window
    assert 25 < o.itl_ms["p50"] <= 30


def test_a_counter_reset_reads_as_no_change_and_time_must_advance():
    m = _server("decode")
    m.generation_tokens.inc(100)
    older = parse_metrics(m.render().decode(), at=0.0)
    restarted = parse_metrics(_server("decode").render().decode(), at=5.0)
    assert observe_instance("decode_0", "decode", older, restarted).decode_tps == 0.0
    with pytest.raises(ValueError, match="not after"):
        observe_instance("decode_0", "decode", restarted, older)


def _record(rate, goodput, *, in_tput, out_tput, e2e_ms, ttft_p50, ttft_mean=100.0):
    return {"rate": rate, "goodput": goodput, "workload": {"input_len": 512, "output_len": 64},
            "stats": {"request_throughput": rate, "input_token_throughput": in_tput,
                      "output_token_throughput": out_tput,
                      "ttft_ms": {"mean": ttft_mean, "p50": ttft_p50},
                      "e2e_ms": {"mean": e2e_ms}, "itl_ms": {"mean": 20.0}}}


def test_a_tune_result_dir_is_a_per_instance_profile(tmp_path):
    store = ResultStore(tmp_path)
    p_bound = Candidate("pd-1p1-2d1", "pd", "1P tp=1 + 2D tp=1", 3, ())
    d_bound = Candidate("pd-2p1-1d1", "pd", "2P tp=1 + 1D tp=1", 3, ())
    # 1P2D: P saturates at 8 req/s (4096 tok/s); 16 req/s failed the goodput target
    store.save_rate(p_bound, "abc123", 1.0, _record(1.0, 1.0, in_tput=512, out_tput=64,
                                                    e2e_ms=1000, ttft_p50=200))
    store.save_rate(p_bound, "abc123", 8.0, _record(8.0, 0.95, in_tput=4096, out_tput=512,
                                                    e2e_ms=1300, ttft_p50=400))
    store.save_rate(p_bound, "abc123", 16.0, _record(16.0, 0.2, in_tput=8192, out_tput=1024,
                                                     e2e_ms=9000, ttft_p50=5000))
    # 2P1D: D saturates at 6 req/s: 384 tok/s, batch 6 x (2100 - 100) / 1000 = 12
    store.save_rate(d_bound, "def456", 6.0, _record(6.0, 0.92, in_tput=3072, out_tput=384,
                                                    e2e_ms=2100, ttft_p50=150))
    (tmp_path / "runs" / "colocated-tp1-0a1b2c").mkdir(parents=True)  # not PD: ignored
    prof = load_profile(tmp_path, chips=1, max_batch=32)
    assert prof.prefill_tps == pytest.approx(4096.0)  # 1P2D's P, above 512 / 0.2 s alone
    assert dict(prof.decode_tps)[12] == pytest.approx(384.0)
    assert prof.max_batch == 32 and prof.source == f"tune:{tmp_path}"
    with pytest.raises(ProfileError, match="2-chip instances"):
        load_profile(tmp_path, chips=2)


def test_a_profile_json_and_the_capacity_it_gives(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"prefill_tps": 8000, "decode_tps": [[1, 64.5], [64, 1361.7]],
                                "max_batch": 64, "transfer_s_per_token": 2e-6}))
    prof = load_profile(path)
    assert prof.step_s(1) == pytest.approx(1 / 64.5)
    assert prof.step_s(64) == pytest.approx(64 / 1361.7)
    assert prof.step_s(128) > prof.step_s(64)  # extended along the last two points
    cap = select_capacity("profile", prof, LiveCapacity(), Slo(1000, 50, 90), 4000)
    assert cap.source == "prefill=profile decode=profile"
    assert 0 < cap.prefill.tokens_per_s < 8000 * 0.9  # a 0.5 s prefill within 1 s at p90
    assert cap.decode.tokens_per_s == pytest.approx(0.9 * 1361.7, rel=0.01)  # 47 ms <= 50
    tight = select_capacity("profile", prof, LiveCapacity(), Slo(1000, 30, 90), 4000)
    assert tight.decode.tokens_per_s < cap.decode.tokens_per_s  # a smaller batch fits 30 ms
    path.write_text(json.dumps({"prefill_tps": 8000}))
    with pytest.raises(ProfileError, match="decode_tps"):
        load_profile(path)
    with pytest.raises(ValueError):
        InstanceProfile(prefill_tps=0, decode_tps=((1, 10.0),), max_batch=1)
