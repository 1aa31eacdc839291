"""The `planner` config group (conf/planner/default.yaml): defaults, errors that name the key and
the value, and plans, renders and diffs with the group present (off, on, or absent in an older
conf/)."""

from __future__ import annotations

import pytest
from omegaconf import open_dict

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.plan.k8s import k8s_plan
from pdtopo.launcher.render import diff
from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.settings import PlannerSettings

CPUS = [0, 1]


def _plan(*overrides: str):
    return expand_plan(compose_config(["model=tiny_llama", *overrides]), run_dir="/run",
                       python="py", cpus=CPUS)


def test_defaults_are_off_and_take_the_bench_slo():
    cfg = compose_config(["bench.slo.ttft_ms=500"])
    s = PlannerSettings.from_config(cfg.planner)
    assert (s.enabled, s.mode, s.capacity.source, s.capacity.profile) == \
        (False, "act", "auto", None)
    assert (s.slo.ttft_ms, s.slo.itl_ms) == (500, cfg.bench.slo.itl_ms)
    assert (s.prefill.min, s.prefill.max, s.decode.min, s.decode.max) == (1, None, 1, None)


@pytest.mark.parametrize("values,key,value", [
    ({"mode": "bogus"}, "planner.mode", "bogus"),
    ({"interval_s": 0}, "planner.interval_s", 0),
    ({"chips": 0}, "planner.chips", 0),
    ({"prefill": {"min": 0}}, "planner.prefill.min", 0),
    ({"decode": {"min": 3, "max": 2}}, "planner.decode.max", 2),
    ({"slo": {"percentile": 95}}, "planner.slo.percentile", 95),
    ({"slo": {"itl_ms": -1}}, "planner.slo.itl_ms", -1),
    ({"hysteresis": {"margin": 1.5}}, "planner.hysteresis.margin", 1.5),
    ({"capacity": {"source": "guess"}}, "planner.capacity.source", "guess"),
    ({"capacity": {"source": "profile"}}, "planner.capacity.profile", None),
    ({"intervals": 3}, "planner.intervals", 3),  # an unknown key
])
def test_bad_values_name_the_key_and_the_value(values, key, value):
    with pytest.raises(TopologyError) as err:
        PlannerSettings.with_defaults(values)
    assert err.value.key == key
    assert err.value.value == value
    assert str(err.value).startswith(f"{key}=")


def test_budget_of_the_hosts_and_the_bounds():
    s = PlannerSettings.with_defaults({"chips": 6, "decode": {"max": 3}})
    b = s.budget([8, 4], prefill_chips=2, decode_chips=2)
    assert b.chips == 10  # 6 of the first host, all 4 of the second
    assert b.refusal(Counts(1, 3)) is None
    assert "maximum of 3" in b.refusal(Counts(1, 4))
    assert "12 chips" in b.refusal(Counts(5, 1))
    assert "below its minimum of 1" in Budget(chips=None, min_prefill=0).refusal(Counts(0, 1))


def test_plans_render_with_the_planner_off_on_and_absent():
    base = _plan()
    assert [p.name for p in _plan("planner.enabled=true").processes] == \
        [p.name for p in base.processes]
    older = compose_config(["model=tiny_llama"])
    with open_dict(older):
        del older["planner"]  # conf/ at a revision before the planner
    assert [p.name for p in expand_plan(older, cpus=CPUS).processes] == \
        [p.name for p in base.processes]


@pytest.mark.parametrize("overrides,key", [
    (["planner.mode=bogus"], "planner.mode"),  # checked even while the planner is off
    (["planner.enabled=true", "topology=colocated_cpu"], "planner.enabled"),
    (["planner.enabled=true", "planner.chips=1"], "planner.chips"),
    (["planner.enabled=true", "planner.prefill.max=0"], "planner.prefill.max"),
    (["planner.enabled=true", "topology=2p2d_cpu", "planner.decode.max=1"],
     "planner.decode.max"),
    # what `pdtopo scale`, the planner's hands, cannot work on
    (["planner.enabled=true", "proxy=mini_lb"], "planner.enabled"),
    (["planner.enabled=true", "topology=1p1d_cpu_2host", "server.bind_host=null"],
     "planner.enabled"),
    (["planner.enabled=true", "topology=1p1d_cpu_mp"], "planner.enabled"),
])
def test_the_plan_refuses_a_planner_that_cannot_run(overrides, key):
    with pytest.raises(TopologyError) as err:
        _plan(*overrides)
    assert err.value.key == key


def test_diff_shows_the_planner_keys_and_its_program_only():
    """The planner is a supervisord program beside the plan (like the router watch): no
    plan process changes, the conf gains `[program:planner]`."""
    a = compose_config(["model=tiny_llama"])
    b = compose_config(["model=tiny_llama", "planner.enabled=true", "planner.mode=recommend"])
    res = diff.diff_configs(a, b, CPUS)
    assert ("planner.enabled", False, True) in res.config
    assert ("planner.mode", "act", "recommend") in res.config
    assert not (res.added or res.removed or res.processes)
    added = [line[1:] for line in res.conf_diff if line.startswith("+") and
             not line.startswith("+++")]
    assert "[program:planner]" in added
    assert "command=python -m pdtopo.launcher.programs.planner RUN_DIR" in added
    assert "autorestart=true" in added and "priority=999" in added
    assert not any(line.startswith("-") and not line.startswith("---")
                   for line in res.conf_diff)


def test_k8s_manifests_refuse_the_planner():
    """The rendered manifests have no planner program (docs/planner.md, Kubernetes)."""
    cfg = compose_config(["model=tiny_llama", "topology=1p1d_v6e8", "planner.enabled=true",
                          "server.bind_host=null"])
    plan = expand_plan(cfg, run_dir="/run", python="py", cpus=CPUS, routable=True)
    with pytest.raises(TopologyError) as err:
        k8s_plan(plan, cfg)
    assert err.value.key == "planner.enabled"
    assert "pdtopo scale" in err.value.message


def test_a_planner_with_no_room_is_warned_about():
    full = _plan("planner.enabled=true")  # 1p1d_cpu: cpu-2, both chips held
    assert any(w.startswith("planner: 1P1D fills the budget") for w in full.warnings), \
        full.warnings
    roomy = _plan("planner.enabled=true", "topology.accelerator=cpu-3")
    assert not any(w.startswith("planner:") for w in roomy.warnings)
    assert not any(w.startswith("planner:") for w in _plan().warnings)
