"""The PD request timeline: P's stages travel in `ready` (validated like every field), D
composes them with its own stage times into meta_info.pd_timeline, and the bench summarizes it
(the client's TTFT beyond D's own is the proxy/network stage)."""

from __future__ import annotations

import json

import pytest

from pdtopo.bench.loadgen import RequestResult
from pdtopo.bench.stats import BREAKDOWN, ttft_breakdown
from pdtopo.runtime.disagg.observability import D_STAGES, decode_timeline
from pdtopo.runtime.disagg.transport import messages as m
from tests.support.side_channel_messages import READY


def test_ready_carries_p_stages():
    msg = m.Ready(**{**{k: getattr(READY, k) for k in READY.__dataclass_fields__
                        if k != "type"}, "p_stages": {"queue": 0.001, "prefill": 0.02,
                                                       "send": 0.0005}})
    back = m.decode(m.encode(msg), 1 << 16)
    assert back == msg and back.p_stages["prefill"] == 0.02
    assert m.decode(m.encode(READY), 1 << 16).p_stages == {}  # optional
    for bad, why in (({"warp": 1.0}, "unknown p_stages entry 'warp'"),
                     ({"queue": -1}, "p_stages.queue must be seconds"),
                     ({"queue": True}, "p_stages.queue must be seconds"),
                     ({"queue": "1"}, "p_stages.queue must be seconds")):
        d = m.to_dict(READY)
        d["p_stages"] = bad
        with pytest.raises(m.MessageError, match=why):
            m.decode(json.dumps(d).encode(), 1 << 16)


def test_decode_timeline_adds_up():
    times = {"ready": 10.030, "pages": 10.001, "pull_start": 10.031, "pull_end": 10.036,
             "scattered": 10.037}
    tl = decode_timeline(10.0, times, {"queue": 0.002, "prefill": 0.020, "send": 0.001},
                         10.038)
    assert tl is not None
    assert tl["p_prefill"] == pytest.approx(20.0) and tl["d_wait_ready"] == pytest.approx(30.0)
    assert tl["transit"] == pytest.approx(30.0 - 23.0)
    assert tl["d_transfer"] == pytest.approx(5.0) and tl["d_ttft"] == pytest.approx(38.0)
    assert sum(tl[k] for k in D_STAGES) == pytest.approx(tl["d_ttft"], abs=0.01)
    assert "transit" not in decode_timeline(10.0, times, {}, 10.038)  # no P stages: no transit
    assert decode_timeline(10.0, {"ready": 10.03}, {}, 10.04) is None  # no pull happened


def test_bench_breakdown_has_a_proxy_network_stage():
    done = []
    for i in range(3):
        r = RequestResult(index=i, tag="", input_len=4, expected_output_len=2, start=0.0,
                          end=0.1, token_times=[0.050 + i * 0.001, 0.06])
        r.timeline = {"p_prefill": 20.0, "d_ttft": 40.0}
        done.append(r)
    plain = RequestResult(index=9, tag="", input_len=4, expected_output_len=1, start=0.0,
                          end=0.1, token_times=[0.02])
    out = ttft_breakdown([*done, plain])
    assert list(out)[:len(BREAKDOWN)] == list(BREAKDOWN)
    assert out["proxy_network"]["p50"] == pytest.approx(11.0)  # 51 ms at the client - 40 at D
    assert out["p_prefill"]["p50"] == 20.0 and out["d_transfer"]["p50"] is None
    assert ttft_breakdown([plain]) is None
