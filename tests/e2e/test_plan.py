"""Golden plans: chips, TPU env, ports, affinity, commands for the shipped topologies."""

from __future__ import annotations

import json

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.launcher.plan.expand import Plan, expand_plan
from pdtopo.launcher.plan.tpu_env import share_cores
from pdtopo.launcher.plan.validate import TopologyError


def plan_for(*overrides: str, cpus=None) -> Plan:
    return expand_plan(compose_config(["model=tiny_llama", *overrides]), run_dir="/runs/r1",
                       python="/venv/bin/python", cpus=cpus)


def servers(plan: Plan):
    return [p for p in plan.processes if p.role in ("prefill", "decode", "colocated")]


def test_1p1d_v6e8_golden():
    plan = plan_for("topology=1p1d_v6e8")
    assert [p.name for p in plan.processes] == ["bootstrap", "prefill_0", "decode_0", "proxy"]
    p, d = plan.by_name()["prefill_0"], plan.by_name()["decode_0"]
    assert p.chips == [0, 1, 2, 3] and d.chips == [4, 5, 6, 7]
    assert p.env["TPU_VISIBLE_CHIPS"] == "0,1,2,3" and d.env["TPU_VISIBLE_CHIPS"] == "4,5,6,7"
    for proc in (p, d):
        assert proc.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,4,1"
        assert proc.env["TPU_PROCESS_BOUNDS"] == "1,1,1"
        assert proc.env["CLOUD_TPU_TASK_ID"] == "0"
        port = proc.env["TPU_PROCESS_PORT"]
        assert proc.env["TPU_PROCESS_ADDRESSES"] == f"localhost:{port}"
        assert proc.rank["tp_size"] == 4 and proc.mesh == {"tp": 4}
        assert "JAX_PLATFORMS" not in proc.env and proc.cpu_affinity is None
    assert (p.env["TPU_PROCESS_PORT"], d.env["TPU_PROCESS_PORT"]) == ("8476", "8477")
    assert p.ports == {"http": 30000, "transfer": 31000, "zmq": 32000, "tpu_process": 8476}
    assert d.ports == {"http": 30001, "transfer": 31001, "zmq": 32001, "tpu_process": 8477}
    assert p.command == ["/venv/bin/python", "-m", "pdtopo.runtime.server", "--run-dir",
                         "/runs/r1", "--process", "prefill_0"]
    assert p.health_url == "http://127.0.0.1:30000/health"
    assert plan.bootstrap_url == "http://127.0.0.1:8998"
    assert plan.proxy_url == "http://127.0.0.1:8000"
    assert [x.priority for x in plan.processes] == [100, 200, 200, 300]


def test_2p2d_golden():
    plan = plan_for("topology=2p2d")
    srv = servers(plan)
    assert [s.name for s in srv] == ["prefill_0", "prefill_1", "decode_0", "decode_1"]
    assert [s.env["TPU_VISIBLE_CHIPS"] for s in srv] == ["0,1", "2,3", "4,5", "6,7"]
    assert {s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in srv} == {"1,2,1"}
    assert [s.env["TPU_PROCESS_PORT"] for s in srv] == ["8476", "8477", "8478", "8479"]
    assert [s.ports["http"] for s in srv] == [30000, 30001, 30002, 30003]
    assert [s.ports["zmq"] for s in srv] == [32000, 32001, 32002, 32003]


def test_1p1d_v4_and_v5e8_golden():
    plan = plan_for("topology=1p1d_v4")
    assert [s.env["TPU_VISIBLE_CHIPS"] for s in servers(plan)] == ["0,1", "2,3"]
    assert {s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in servers(plan)} == {"1,2,1"}
    plan = plan_for("topology=1p1d_v5e8")
    assert [s.env["TPU_VISIBLE_CHIPS"] for s in servers(plan)] == ["0,1,2,3", "4,5,6,7"]
    assert {s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in servers(plan)} == {"1,4,1"}


def test_v4_whole_host_bounds():
    plan = plan_for("topology=1p1d_v4", "topology.mode=colocated",
                    "+topology.colocated={chips_per_instance: 4, mesh: {tp: 4}}")
    (only,) = plan.processes
    assert only.name == "colocated_0" and only.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"


def test_cpu_plan_env_and_affinity():
    plan = plan_for("topology=2p2d_cpu", cpus=8)
    srv = servers(plan)
    for s in srv:
        assert s.env["JAX_PLATFORMS"] == "cpu"
        assert s.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
        assert not any(k.startswith("TPU_") for k in s.env)
        assert "tpu_process" not in s.ports
    assert [s.cpu_affinity for s in srv] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.by_name()["bootstrap"].cpu_affinity is None
    # fewer cores than processes: shared round robin; no core count: no affinity
    assert [s.cpu_affinity for s in servers(plan_for("topology=2p2d_cpu", cpus=2))] == \
        [[0], [1], [0], [1]]
    assert [s.cpu_affinity for s in servers(plan_for("topology=2p2d_cpu"))] == [None] * 4


def test_cpu_emulated_chip_count_follows_instance_size():
    plan = plan_for("topology.accelerator=cpu-4", "topology.prefill.chips_per_instance=2",
                    "topology.prefill.mesh.tp=2", "topology.decode.chips_per_instance=2",
                    "topology.decode.mesh.tp=2", cpus=[4, 5, 6])
    p, d = servers(plan)
    assert p.chips == [0, 1] and d.chips == [2, 3]
    assert p.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert (p.cpu_affinity, d.cpu_affinity) == ([4, 5], [6])


@pytest.mark.parametrize("cores,procs", [(2, 2), (3, 2), (8, 3), (2, 5), (16, 256)])
def test_share_cores_is_fair(cores, procs):
    shares = share_cores(procs, cores)
    load = [sum(c in s for s in shares) for c in range(cores)]
    assert max(load) - min(load) <= 1 and all(s for s in shares)
    if procs <= cores:
        flat = [c for s in shares for c in s]
        assert sorted(flat) == list(range(cores))  # disjoint and covering


def test_port_overrides_replace_base_plus_k():
    plan = plan_for("topology=2p2d_cpu", "+topology.prefill.port_overrides={1: {http: 39000}}")
    srv = servers(plan)
    assert [s.ports["http"] for s in srv] == [30000, 39000, 30002, 30003]
    assert srv[1].ports["zmq"] == 32001


def test_proxy_command_rust_and_mini_lb():
    plan = plan_for("topology=2p2d_cpu", "proxy.api_key=sekret")
    cmd = plan.by_name()["proxy"].command
    # with a key: the same router through pdtopo's entry, the key in the environment only; the
    # accept wrapper in front (proxy.client_nodelay: auto)
    assert cmd[:8] == ["/venv/bin/python", "-m", "pdtopo.launcher.programs.nodelay_exec", "--",
                       "/venv/bin/python", "-m", "pdtopo.launcher.programs.router_entry",
                       "--pd-disaggregation"]
    assert "sekret" not in cmd and "sekret" not in plan.to_json()
    assert plan.by_name()["proxy"].secret_env == {"PDTOPO_PROXY_API_KEY": "sekret"}
    joined = " ".join(cmd)
    assert "--prefill http://127.0.0.1:30000 32000 --prefill http://127.0.0.1:30001 32001" \
        in joined
    assert "--decode http://127.0.0.1:30002 --decode http://127.0.0.1:30003" in joined
    for flag in ("--host 127.0.0.1", "--port 8000", "--prometheus-host 127.0.0.1",
                 "--prometheus-port 29100", "--prefill-policy round_robin",
                 "--decode-policy round_robin", "--request-timeout-secs 600",
                 "--health-check-interval-secs 2", "--health-failure-threshold 2",
                 "--health-check-timeout-secs 2"):
        assert flag in joined
    mini = plan_for("proxy=mini_lb").by_name()["proxy"]
    assert "--mini-lb" in mini.command and "--prefill-policy" not in mini.command
    assert mini.ports == {"http": 8000}
    assert plan.by_name()["proxy"].health_url == "http://127.0.0.1:8000/health"


def test_proxy_command_gateway():
    plan = plan_for("topology=2p2d_cpu", "proxy=gateway")
    proxy = plan.by_name()["proxy"]
    assert proxy.command[:4] == ["/venv/bin/python", "-m", "smg.launch_router",
                                 "--pd-disaggregation"]
    joined = " ".join(proxy.command)
    for flag in ("--prefill http://127.0.0.1:30000 32000 --prefill http://127.0.0.1:30001 32001",
                 "--decode http://127.0.0.1:30002 --decode http://127.0.0.1:30003",
                 "--prefill-policy cache_aware", "--decode-policy round_robin",
                 "--prometheus-port 29100", "--health-check-interval-secs 2",
                 "--shutdown-grace-period-secs 10", "--log-level warn",
                 "--load-monitor-interval 1"):
        assert flag in joined
    assert proxy.ports == {"http": 8000, "prometheus": 29100}
    keyed = plan_for("topology=2p2d_cpu", "proxy=gateway", "proxy.api_key=sekret",
                     "proxy.policy=prefix_hash").by_name()["proxy"]
    assert keyed.command[2:6] == ["pdtopo.launcher.programs.router_entry", "--router-module",
                                  "smg.launch_router", "--pd-disaggregation"]
    assert "sekret" not in keyed.command and "--prefill-policy prefix_hash" in \
        " ".join(keyed.command)
    # the rust router's commands do not name a module: the entry's default is sglang-router
    rust = plan_for("topology=2p2d_cpu", "proxy.api_key=sekret").by_name()["proxy"]
    assert "--router-module" not in rust.command and "--log-level" not in rust.command


def test_colocated_and_local_modes():
    plan = plan_for("topology=colocated_cpu")
    assert [p.name for p in plan.processes] == ["colocated_0"]
    assert plan.proxy_url is None and plan.bootstrap_url is None
    plan = plan_for("topology=local_v6e8")
    (local,) = plan.processes
    assert local.name == "local_0" and local.chips == list(range(8))
    assert local.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,4,1"


def test_plan_json_shape_roundtrip():
    plan = plan_for(cpus=2)
    data = json.loads(plan.to_json())
    assert set(data) == {"topology", "mode", "platform", "accelerator", "bootstrap_url",
                         "proxy_url", "processes"}
    assert set(data["processes"][1]) == {
        "name", "role", "host", "address", "instance_id", "rank", "chips", "mesh", "ports",
        "env", "command", "health_url", "priority", "cpu_affinity", "distributed", "leader"}
    assert data["processes"][1]["distributed"] is None and data["processes"][1]["leader"]
    assert data["processes"][1]["rank"] == {"tp_rank": 0, "tp_size": 1, "cp_rank": 0,
                                            "cp_size": 1, "dp_rank": 0, "dp_size": 1,
                                            "pp_rank": 0, "pp_size": 1}
    assert Plan.from_dict(data).to_dict() == data


def test_expand_is_pure_and_deterministic():
    cfg = compose_config(["model=tiny_llama", "topology=2p2d"])
    before = cfg.copy()
    a = expand_plan(cfg, run_dir="R", python="p", cpus=4).to_json()
    b = expand_plan(cfg, run_dir="R", python="p", cpus=4).to_json()
    assert a == b and cfg == before


def test_proxy_retries_and_circuit_breaker_flags():
    cmd = plan_for("proxy.retries=0").by_name()["proxy"].command
    assert "--disable-retries" in cmd and "--disable-circuit-breaker" in cmd
    cmd = plan_for("proxy.circuit_breaker=true").by_name()["proxy"].command
    assert "--disable-circuit-breaker" not in cmd
    cmd = plan_for("proxy.retries=2").by_name()["proxy"].command
    assert cmd[cmd.index("--retry-max-retries") + 1] == "2"
    default = plan_for().by_name()["proxy"].command
    assert "--disable-retries" not in default and "--retry-max-retries" not in default
    assert "--disable-circuit-breaker" in default  # off by default (conf/proxy/rust.yaml)
    with pytest.raises(TopologyError, match="proxy.retries"):
        plan_for("proxy.retries=-1")


@pytest.mark.parametrize("topology,meshes", [
    ("1p1d_cpu_hetero", {"prefill_0": (2, [0, 1]), "decode_0": (1, [2])}),
    ("1p2d_cpu_hetero", {"prefill_0": (2, [0, 1]), "decode_0": (1, [2]), "decode_1": (1, [3])}),
    ("1p2d_v6e8_hetero", {"prefill_0": (4, [0, 1, 2, 3]), "decode_0": (2, [4, 5]),
                          "decode_1": (2, [6, 7])}),
])
def test_heterogeneous_topologies_plan_each_role_its_own_mesh(topology, meshes):
    plan = plan_for(f"topology={topology}")
    got = {p.name: (p.mesh["tp"], p.chips) for p in plan.processes
           if p.role in ("prefill", "decode")}
    assert got == meshes
