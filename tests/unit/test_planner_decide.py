"""The planner's decision rules, one interval at a time (pdtopo/planner/decide.py): scale out,
role change when the budget is full, scale in, hysteresis without flapping, never below 1P1D,
one change at a time, back-off after a failure, recommend = act with the flag off."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.capacity import InstanceProfile, LiveCapacity
from pdtopo.planner.decide import PlannerState, decide, finished, started
from pdtopo.planner.observe import InstanceObservation, Observation
from pdtopo.planner.settings import PlannerSettings
from pdtopo.planner.step import PlannerMemory, plan_step

# one instance: 8000 prompt tok/s; decode 15.5 ms a step alone, 47 ms at its cap of 64
PROFILE = InstanceProfile(prefill_tps=8000, decode_tps=((1, 64.5), (64, 1361.7)), max_batch=64)
INTERVAL = 10.0


@pytest.fixture(scope="module")
def settings() -> PlannerSettings:
    return PlannerSettings.with_defaults({
        "interval_s": INTERVAL, "slo": {"ttft_ms": 1000, "itl_ms": 50, "percentile": 90},
        "hysteresis": {"min_change_interval_s": 60, "margin": 0.1, "backoff_s": 120},
        "capacity": {"source": "profile", "profile": "measured.json"}})


def p_inst(k: int, tps: float, prompt_len: float = 4000, queue: float = 0,
           ttft_ms: float = 300) -> InstanceObservation:
    return InstanceObservation(f"prefill_{k}", "prefill", queue, None, tps, 0.0,
                               tps / prompt_len, 1.0 if tps else 0.0,
                               ttft_ms={"p50": ttft_ms / 2, "p90": ttft_ms, "p99": ttft_ms},
                               busy=queue > 0)


def d_inst(k: int, tps: float, output_len: float = 50, queue: float = 0, batch: float = 8,
           itl_ms: float = 20) -> InstanceObservation:
    return InstanceObservation(f"decode_{k}", "decode", queue, None, 0.0, tps,
                               tps / output_len, batch if tps else 0.0,
                               ttft_ms={"p50": 300, "p90": 400, "p99": 500},
                               itl_ms={"p50": itl_ms, "p90": itl_ms, "p99": itl_ms})


def observation(prefill: list, decode: list, at: float = 100.0) -> Observation:
    return Observation(at, INTERVAL, (*prefill, *decode))


def step(settings, obs, counts, budget, memory=None, profile=PROFILE):
    return plan_step(obs, counts, budget, settings, memory or PlannerMemory(), obs.at, profile)


def test_prompt_heavy_load_on_1p1d_with_room_for_3_adds_a_prefill(settings):
    obs = observation([p_inst(0, 6000, queue=4)], [d_inst(0, 75)])
    d, _ = step(settings, obs, Counts(1, 1), Budget(chips=3))
    assert (d.action, d.role, d.target) == ("scale_out", "prefill", Counts(2, 1))
    assert d.label == "scale_out(prefill)" and d.act
    assert d.capacity_source == "prefill=profile decode=profile"
    assert d.needed["prefill"] > 1.1 and d.needed["decode"] < 0.5
    assert d.load.mean_prompt_len == pytest.approx(4000)
    line = json.loads(json.dumps(d.to_dict()))  # one JSON line of the planner's log
    assert line["label"] == "scale_out(prefill)" and line["target"] == {"prefill": 2,
                                                                      "decode": 1}


def test_decode_heavy_load_with_the_budget_full_moves_a_prefill_to_decode(settings):
    obs = observation([p_inst(0, 300, 200), p_inst(1, 300, 200)],
                      [d_inst(0, 1300, 433, queue=20, batch=64, itl_ms=47)])
    d, _ = step(settings, obs, Counts(2, 1), Budget(chips=3))
    assert (d.action, d.from_role, d.role, d.target) == \
        ("role_change", "prefill", "decode", Counts(1, 2))
    assert d.label == "role_change(prefill->decode)"
    assert "2P2D needs 4 chips, the budget is 3" in d.reason


def test_budget_full_and_nothing_to_spare_changes_nothing(settings):
    obs = observation([p_inst(0, 7000, queue=8), p_inst(1, 7000, queue=8)],
                      [d_inst(0, 1300, 433, queue=20, batch=64, itl_ms=47)])
    d, _ = step(settings, obs, Counts(2, 1), Budget(chips=3))
    assert d.action == "none" and "cannot spare one" in d.reason


def test_a_load_that_drops_scales_in_one_at_a_time_and_never_below_1p1d(settings):
    counts, memory, now, log = Counts(2, 3), PlannerMemory(), 0.0, []
    for _ in range(40):  # a quiet load: 500 prompt tok/s, 50 decode tok/s
        now += INTERVAL
        prefill = [p_inst(k, 500 / counts.prefill) for k in range(counts.prefill)]
        decode = [d_inst(k, 50 / counts.decode) for k in range(counts.decode)]
        d, memory = step(settings, observation(prefill, decode, now), counts, Budget(chips=5),
                         memory)
        if d.act:
            assert d.action == "scale_in" and sum(vars(d.target).values()) == \
                sum(vars(counts).values()) - 1
            memory = memory.with_state(finished(started(memory.state, d, now), now, ok=True))
            counts = d.target
            log.append((now, d.label))
    assert counts == Counts(1, 1)  # and no further
    assert len(log) == 3
    assert all(b[0] - a[0] >= 60 for a, b in zip(log, log[1:], strict=False))  # min interval
    assert Budget(chips=None, min_prefill=0).refusal(Counts(0, 1)) is not None  # bounds or not


@pytest.mark.parametrize("start,threshold,margin,changes", [
    (Counts(2, 1), 2 * 1.1, 0.1, 1),  # at 2 P's scale-out threshold: out once, never back in
    (Counts(3, 1), 2 * 0.9, 0.1, 1),  # at 3 P's scale-in threshold: in once, never back out
    (Counts(2, 1), 2.0, 0.1, 0),      # at 2 P's capacity exactly: nothing
    (Counts(2, 1), 2.0, 0.0, None),   # the same without a margin: it flaps (the control)
])
def test_a_load_at_the_threshold_does_not_flap(settings, start, threshold, margin, changes):
    """100 intervals of a load within 5 % of a threshold, no minimum time between changes
    and the peak forgotten at once: the margin's band alone keeps the changes to one."""

    def run(margin: float) -> list[str]:
        calm = replace(settings, hysteresis=replace(settings.hysteresis, margin=margin,
                                                    min_change_interval_s=0))
        capacity = step(calm, observation([p_inst(0, 1000)], [d_inst(0, 50)]), start,
                        Budget(chips=5))[0].capacity.prefill.tokens_per_s
        rng, counts, memory, labels = random.Random(0), start, PlannerMemory(), []
        for i in range(100):
            load = threshold * capacity * rng.uniform(0.95, 1.05)
            prefill = [p_inst(k, load / counts.prefill) for k in range(counts.prefill)]
            obs = observation(prefill, [d_inst(0, 50)], at=(i + 1) * INTERVAL)
            d, memory = step(calm, obs, counts, Budget(chips=5), memory)
            if d.act:
                labels.append(d.label)
                memory = memory.with_state(finished(started(memory.state, d, obs.at),
                                                    obs.at, True))
                counts = d.target
        return labels

    labels = run(margin)
    if changes is None:
        assert len(labels) > 10
    else:
        assert len(labels) == changes, labels


def test_recommend_decides_the_same_and_only_clears_the_flag(settings):
    obs = observation([p_inst(0, 6000, queue=4)], [d_inst(0, 75)])
    act, _ = step(settings, obs, Counts(1, 1), Budget(chips=3))
    rec, _ = step(replace(settings, mode="recommend"), obs, Counts(1, 1), Budget(chips=3))
    assert (rec.label, rec.target, rec.reason) == (act.label, act.target, act.reason)
    assert (act.mode, act.act, rec.mode, rec.act) == ("act", True, "recommend", False)


def test_one_change_at_a_time_the_interval_between_and_a_back_off_after_failure(settings):
    obs = observation([p_inst(0, 6000, queue=4)], [d_inst(0, 75)])
    first, memory = step(settings, obs, Counts(1, 1), Budget(chips=4))
    busy = started(PlannerState(), first, 100.0)

    def at(state: PlannerState, now: float):
        return decide(first.load, Counts(1, 1), first.capacity, Budget(chips=4), settings,
                      state, now)

    assert "under way" in at(busy, 110).reason
    done = finished(busy, 130.0, ok=True)
    assert "hysteresis" in at(done, 150).reason  # 50 s after the start, 60 needed
    assert at(done, 160).action == "scale_out"
    failed = finished(busy, 130.0, ok=False)
    assert failed.failures == 1 and "backing off for 120 s" in at(failed, 240).reason
    assert at(failed, 250).action == "scale_out"  # 120 s after the failure
    twice = finished(started(failed, first, 250.0), 260.0, ok=False)
    assert "backing off for 240 s" in at(twice, 490).reason
    assert at(twice, 500).action == "scale_out"


def test_slo_pressure_acts_before_any_capacity_is_known(settings):
    live = replace(settings, capacity=replace(settings.capacity, source="live"))
    obs = observation([p_inst(0, 3000, queue=6, ttft_ms=2500)], [d_inst(0, 75)])
    d, memory = step(live, obs, Counts(1, 1), Budget(chips=3),
                     PlannerMemory(live=LiveCapacity(max_batch=64)), profile=None)
    assert (d.action, d.role) == ("scale_out", "prefill")
    assert "TTFT p90 2500 ms > 1000 ms with 6 waiting" in d.reason
    assert d.capacity_source.startswith("prefill=live")  # busy: its rate is measured now
    assert memory.live.prefill_tps == 3000
