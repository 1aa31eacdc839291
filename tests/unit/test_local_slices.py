"""Slice syntax and the plan of topology mode local (pure, fast)."""

from __future__ import annotations

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.config.local_slices import local_layout, parse_slice, parse_slices
from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import group_settings
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.runtime.local.engine import worker_names


def test_slice_syntax():
    assert parse_slice("4", "k") == (4,)
    assert parse_slice("2x2", "k") == (2, 2)
    assert parse_slice(" 2X4 ", "k") == (2, 4)
    assert parse_slice(2, "k") == (2,)
    assert parse_slices(["2", 2, "1x1"], "k") == [(2,), (2,), (1, 1)]
    assert parse_slices("4", "k") == [(4,)]


@pytest.mark.parametrize("bad", ["", "x2", "2x", "4.0", "-1", "0", "2x0", "a", True, 1.5, []])
def test_bad_slices_name_the_key(bad):
    with pytest.raises(TopologyError) as err:
        parse_slices(bad, "topology.decode_slices")
    assert err.value.key.startswith("topology.decode_slices")


def test_layout_assigns_devices_in_order():
    lay = local_layout("4", ["2", "1x2"])
    assert [(s.name, list(s.devices)) for s in lay.engines] == [
        ("prefill_0", [0, 1, 2, 3]), ("decode_0", [4, 5]), ("decode_1", [6, 7])]
    assert lay.num_chips == 8
    assert lay.mesh_summary() == {"prefill_0": 4, "decode_0": 2, "decode_1": 2}
    assert worker_names(lay) == ["prefill_0", "transfer", "decode_0", "decode_1"]
    two_prefills = local_layout(["1", "1"], "2")
    assert [s.name for s in two_prefills.prefill] == ["prefill_0", "prefill_1"]


def test_layout_needs_both_keys_and_enough_devices():
    with pytest.raises(TopologyError, match="prefill_slices"):
        local_layout(None, "2")
    with pytest.raises(TopologyError, match="need 6 devices but this process sees 4"):
        local_layout("2", ["2", "2"], num_devices=4)


def test_local_cpu_plan_is_one_program_over_all_chips():
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=local_cpu"]))
    (proc,) = plan.processes
    assert plan.mode == "local" and plan.proxy_url is None and plan.bootstrap_url is None
    assert proc.name == "local_0" and proc.role == "local"
    assert proc.chips == list(range(8))
    assert proc.mesh == {"prefill_0": 4, "decode_0": 2, "decode_1": 2}
    assert proc.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_local_plan_rejects_more_chips_than_the_accelerator():
    cfg = compose_config(["model=tiny_llama", "topology=local_cpu", "topology.decode_slices=[4,2]"])
    with pytest.raises(TopologyError) as err:
        expand_plan(cfg)
    assert err.value.key == "topology.decode_slices"


def test_local_plan_rejects_bad_slice_syntax():
    cfg = compose_config(["model=tiny_llama", "topology=local_cpu", "topology.prefill_slices=2y2"])
    with pytest.raises(TopologyError) as err:
        expand_plan(cfg)
    assert err.value.key == "topology.prefill_slices"


def test_local_settings_validation():
    cfg = compose_config([])
    assert group_settings(cfg, "local").transfer_backlog == 4
    for key, value in (("transfer_backlog", 0), ("decode_backlog", -1),
                       ("fault_inject_after_steps", "x")):
        bad = compose_config([f"local.{key}={value}"])
        with pytest.raises(ValueError, match=f"local.{key}"):
            group_settings(bad, "local")
