"""Multi-process and multi-host plans: rank tuples, coordinators, TPU cluster env per process,
ports of leaders and followers, and the validation errors of multi-host topologies."""

from __future__ import annotations

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import Plan, expand_plan


def plan_for(*overrides: str, cpus=None) -> Plan:
    # multi-host programs listen on their plan address (server.bind_host=null)
    return expand_plan(compose_config(["model=tiny_llama", "server.bind_host=null", *overrides]),
                       run_dir="/runs/r1", python="/venv/bin/python", cpus=cpus)


def test_1p1d_v6e16_golden():
    plan = plan_for("topology=1p1d_v6e16")
    procs = plan.by_name()
    assert [p.name for p in plan.processes] == [
        "bootstrap", "prefill_0_p0", "prefill_0_p1", "decode_0_p0", "decode_0_p1", "proxy"]
    assert [p.host for p in plan.processes] == ["tpu-0", "tpu-0", "tpu-1", "tpu-2", "tpu-3",
                                                "tpu-0"]
    p0, p1, d0, d1 = (procs[n] for n in ("prefill_0_p0", "prefill_0_p1", "decode_0_p0",
                                          "decode_0_p1"))
    for proc, i, inst in ((p0, 0, "prefill_0"), (p1, 1, "prefill_0"), (d0, 0, "decode_0"),
                          (d1, 1, "decode_0")):
        assert proc.instance_id == inst
        assert proc.rank == {"tp_rank": i, "tp_size": 8, "cp_rank": 0, "cp_size": 1,
                             "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1}
        assert proc.leader is (i == 0)
        assert proc.chips == [0, 1, 2, 3] and proc.mesh == {"tp": 8}
        assert proc.distributed["num_processes"] == 2
        assert proc.distributed["process_id"] == i
        assert proc.distributed["local_device_ids"] == [0, 1, 2, 3]
        env = proc.env
        assert env["CLOUD_TPU_TASK_ID"] == str(i)
        assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
        assert env["TPU_PROCESS_BOUNDS"] == "1,2,1"
        assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
        assert env["TPU_PROCESS_PORT"] == str(proc.ports["tpu_process"])
        assert proc.health_url == f"http://{proc.address}:{proc.ports['http']}/health"
    assert p0.distributed["coordinator"] == p1.distributed["coordinator"] == "10.130.0.2:33000"
    assert d0.distributed["coordinator"] == d1.distributed["coordinator"] == "10.130.0.4:33002"
    assert p0.env["TPU_PROCESS_ADDRESSES"] == p1.env["TPU_PROCESS_ADDRESSES"] == \
        "10.130.0.2:8476,10.130.0.3:8477"
    assert d0.env["TPU_PROCESS_ADDRESSES"] == "10.130.0.4:8478,10.130.0.5:8479"
    # leaders own coordinator + control; followers only their transfer / side-channel ports
    assert p0.ports == {"http": 30000, "transfer": 31000, "zmq": 32000, "coordinator": 33000,
                        "control": 34000, "tpu_process": 8476}
    assert p1.ports == {"http": 30001, "transfer": 31001, "zmq": 32001, "tpu_process": 8477}
    assert d0.ports == {"http": 30002, "transfer": 31002, "zmq": 32002, "coordinator": 33002,
                        "control": 34002, "tpu_process": 8478}
    # the router only knows the leaders; bootstrap_port = the P leader's side channel
    cmd = " ".join(procs["proxy"].command)
    assert "--prefill http://10.130.0.2:30000 32000 --decode http://10.130.0.4:30002 " in cmd
    assert "10.130.0.3" not in cmd and "10.130.0.5" not in cmd
    assert plan.bootstrap_url == "http://10.130.0.2:8998"
    assert plan.proxy_url == "http://10.130.0.2:8000"
    assert plan.hosts() == ["tpu-0", "tpu-1", "tpu-2", "tpu-3"]
    assert [p.name for p in plan.for_host("tpu-0").processes] == ["bootstrap", "prefill_0_p0",
                                                                  "proxy"]
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()


def test_cpu_mp_plan():
    plan = plan_for("topology=1p1d_cpu_mp", cpus=2)
    srv = [p for p in plan.processes if p.role in ("prefill", "decode")]
    assert [s.name for s in srv] == ["prefill_0_p0", "prefill_0_p1", "decode_0_p0",
                                     "decode_0_p1"]
    assert [s.chips for s in srv] == [[0], [1], [2], [3]]
    assert [s.leader for s in srv] == [True, False, True, False]
    assert {s.env["XLA_FLAGS"] for s in srv} == {"--xla_force_host_platform_device_count=1"}
    assert not any(k.startswith("TPU_") for s in srv for k in s.env)
    assert [s.distributed["coordinator"] for s in srv] == ["127.0.0.1:33000"] * 2 + \
        ["127.0.0.1:33002"] * 2
    assert [s.cpu_affinity for s in srv] == [[0], [1], [0], [1]]
    # two emulated devices per process
    plan = plan_for("topology=1p1d_cpu_mp", "topology.accelerator=cpu-8",
                    "topology.prefill.chips_per_process=2", "topology.prefill.mesh.tp=4",
                    "topology.decode.chips_per_process=2", "topology.decode.mesh.tp=4")
    srv = [p for p in plan.processes if p.role in ("prefill", "decode")]
    assert [s.chips for s in srv] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {s.env["XLA_FLAGS"] for s in srv} == {"--xla_force_host_platform_device_count=2"}
    assert srv[1].distributed["local_device_ids"] == [0, 1] and srv[1].rank["tp_size"] == 4


def test_two_host_cpu_plan_places_roles_and_shares_cores_per_host():
    plan = plan_for("topology=1p1d_cpu_2host", cpus=2)
    by = plan.by_name()
    assert (by["prefill_0"].host, by["decode_0"].host) == ("host-a", "host-b")
    assert by["decode_0"].health_url == "http://10.200.0.2:30001/health"
    # one server per host: each gets all of its host's cores
    assert by["prefill_0"].cpu_affinity == by["decode_0"].cpu_affinity == [0, 1]
    assert by["prefill_0"].distributed is None and by["prefill_0"].chips == [0]


def test_single_process_plans_unchanged_by_multihost_fields():
    plan = plan_for("topology=1p1d_v6e8")
    p = plan.by_name()["prefill_0"]
    assert p.distributed is None and p.leader and p.instance_id == "prefill_0"
    assert "coordinator" not in p.ports and "ALLOW_MULTIPLE_LIBTPU_LOAD" not in p.env


ERRORS = {
    "chip_not_on_host": (["topology=1p1d_v6e16", "topology.prefill.chips_per_process=2",
                          "topology.prefill.mesh.tp=4", "+topology.prefill.chips=[[0,1],[4,5]]"],
                         "topology.prefill.chips", "out of range 0..3 for host tpu-1"),
    "host_chips_fewer": (["topology=1p1d_cpu_2host", "topology.accelerator=cpu-2",
                          "topology.hosts.1.chips=1", "topology.decode.chips_per_instance=2",
                          "topology.decode.mesh.tp=2"],
                         "topology.decode.chips_per_instance", "host host-b (1 chips)"),
    "duplicate_host": (["topology=1p1d_cpu_2host", "topology.hosts.1.name=host-a"],
                       "topology.hosts.1.name", "duplicate host name"),
    "bad_address": (["topology=1p1d_cpu_2host", "topology.hosts.1.address=10.200.0.300"],
                    "topology.hosts.1.address", "not a valid IPv4 address"),
    "bad_hostname": (["topology=1p1d_cpu_2host", "topology.hosts.0.address='a b'"],
                     "topology.hosts.0.address", "not an IP address or DNS host name"),
    "slice_host_count": (["topology=1p1d_v6e16", "topology.hosts=[{name: x, address: 10.0.0.1}]",
                          "topology.prefill.hosts=[x,x]", "topology.decode.hosts=[x,x]",
                          "topology.bootstrap.host=x", "topology.proxy.host=x"],
                         "topology.hosts", "slice of 4 hosts"),
    "loopback_bind_multihost": (["topology=1p1d_cpu_2host", "server.bind_host=127.0.0.1"],
                                "server.bind_host", "set server.bind_host=null"),
    "hosts_count": (["topology=1p1d_v6e16", "topology.prefill.hosts=[tpu-0]"],
                    "topology.prefill.hosts", "1 hosts for 2 processes"),
    "unknown_process_host": (["topology=1p1d_v6e16", "topology.decode.hosts=[tpu-2,tpu-9]"],
                             "topology.decode.hosts.1", "unknown host"),
    "mesh_not_covering": (["topology=1p1d_cpu_mp", "topology.prefill.mesh.tp=1",
                           "topology.decode.mesh.tp=1"],
                          "topology.prefill.mesh.tp", "2 processes x 1 chips"),
    "non_tp_mesh": (["topology=1p1d_cpu_mp", "topology.prefill.mesh.tp=1", "+topology.prefill.mesh.dp=2",
                     "topology.decode.mesh.tp=1", "+topology.decode.mesh.dp=2"],
                    "topology.prefill.mesh", "tp-only mesh"),
    "no_process_grid": (["topology=1p1d_v6e16", "topology.prefill.processes_per_instance=3",
                         "topology.prefill.hosts=[tpu-0,tpu-1,tpu-2]",
                         "topology.prefill.mesh.tp=12"],
                        "topology.prefill.processes_per_instance", "TPU_PROCESS_BOUNDS"),
    "host_tier_multiprocess": (["topology=1p1d_cpu_mp", "engine.host_kv_pages=64"],
                               "engine.host_kv_pages", "topology.prefill.processes_per_instance=2"),
    "chips_overlap_same_host": (["topology=1p1d_v6e16", "topology.decode.hosts=[tpu-0,tpu-1]",
                                 "+topology.decode.chips=[[0,1,2,3],[0,1,2,3]]"],
                                "topology.decode.chips", "chip 0 is used by both"),
}


@pytest.mark.parametrize("overrides", [
    ["topology.decode.processes_per_instance=1", "topology.decode.chips_per_process=2"],
    ["topology.decode.processes_per_instance=1", "topology.decode.mesh.tp=1"],
    ["topology.accelerator=cpu-8", "topology.decode.chips_per_process=2",
     "topology.decode.mesh.tp=4"]])
def test_p_and_d_split_differently_are_planned(overrides):
    """P and D laid out differently (process count, chips per process, tp) are resharded on
    the way (docs/topology.md#heterogeneous-p-and-d): the planner gives each role its own."""
    plan = plan_for("topology=1p1d_cpu_mp", *overrides)
    d = [p for p in plan.processes if p.role == "decode"]
    p = [p for p in plan.processes if p.role == "prefill"]
    assert len(p) == 2 and all(x.mesh == {"tp": 2} for x in p)
    assert d and all(x.mesh["tp"] == d[0].mesh["tp"] for x in d)


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_multihost_validation_errors(case):
    overrides, key, text = ERRORS[case]
    with pytest.raises(TopologyError) as info:
        plan_for(*overrides)
    assert info.value.key == key, str(info.value)
    assert text in str(info.value)
