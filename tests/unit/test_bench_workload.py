"""Bench settings, workloads, arrival times and per-request ITL splitting (no servers)."""

from __future__ import annotations

import math

import pytest

from pdtopo.bench.loadgen import RequestResult, arrival_offsets
from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.stats import percentile, request_itls
from pdtopo.bench.workload import build_workload, load_jsonl, multiturn, synthetic
from pdtopo.cli import main
from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError


def test_default_config_section_is_valid():
    s = BenchSettings.from_config(compose_config([])["bench"])
    assert math.isinf(s.request_rate) and s.arrival == "poisson" and s.num_requests >= 1
    s = BenchSettings.from_config(compose_config(["bench.request_rate=inf"])["bench"])
    assert math.isinf(s.request_rate)


@pytest.mark.parametrize("bad, key", [
    ({"num_requests": 0}, "bench.num_requests"),
    ({"request_rate": -1}, "bench.request_rate"),
    ({"arrival": "burst"}, "bench.arrival"),
    ({"input_len_range": 1.5}, "bench.input_len_range"),
    ({"token_id_range": [5, 5]}, "bench.token_id_range"),
    ({"slo": {"ttft": 3}}, "bench.slo"),
    ({"nope": 1}, "bench.nope"),
    ({"workload": "chatty"}, "bench.workload"),
    ({"workload": "multiturn", "dataset": "/tmp/x.jsonl"}, "bench.workload"),
    ({"multiturn": {"turns": 0}}, "bench.multiturn.turns"),
    ({"multiturn": {"rounds": 3}}, "bench.multiturn"),
])
def test_bad_settings_name_the_key(bad, key):
    with pytest.raises(TopologyError, match=key.replace(".", r"\.")):
        BenchSettings.with_defaults(bad)


def test_synthetic_is_seeded_and_within_ranges():
    s = BenchSettings.with_defaults({"num_requests": 50, "input_len": 100,
                                     "input_len_range": 0.2, "output_len": 10,
                                     "output_len_range": 0.5, "seed": 4})
    a, b = build_workload(s), build_workload(s)
    assert [r.input_ids for r in a] == [r.input_ids for r in b]
    assert all(80 <= r.input_len <= 120 and 5 <= r.output_len <= 15 for r in a)
    assert all(32 <= t < 127 for r in a for t in r.input_ids)
    assert len({r.input_len for r in a}) > 5
    other = synthetic(BenchSettings.with_defaults({"seed": 5, "num_requests": 50}))
    assert [r.input_ids for r in other] != [r.input_ids for r in a]


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 3}\n\n{"input_ids": [1, 2]}\n')
    s = BenchSettings.with_defaults({"dataset": str(path), "num_requests": 5, "output_len": 7})
    reqs = build_workload(s)
    assert [r.output_len for r in reqs] == [3, 7, 3, 7, 3]
    assert reqs[0].body(s)["text"] == "hello" and reqs[1].body(s)["input_ids"] == [1, 2]
    path.write_text('{"prompt": "x"}\n{"output_len": 2}\n')
    with pytest.raises(TopologyError, match="d.jsonl:2"):
        load_jsonl(path, s)
    with pytest.raises(TopologyError, match="no such file"):
        load_jsonl(tmp_path / "missing.jsonl", s)


def test_arrivals():
    s = BenchSettings.with_defaults({"request_rate": 10, "arrival": "fixed"})
    assert arrival_offsets(3, s) == pytest.approx([0.0, 0.1, 0.2])
    p = BenchSettings.with_defaults({"request_rate": 10, "arrival": "poisson", "seed": 1})
    offs = arrival_offsets(4000, p)
    assert offs == arrival_offsets(4000, p) and offs == sorted(offs)
    assert offs[-1] / len(offs) == pytest.approx(0.1, rel=0.05)  # mean gap 1/rate
    assert arrival_offsets(3, BenchSettings.with_defaults()) == [0.0, 0.0, 0.0]


def test_itl_splits_multi_token_chunks():
    r = RequestResult(0, "", 1, 5, start=0.0, token_times=[1.0, 1.0, 1.3, 1.5, 1.5])
    assert request_itls(r) == pytest.approx([0.0, 0.3, 0.1, 0.1])
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([7], 99) == 7


def test_cli_bench_bad_input_exits_2(capsys):
    assert main(["bench", "http://127.0.0.1:1", "bench.arrival=burst"]) == 2
    assert "bench.arrival" in capsys.readouterr().err
    assert main(["bench", "--run-dir", "/nonexistent-run"]) == 2


def test_summary_per_tag():
    from pdtopo.bench.settings import Slo
    from pdtopo.bench.stats import summarize

    rs = [RequestResult(i, "long" if i % 2 else "decode", 4, 2, start=0.0, end=1.0,
                        token_times=[0.1 * (i + 1), 0.5]) for i in range(4)]
    st = summarize(rs, 1.0, Slo(None, None))
    assert set(st["by_tag"]) == {"decode", "long"}
    assert st["by_tag"]["long"]["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert "by_tag" not in st["by_tag"]["long"]


def test_multiturn_conversations_share_system_prompts_and_grow_turn_by_turn():
    s = BenchSettings.with_defaults({"workload": "multiturn", "output_len": 5, "seed": 2,
                                     "multiturn": {"system_prompts": 2, "system_len": 40,
                                                   "conversations": 5, "turns": 3,
                                                   "user_len": 7}})
    assert s.num_workload_requests == 15
    convs = multiturn(s)
    assert convs == multiturn(s)  # seeded
    assert len(convs) == 5 and {len(c.system_ids) for c in convs} == {40}
    assert convs[0].system_ids == convs[2].system_ids != convs[1].system_ids
    c = convs[0]
    first = c.prompt([], 0)
    assert first == c.system_ids + c.user_ids[0]
    answer = [9, 9, 9, 9, 9]
    second = c.prompt(first + answer, 1)
    assert second == first + answer + c.user_ids[1] and len(second) == 40 + 7 + 5 + 7
    assert all(len(u) == 7 for u in c.user_ids) and c.output_lens == [5, 5, 5]
    assert compose_config(["bench.workload=multiturn"]).bench.multiturn.turns >= 3
