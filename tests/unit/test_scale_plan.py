"""`pdtopo scale` planning (pure): new instances get free chips and unused ports, running
programs keep theirs, and the written config expands to the plan that runs."""

from __future__ import annotations

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.plan.scale import changed_leaders, parse_counts, scaled_config, scaled_plan

CPUS = [0, 1]


def _plan(cfg):
    return expand_plan(cfg, run_dir="/run", python="py", cpus=CPUS)


def _scale(cfg, plan, counts, **kw):
    new_cfg = scaled_config(cfg, plan, counts, **kw)
    return new_cfg, scaled_plan(new_cfg, plan, run_dir="/run", python="py", cpus=CPUS)


@pytest.fixture
def cpu6():
    cfg = compose_config(["model=tiny_llama", "topology=2p2d_cpu", "topology.accelerator=cpu-6"])
    return cfg, _plan(cfg)


def test_parse_counts():
    assert parse_counts(["prefill=3"]) == {"prefill": 3}
    assert parse_counts(["decode=1", "prefill=2"]) == {"decode": 1, "prefill": 2}
    for bad, key in ((["prefill=0"], "topology.prefill.instances"),
                     (["decode=x"], "topology.decode.instances"),
                     (["prefill=2", "prefill=3"], "topology.prefill.instances"),
                     (["colocated=2"], "scale"), (["prefill"], "scale"), ([], "scale")):
        with pytest.raises(TopologyError) as exc:
            parse_counts(bad)
        assert exc.value.key == key, bad


def test_scale_out_takes_free_chips_and_next_ports(cpu6):
    cfg, plan = cpu6
    new_cfg, new = _scale(cfg, plan, {"prefill": 3})
    by = new.by_name()
    old = plan.by_name()
    assert by["prefill_2"].chips == [4]
    # base + k would give prefill_2 the ports of decode_0 (30002...): the next unused instead
    assert by["prefill_2"].ports == {"http": 30004, "transfer": 31004, "zmq": 32004}
    for name in ("bootstrap", "prefill_0", "prefill_1", "decode_0", "decode_1"):
        assert by[name] == old[name], name  # running programs are untouched
    proxy = by["proxy"].command
    assert proxy[proxy.index("http://127.0.0.1:30004") + 1] == "32004"
    assert proxy.count("--prefill") == 3 and proxy.count("--decode") == 2
    added, removed = changed_leaders(plan, new)
    assert [p.name for p in added] == ["prefill_2"] and removed == []
    # the written config says what runs: expanding it again gives the same ports and chips
    again = _plan(new_cfg)
    assert [(p.name, p.ports, p.chips) for p in again.processes] == \
           [(p.name, p.ports, p.chips) for p in new.processes]
    assert new_cfg.topology.prefill.instances == 3 and cfg.topology.prefill.instances == 2


def test_scale_in_removes_the_highest_index_and_keeps_the_rest(cpu6):
    cfg, plan = cpu6
    mid_cfg, mid = _scale(cfg, plan, {"prefill": 3})
    end_cfg, end = _scale(mid_cfg, mid, {"prefill": 1})
    assert [p.name for p in end.processes] == ["bootstrap", "prefill_0", "decode_0", "decode_1",
                                               "proxy"]
    added, removed = changed_leaders(mid, end)
    assert added == [] and [p.name for p in removed] == ["prefill_2", "prefill_1"]
    assert end.by_name()["decode_1"] == plan.by_name()["decode_1"]
    # growing again reuses the freed chips, never a port a program held
    _, back = _scale(end_cfg, end, {"prefill": 2})
    assert back.by_name()["prefill_1"].chips == [1]
    assert back.by_name()["prefill_1"].ports["http"] == 30004


def test_scale_skips_ports_in_use_and_refuses_without_chips(cpu6):
    cfg, plan = cpu6
    _, new = _scale(cfg, plan, {"decode": 3}, port_taken=lambda addr, port: port == 30004)
    assert new.by_name()["decode_2"].ports["http"] == 30005
    with pytest.raises(TopologyError) as exc:
        scaled_config(cfg, plan, {"prefill": 4, "decode": 3})
    assert exc.value.key == "topology.decode.instances" and "no 1 free chips" in str(exc.value)
    full = compose_config(["model=tiny_llama", "topology=2p2d_cpu"])  # cpu-4: all four chips used
    with pytest.raises(TopologyError, match="bigger topology.accelerator"):
        scaled_config(full, _plan(full), {"prefill": 3})


def test_scale_refusals():
    mp = compose_config(["model=tiny_llama", "topology=1p1d_cpu_mp"])
    with pytest.raises(TopologyError) as exc:
        scaled_config(mp, _plan(mp), {"prefill": 2})
    assert exc.value.key == "topology.prefill.processes_per_instance"
    col = compose_config(["model=tiny_llama", "topology=colocated_cpu"])
    with pytest.raises(TopologyError) as exc:
        scaled_config(col, _plan(col), {"prefill": 2})
    assert exc.value.key == "topology.mode"


def test_tpu_scale_keeps_tpu_process_ports():
    cfg = compose_config(["model=tiny_llama", "topology=2p2d"])
    plan = _plan(cfg)
    small_cfg, small = _scale(cfg, plan, {"prefill": 1})
    grown_cfg, grown = _scale(small_cfg, small, {"prefill": 2})
    p1 = grown.by_name()["prefill_1"]
    assert p1.chips == [2, 3]  # the chips prefill_1 had before it was removed
    assert p1.ports["tpu_process"] == 8480  # above every port a server held (8476..8479)
    assert p1.env["TPU_PROCESS_PORT"] == "8480"
    assert grown_cfg.topology.prefill.port_overrides[1]["tpu_process"] == 8480
    again = _plan(grown_cfg)
    assert [(p.name, p.ports) for p in again.processes] == [(p.name, p.ports)
                                                            for p in grown.processes]
