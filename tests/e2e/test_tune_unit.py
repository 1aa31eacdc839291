"""`pdtopo tune` without deployments: the rate search against synthetic goodput curves (a fake
bench), the candidates a budget gives and the planner's verdict on them, the result store a
rerun resumes from (a tune killed mid-way repeats no finished run), the ranking and the
topology file it writes, settings errors and the dry run on a TPU topology."""

from __future__ import annotations

import math
import random

import pytest
import yaml

from pdtopo.cli import main
from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError, typed_topology
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.plan.tpu_env import accelerator_spec
from pdtopo.tune import report
from pdtopo.tune.candidates import budget_of, candidate_overrides, check_candidates
from pdtopo.tune.outcome import Outcome
from pdtopo.tune.search import find_max_rate
from pdtopo.tune.settings import TuneSettings
from pdtopo.tune.store import ResultStore, run_key

# ------------------------------------------------------------------ search


def _curve(threshold: float, noise: float = 0.0, seed: int = 0):
    """Goodput fraction of a synthetic server: ~1 below `threshold` req/s, falling above."""
    rng = random.Random(seed)
    calls = []

    def measure(rate: float) -> float:
        calls.append(rate)
        g = 1.0 if rate <= threshold else max(0.0, 1.0 - (rate - threshold) / threshold)
        return min(1.0, max(0.0, g + rng.uniform(-noise, noise)))

    return measure, calls


@pytest.mark.parametrize("threshold", [0.3, 1.0, 2.7, 5.0, 13.0, 40.0])
@pytest.mark.parametrize("max_runs", [3, 6, 10])
def test_search_finds_the_threshold_within_one_bisection_step(threshold, max_runs):
    s = TuneSettings.with_defaults({"goodput_target": 0.9, "start_rate": 1.0, "growth": 2.0,
                                    "precision": 0.05, "max_runs_per_candidate": max_runs})
    measure, calls = _curve(threshold)
    res = find_max_rate(measure, s)
    assert len(calls) == len(res.runs) <= max_runs  # the run budget is never exceeded
    # the true limit: the highest rate whose goodput meets the target
    limit = threshold * (1 + (1 - s.goodput_target))
    if res.bounded:
        assert res.best_rate <= limit < res.fail_rate
        if len(calls) < max_runs:  # stopped by precision, not by the budget
            assert (res.fail_rate - res.best_rate) / res.fail_rate < s.precision
        # within one bisection step: the last step's interval holds the limit
        assert limit - res.best_rate <= res.fail_rate - res.best_rate
    else:  # every rate tried passed: the answer is a lower bound
        assert res.best_rate == max(calls) <= limit
    assert all(r in calls for r, _ in res.runs)


def test_search_bisects_down_when_the_first_rate_fails():
    s = TuneSettings.with_defaults({"start_rate": 8.0, "max_runs_per_candidate": 6,
                                    "precision": 0.01})
    measure, calls = _curve(1.5)
    res = find_max_rate(measure, s)
    assert calls[0] == 8.0 and calls[1] == 4.0 and calls[2] == 2.0 and len(calls) == 6
    assert 0 < res.best_rate <= 1.65 < res.fail_rate


def test_search_reports_nothing_when_no_rate_passes():
    s = TuneSettings.with_defaults({"max_runs_per_candidate": 4})
    res = find_max_rate(lambda rate: 0.0, s)
    assert res.best_rate == 0.0 and len(res.runs) == 4 and res.bounded


# ------------------------------------------------------------------ candidates


def _candidates(*overrides: str, chips=None, cpus=(0, 1)):
    cfg = compose_config(["model=tiny_llama", *overrides])
    topo = typed_topology(cfg)
    acc = accelerator_spec(topo.accelerator, topo.platform)
    budget = budget_of(topo, acc, chips)
    cands = candidate_overrides(topo, acc, budget)
    return budget, check_candidates(
        cands, lambda extra: compose_config(["model=tiny_llama", *overrides, *extra]), list(cpus))


def test_two_cpu_chips_give_the_four_candidates():
    budget, checked = _candidates("topology=1p1d_cpu", chips=2)
    assert budget == 2
    assert [c.candidate.slug for c in checked] == ["colocated-tp2", "dp2-tp1", "pd-1p1-1d1",
                                                   "colocated-tp1"]
    assert all(c.error is None for c in checked)
    modes = {c.candidate.slug: c.plan.mode for c in checked}
    assert modes == {"colocated-tp2": "colocated", "dp2-tp1": "dp", "pd-1p1-1d1": "pd",
                     "colocated-tp1": "colocated"}
    dp = next(c.plan for c in checked if c.candidate.slug == "dp2-tp1")
    router = dp.by_name()["proxy"].command
    assert "--worker-urls" in router and "--pd-disaggregation" not in router
    assert [u for u in router if u.startswith("http://")] == [
        dp.by_name()["colocated_0"].url, dp.by_name()["colocated_1"].url]
    # on cpu-N the chips share the cores: each candidate is charged the cores it is pinned to
    assert {c.units for c in checked} == {2}


def test_v6e8_candidates_use_the_planner_and_the_model_check():
    budget, checked = _candidates("topology=1p1d_v6e8")
    assert budget == 8
    by_slug = {c.candidate.slug: c for c in checked}
    assert {"colocated-tp4", "dp2-tp4", "pd-1p4-1d4", "pd-2p2-2d2", "dp8-tp1"} <= set(by_slug)
    pd = by_slug["pd-1p4-1d4"].plan.by_name()
    assert pd["prefill_0"].chips == [0, 1, 2, 3] and pd["decode_0"].chips == [4, 5, 6, 7]
    assert pd["decode_0"].env["TPU_VISIBLE_CHIPS"] == "4,5,6,7"
    assert by_slug["colocated-tp1"].units == 1 and by_slug["dp2-tp4"].units == 8
    # P and D of different TP (resharded): a tp=4 prefill feeding two tp=2 decode instances
    het = by_slug["pd-1p4-2d2"]
    assert het.error is None and het.units == 8, het.error
    assert {p.name: p.mesh["tp"] for p in het.plan.processes if p.role in ("prefill", "decode")} \
        == {"prefill_0": 4, "decode_0": 2, "decode_1": 2}
    with pytest.raises(Exception, match="tune.chips"):
        _candidates("topology=1p1d_v6e8", chips=16)


def test_dry_run_lists_v6e8_candidates_with_tpu_env_and_starts_nothing(tmp_path, capsys):
    assert main(["tune", "topology=1p1d_v6e8", "model=tiny_llama", "tune.dry_run=true",
                 f"tune.dir={tmp_path / 'tune'}"]) == 0
    out = capsys.readouterr().out
    assert "for 8 chips (dry run: nothing started)" in out
    assert "pd-1p4-1d4: 1P tp=4 + 1D tp=4 (8 chips" in out
    assert "TPU_VISIBLE_CHIPS=4,5,6,7" in out and "TPU_CHIPS_PER_PROCESS_BOUNDS=1,4,1" in out
    assert "colocated-tp8: colocated tp=8 (8 chips, charged 8 units)" in out  # KV heads repeated
    assert not (tmp_path / "tune").exists()
    # a model no TP above 1 can split: every such candidate is refused by the model check
    assert main(["tune", "topology=1p1d_v6e8", "tune.dry_run=true", "model=tiny_llama",
                 "model.num_kv_heads=3", "model.num_heads=12",
                 "model.intermediate_size=384"]) == 0
    out = capsys.readouterr().out
    assert "colocated-tp8: colocated tp=8 (8 chips) refused: topology.colocated.mesh.tp=8: " \
        "tensor parallelism tp=8 needs model.num_kv_heads % tp == 0" in out
    assert "dp8-tp1: 8x colocated tp=1 behind the router (8 chips, charged 8 units)" in out


@pytest.mark.parametrize(("override", "key"), [
    ("tune.goodput_target=1.5", "tune.goodput_target"), ("tune.growth=1", "tune.growth"),
    ("tune.max_runs_per_candidate=0", "tune.max_runs_per_candidate"),
    ("tune.kinds=[pd,moe]", "tune.kinds"), ("tune.chips=-2", "tune.chips")])
def test_bad_settings_name_the_key(override, key, capsys):
    assert main(["tune", "tune.dry_run=true", override]) == 2
    assert key in capsys.readouterr().err
    with pytest.raises(TopologyError, match=r"tune\.start_rate"):
        TuneSettings.with_defaults({"start_rate": 0})


# ------------------------------------------------------------------ resume


def test_a_killed_tune_resumes_without_repeating_finished_runs(tmp_path):
    """The search replays from the store: a rerun asks the bench only for what is missing."""
    _, checked = _candidates("topology=1p1d_cpu", chips=2)
    cand = checked[2]
    key = run_key(cand.cfg)
    store = ResultStore(tmp_path)
    s = TuneSettings.with_defaults({"max_runs_per_candidate": 6, "precision": 0.01})
    benched: list[float] = []

    def measure_from(store: ResultStore, kill_after: int | None):
        def measure(rate: float) -> float:
            stored = store.rate(cand.candidate, key, rate)
            if stored is not None:
                return stored["goodput"]
            if kill_after is not None and len(benched) >= kill_after:
                raise KeyboardInterrupt
            benched.append(rate)
            g = 1.0 if rate <= 3.0 else 0.2
            store.save_rate(cand.candidate, key, rate, {"rate": rate, "goodput": g})
            return g
        return measure

    with pytest.raises(KeyboardInterrupt):
        find_max_rate(measure_from(store, kill_after=3), s)
    assert len(benched) == 3
    first = list(benched)
    res = find_max_rate(measure_from(ResultStore(tmp_path), None), s)
    assert benched[:3] == first and len(set(benched)) == len(benched)  # nothing run twice
    assert len(res.runs) == 6 and len(benched) == 6
    # a different workload is a different key: nothing reused
    other = compose_config(["model=tiny_llama", "topology=1p1d_cpu", *cand.candidate.overrides,
                            "bench.output_len=7"])
    assert run_key(other) != key
    ports = compose_config(["model=tiny_llama", "topology=1p1d_cpu", *cand.candidate.overrides,
                            "topology.ports.http_base=40000", "bench.request_rate=9"])
    assert run_key(ports) == key  # ports and the rate do not change a result


# ------------------------------------------------------------------ report


def test_ranking_files_and_the_best_topology_file(tmp_path, capsys):
    from pdtopo.launcher.operate import display

    _, checked = _candidates("topology=1p1d_cpu", chips=2)
    s = TuneSettings.with_defaults({"max_runs_per_candidate": 4})
    outcomes = []
    for c, limit in zip(checked, (2.0, 4.0, 3.0, 0.1), strict=True):
        out = Outcome(c, key=run_key(c.cfg), launch_s=12.5)

        def measure(rate, out=out, limit=limit):
            g = 1.0 if rate <= limit else 0.5
            out.records[rate] = {"rate": rate, "goodput": g, "stats": {
                "goodput": {"rps": rate * g}, "ttft_ms": {"p99": 100 * rate},
                "itl_ms": {"p99": 10.0}}}
            return g
        out.search = find_max_rate(measure, s)
        outcomes.append(out)
    cfg = compose_config(["model=tiny_llama", "topology=1p1d_cpu", f"tune.dir={tmp_path}"])
    code = report.write_report(tmp_path, outcomes, cfg, ["model=tiny_llama", "topology=1p1d_cpu"],
                               display.console())
    assert code == 0
    rows = report.ranked([report.row_of(o) for o in outcomes])
    assert [r.slug for r in rows] == ["dp2-tp1", "pd-1p1-1d1", "colocated-tp2", "colocated-tp1"]
    assert rows[-1].status == "no rate within the SLOs"
    assert math.isclose(rows[0].per_unit, rows[0].goodput_rps / 2)
    md = (tmp_path / "summary.md").read_text()
    assert "Best: **2x colocated tp=1 behind the router**" in md
    assert (tmp_path / "summary.csv").read_text().count("\n") == 5
    assert (tmp_path / "summary.png").stat().st_size > 1000
    best = yaml.safe_load((tmp_path / "topology" / "best.yaml").read_text())
    assert best["mode"] == "dp" and best["colocated"]["instances"] == 2
    assert best["name"] == "1p1d_cpu_tuned"
    # the file is a topology `pdtopo launch --config-dir DIR topology=best` accepts
    plan = expand_plan(_compose_with_dir(tmp_path), cpus=[0, 1])
    assert plan.mode == "dp" and len([p for p in plan.processes if p.role == "colocated"]) == 2
    diff_md = (tmp_path / "best.diff.md").read_text()
    assert "topology.mode" in diff_md and "dp" in diff_md


def _compose_with_dir(tune_dir):
    from hydra import compose, initialize_config_dir

    from pdtopo.config.compose import conf_dir
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name="config",
                       overrides=[f"hydra.searchpath=[file://{tune_dir}]", "topology=best"])


def test_a_candidate_that_fails_to_launch_is_recorded_and_skipped(tmp_path, monkeypatch):
    from pdtopo.bench.settings import BenchSettings
    from pdtopo.launcher.operate import display
    from pdtopo.tune import run as tune_run

    _, checked = _candidates("topology=1p1d_cpu", chips=2)
    launches = []

    def failing_ensure(self):
        launches.append(self.run_dir)
        raise tune_run.LaunchFailed("pdtopo launch failed (1): prefill_0 exited 2 times")

    monkeypatch.setattr(tune_run.Deployed, "ensure", failing_ensure)
    store = ResultStore(tmp_path)
    s = TuneSettings.with_defaults({"dir": str(tmp_path)})
    con = display.console()
    for _attempt in range(2):
        out = Outcome(checked[0], key=run_key(checked[0].cfg))
        tune_run.tune_candidate(out, s, BenchSettings.with_defaults(), store,
                                ["model=tiny_llama", "topology=1p1d_cpu"], con, "[1/4]")
        assert out.error == "pdtopo launch failed (1): prefill_0 exited 2 times"
        assert out.search is None
        assert len(launches) == 1  # the rerun skips it: its launch.json has the error
    row = report.row_of(out)
    assert row.status.startswith("launch failed: pdtopo launch failed (1)") and not row.ok
