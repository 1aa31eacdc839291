"""The PD simulator (pdtopo/planner/simulate.py) with the planner's decision code in its loop:
sane (more D lowers ITL under a decode-heavy load), deterministic for a seed, and the planner
beats the static splits of its budget on a trace that shifts phase."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdtopo.bench.settings import Slo
from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.capacity import InstanceProfile
from pdtopo.planner.compare import compare, static_splits
from pdtopo.planner.settings import PlannerSettings
from pdtopo.planner.simulate import SimParams, _Sim, simulate
from pdtopo.planner.trace import Phase, SimRequest, phased_trace, trace_span

# one instance: 2000 prompt tok/s; a decode step of 17 ms alone, 47 ms at its cap of 16
STEPS = {1: 0.017, 16: 0.047}
PROFILE = InstanceProfile(prefill_tps=2000, decode_tps=tuple((b, b / t) for b, t in STEPS.items()),
                          max_batch=16, transfer_s_per_token=2e-6)
PARAMS = SimParams(PROFILE, chunk_tokens=512, startup_s=20.0, drain_s=2.0)
SLO = Slo(ttft_ms=1000, itl_ms=50)
# prompt-heavy (3000 prompt tok/s: 3 P at 50 %, 2 at 75 %), decode-heavy (750 output tok/s:
# 3 D at 74 % of 1020, 2 D over), prompt-heavy again
PHASES = [Phase("prompt", 200, 3.0, 1000, 50), Phase("decode", 200, 6.0, 100, 125),
          Phase("prompt_again", 200, 3.0, 1000, 50)]


@pytest.fixture(scope="module")
def settings() -> PlannerSettings:
    return PlannerSettings.with_defaults({
        "interval_s": 5, "slo": {"ttft_ms": SLO.ttft_ms, "itl_ms": SLO.itl_ms},
        "hysteresis": {"min_change_interval_s": 30, "margin": 0.1},
        "capacity": {"source": "profile", "profile": "measured.json"}})


def test_more_decode_capacity_lowers_itl_under_a_decode_heavy_load():
    phases = [Phase("decode", 60, 6.0, 100, 125)]
    trace, span = phased_trace(phases, seed=1), trace_span(phases)
    one = simulate(trace, PARAMS, Counts(1, 1), slo=SLO, duration_s=span)
    three = simulate(trace, PARAMS, Counts(1, 3), slo=SLO, duration_s=span)
    assert three.latency("itl", 50) < one.latency("itl", 50)
    assert three.latency("ttft", 99) < one.latency("ttft", 99)
    assert three.goodput_rps > one.goodput_rps
    assert three.stats["requests"]["failed"] == 0 and three.decisions == []


def test_the_same_seed_gives_the_same_run(settings):
    phases = [Phase("prompt", 40, 3.0, 1000, 50), Phase("decode", 40, 6.0, 100, 125)]
    budget = settings.budget([3])

    def run(seed: int):
        r = simulate(phased_trace(phases, seed), PARAMS, Counts(1, 1), slo=SLO,
                     duration_s=trace_span(phases), planner=settings, budget=budget)
        return r.stats, [(d.at, d.label, d.reason) for d in r.decisions], r.counts

    assert run(3) == run(3)
    assert run(3)[0] != run(4)[0]


def test_static_splits_of_a_budget():
    assert static_splits(Budget(chips=4)) == [Counts(1, 3), Counts(2, 2), Counts(3, 1)]
    assert static_splits(Budget(chips=8, prefill_chips=2, decode_chips=4)) == \
        [Counts(2, 1)]  # 1P1D leaves room for one more P
    assert static_splits(Budget(chips=5, max_decode=2)) == [Counts(3, 2), Counts(4, 1)]


def test_the_planner_beats_every_static_split_on_a_shifting_trace(settings):
    trace = phased_trace(PHASES, seed=0)
    budget = settings.budget([4])  # four one-chip instances
    cmp = compare(trace, PARAMS, budget, settings, start=Counts(2, 2), slo=SLO,
                  duration_s=trace_span(PHASES))
    assert set(cmp.static) == {Counts(1, 3), Counts(2, 2), Counts(3, 1)}
    even = cmp.static[Counts(2, 2)]  # the 1P1D-shaped split of the budget
    report = {str(c): round(r.goodput_rps, 3) for c, r in cmp.static.items()}
    report["planned"] = round(cmp.planned.goodput_rps, 3)
    assert cmp.ratio(even) >= 1.3, report
    assert cmp.ratio(cmp.best_static) >= 1.1, report
    labels = [d.label for d in cmp.planned.actions]
    # toward P in the prompt phases, toward D in the decode phase, one change at a time
    assert "role_change(prefill->decode)" in labels and "role_change(decode->prefill)" in labels
    assert all(1 <= c.prefill and 1 <= c.decode and c.prefill + c.decode <= 4
               for _, c in cmp.planned.counts)
    assert cmp.planned.stats["requests"]["failed"] == 0


def test_emit_lag_moves_one_lag_from_each_answers_last_gap_to_its_first():
    """D's overlap read-back (SimParams.emit_lag_s): a decode token leaves D the lag after its
    step ends, the first (at admission) and the last (not carried on) at once; off (0) by
    default, which keeps the old timings."""
    trace = [SimRequest(0, 0.0, 100, 8, ""), SimRequest(1, 5.0, 100, 8, "")]
    step = PROFILE.step_s(1)

    def gaps(params: SimParams) -> list[list[float]]:
        sim = _Sim(trace, params, Counts(1, 1), None, None)
        sim.run()
        return [[b - a for a, b in zip(r.token_times, r.token_times[1:])]  # noqa: B905
                for r in sim.reqs]

    assert SimParams(PROFILE).emit_lag_s == 0.0
    for g in gaps(PARAMS):
        assert g == pytest.approx([step] * 7)
    lag = 0.004
    lagged = gaps(replace(PARAMS, emit_lag_s=lag))
    for g in lagged:
        assert g == pytest.approx([step + lag] + [step] * 5 + [step - lag])
    # the answer ends when it did: TTFT and E2E unchanged, only the gaps between move
    plain = simulate(trace, PARAMS, Counts(1, 1), slo=SLO, duration_s=10).stats
    moved = simulate(trace, replace(PARAMS, emit_lag_s=lag), Counts(1, 1), slo=SLO,
                     duration_s=10).stats
    assert moved["ttft_ms"] == plain["ttft_ms"] and moved["e2e_ms"] == plain["e2e_ms"]
    assert moved["itl_ms"]["p99"] == pytest.approx((step + lag) * 1e3, rel=0.05)
    # a lag longer than the step never puts the last token before the one before it
    for g in gaps(replace(PARAMS, emit_lag_s=2 * step)):
        assert min(g) >= 0.0


def test_jitter_unit_averages_the_noise_over_a_longer_span():
    """With `jitter_unit_s`, a duration of n units takes the mean of n draws; without it (the
    default) one draw, as before."""
    params = replace(PARAMS, jitter=(0.0, 2.0))
    one = _Sim([], params, Counts(1, 1), None, None)
    assert {one.noise(100.0) for _ in range(50)} == {0.0, 2.0}
    unit = _Sim([], replace(params, jitter_unit_s=1.0), Counts(1, 1), None, None)
    assert unit.noise(0.4) in (0.0, 2.0)
    draws = [unit.noise(400.0) for _ in range(20)]
    assert all(0.7 < d < 1.3 for d in draws)
