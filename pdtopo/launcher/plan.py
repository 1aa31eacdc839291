"""Plan: the concrete processes of a deployment, expanded purely from the composed config.

`expand_plan(cfg, run_dir=..., python=..., cpus=...)` -> `Plan` (dataclasses, JSON-shaped as in
docs/architecture.md plus `cpu_affinity`). No I/O, no clock, no environment reads: the run dir,
interpreter path and CPU cores come in as arguments. Validation (`validate.py`) runs during
expansion, so an invalid topology never yields a plan. Server processes are numbered k = 0..
over all roles in order (prefill, then decode); each port kind gets `base + k` unless an
instance override says otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.schema import (
    PORT_KINDS,
    ProxySchema,
    RoleSchema,
    TopologySchema,
    typed_proxy,
    typed_topology,
)
from pdtopo.launcher import validate
from pdtopo.launcher.tpu_env import Accelerator, accelerator_spec, chip_env, share_cores

PRIORITY = {"bootstrap": 100, "prefill": 200, "decode": 200, "colocated": 200, "local": 200,
            "proxy": 300}
SERVER_MODULE = "pdtopo.runtime.server"
BOOTSTRAP_MODULE = "pdtopo.runtime.bootstrap"
ROUTER_MODULE = "sglang_router.launch_router"


def default_rank(tp_size: int = 1) -> dict[str, int]:
    return {"tp_rank": 0, "tp_size": tp_size, "cp_rank": 0, "cp_size": 1,
            "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1}


@dataclass
class Process:
    name: str
    role: str
    host: str
    address: str
    instance_id: str
    rank: dict[str, int]
    chips: list[int]
    mesh: dict[str, int]
    ports: dict[str, int]
    env: dict[str, str]
    command: list[str]
    health_url: str
    priority: int
    cpu_affinity: list[int] | None = None
    # port kind -> config key it came from (for error messages; not part of plan.json)
    port_keys: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "host": self.host, "address": self.address,
            "instance_id": self.instance_id, "rank": dict(self.rank), "chips": list(self.chips),
            "mesh": dict(self.mesh), "ports": dict(self.ports), "env": dict(self.env),
            "command": list(self.command), "health_url": self.health_url,
            "priority": self.priority,
            "cpu_affinity": None if self.cpu_affinity is None else list(self.cpu_affinity),
        }

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.ports['http']}"


@dataclass
class Plan:
    topology: str
    mode: str
    platform: str
    accelerator: str
    bootstrap_url: str | None
    proxy_url: str | None
    processes: list[Process]

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology, "mode": self.mode, "platform": self.platform,
            "accelerator": self.accelerator, "bootstrap_url": self.bootstrap_url,
            "proxy_url": self.proxy_url,
            "processes": [p.to_dict() for p in self.processes],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def by_name(self) -> dict[str, Process]:
        return {p.name: p for p in self.processes}

    def start_order(self) -> list[Process]:
        return sorted(self.processes, key=lambda p: (p.priority, self.processes.index(p)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        procs = [Process(**{k: v for k, v in p.items() if k != "port_keys"})
                 for p in data["processes"]]
        return cls(data["topology"], data["mode"], data["platform"], data["accelerator"],
                   data.get("bootstrap_url"), data.get("proxy_url"), procs)


@dataclass
class _Server:
    """A server process being planned (before ports/env are attached)."""

    name: str
    role: str
    index: int
    spec: RoleSchema
    chips: list[int]
    chips_key: str


def _server_roles(topo: TopologySchema) -> list[tuple[str, RoleSchema]]:
    if topo.mode == "pd":
        return [("prefill", topo.prefill), ("decode", topo.decode)]
    if topo.mode == "colocated":
        return [("colocated", topo.colocated)]
    return [("prefill", topo.prefill), ("decode", topo.decode)]  # local: chips of both meshes


def _assign_chips(topo: TopologySchema, acc: Accelerator) -> list[_Server]:
    servers: list[_Server] = []
    next_free = 0
    for role, spec in _server_roles(topo):
        validate.check_role(role, spec)
        for i in range(spec.instances):
            if spec.chips is not None:
                chips, key = [int(c) for c in spec.chips[i]], f"topology.{role}.chips"
            else:
                n = spec.chips_per_instance
                chips, key = list(range(next_free, next_free + n)), \
                    f"topology.{role}.chips_per_instance"
                next_free += n
            validate.check_chip_set(acc, key, chips)
            validate.check_mesh(role, spec, chips)
            servers.append(_Server(f"{role}_{i}", role, i, spec, chips, key))
    validate.check_no_overlap((s.name, s.chips_key, s.chips) for s in servers)
    return servers


def _common_env(cfg: DictConfig) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    cache = OmegaConf.select(cfg, "launcher.compilation_cache_dir", default=None)
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    return env


def _runtime_cmd(python: str, module: str, run_dir: str, name: str) -> list[str]:
    return [python, "-m", module, "--run-dir", run_dir, "--process", name]


def local_process_layout(topo: TopologySchema) -> tuple[list[int], RoleSchema]:
    """Chips and role spec (mesh: engine -> devices) of the one program of mode local."""
    from pdtopo.runtime.local.slices import local_layout

    layout = local_layout(topo.prefill_slices, topo.decode_slices)
    return list(range(layout.num_chips)), replace(topo.prefill, mesh=layout.mesh_summary())


def _server_processes(cfg: DictConfig, topo: TopologySchema, acc: Accelerator,
                      servers: list[_Server], run_dir: str, python: str,
                      cpus: int | Sequence[int] | None) -> list[Process]:
    if topo.mode == "local":  # one in-process disagg program over the P and D chips
        chips, local_spec = local_process_layout(topo)  # topology.prefill/decode_slices
        validate.check_chip_set(acc, "topology.decode_slices", chips)
        servers = [_Server("local_0", "local", 0, local_spec, chips, "topology.decode_slices")]
    affinity = share_cores(len(servers), cpus if acc.platform == "cpu" else None)
    server_module = str(OmegaConf.select(cfg, "launcher.server_module", default=SERVER_MODULE))
    out = []
    for k, s in enumerate(servers):
        host, address = validate.host_address(topo, f"topology.{s.role}.host", s.spec.host)
        overrides = s.spec.port_overrides.get(s.index, {})
        ports, keys = {}, {}
        for kind in PORT_KINDS:
            if kind in overrides:
                ports[kind] = int(overrides[kind])
                keys[kind] = f"topology.{s.role}.port_overrides.{s.index}.{kind}"
            else:
                ports[kind] = getattr(topo.ports, f"{kind}_base") + k
                keys[kind] = f"topology.ports.{kind}_base"
        tpu_port = topo.ports.tpu_process_base + k
        if acc.platform == "tpu":
            ports["tpu_process"], keys["tpu_process"] = tpu_port, "topology.ports.tpu_process_base"
        env = {**_common_env(cfg), **chip_env(acc, s.chips, tpu_port)}
        tp = int(s.spec.mesh.get("tp", 1))
        out.append(Process(
            name=s.name, role=s.role, host=host, address=address, instance_id=s.name,
            rank=default_rank(tp), chips=list(s.chips), mesh=dict(s.spec.mesh), ports=ports,
            env=env, command=_runtime_cmd(python, server_module, run_dir, s.name),
            health_url=f"http://{address}:{ports['http']}/health", priority=PRIORITY[s.role],
            cpu_affinity=affinity[k], port_keys=keys,
        ))
    return out


def _bootstrap_process(cfg: DictConfig, topo: TopologySchema, run_dir: str,
                       python: str) -> Process:
    host, address = validate.host_address(topo, "topology.bootstrap.host", topo.bootstrap.host)
    port = topo.bootstrap.port
    return Process(
        name="bootstrap", role="bootstrap", host=host, address=address, instance_id="bootstrap",
        rank=default_rank(), chips=[], mesh={}, ports={"http": port}, env=_common_env(cfg),
        command=_runtime_cmd(python, BOOTSTRAP_MODULE, run_dir, "bootstrap"),
        health_url=f"http://{address}:{port}/health", priority=PRIORITY["bootstrap"],
        port_keys={"http": "topology.bootstrap.port"},
    )


def router_command(python: str, proxy: ProxySchema, address: str, ports: dict[str, int],
                   prefills: list[Process], decodes: list[Process]) -> list[str]:
    cmd = [python, "-m", ROUTER_MODULE, "--pd-disaggregation"]
    for p in prefills:
        cmd += ["--prefill", p.url, str(p.ports["zmq"])]
    for d in decodes:
        cmd += ["--decode", d.url]
    cmd += ["--host", address, "--port", str(ports["http"])]
    if proxy.kind == "mini_lb":
        cmd += ["--mini-lb", "--policy", "random"]
    else:
        cmd += ["--prometheus-host", address, "--prometheus-port", str(ports["prometheus"]),
                "--prefill-policy", proxy.policy, "--decode-policy", proxy.decode_policy,
                "--health-check-interval-secs", str(proxy.health_check_interval_s)]
        if proxy.retries is not None:
            cmd += (["--disable-retries"] if proxy.retries == 0
                    else ["--retry-max-retries", str(proxy.retries)])
        if not proxy.circuit_breaker:
            cmd += ["--disable-circuit-breaker"]
    cmd += ["--request-timeout-secs", str(proxy.request_timeout_s)]
    if proxy.api_key:
        cmd += ["--api-key", str(proxy.api_key)]
    return cmd


def _proxy_process(cfg: DictConfig, topo: TopologySchema, proxy: ProxySchema,
                   servers: list[Process], python: str) -> Process:
    host, address = validate.host_address(topo, "topology.proxy.host", topo.proxy.host)
    ports = {"http": topo.proxy.port}
    keys = {"http": "topology.proxy.port"}
    if proxy.kind == "rust":
        if topo.proxy.prometheus_port is None:
            raise validate.TopologyError("topology.proxy.prometheus_port", None,
                                         "the rust router needs a prometheus port")
        ports["prometheus"] = topo.proxy.prometheus_port
        keys["prometheus"] = "topology.proxy.prometheus_port"
    prefills = [p for p in servers if p.role == "prefill"]
    decodes = [p for p in servers if p.role == "decode"]
    return Process(
        name="proxy", role="proxy", host=host, address=address, instance_id="proxy",
        rank=default_rank(), chips=[], mesh={}, ports=ports, env=_common_env(cfg),
        command=router_command(python, proxy, address, ports, prefills, decodes),
        health_url=f"http://{address}:{ports['http']}/health", priority=PRIORITY["proxy"],
        port_keys=keys,
    )


def expand_plan(cfg: DictConfig, *, run_dir: str = "RUN_DIR", python: str = "python",
                cpus: int | Sequence[int] | None = None) -> Plan:
    """Expand a composed config into a validated Plan (pure; raises TopologyError)."""
    topo = typed_topology(cfg)
    proxy = typed_proxy(cfg)
    validate.check_basics(topo, proxy)
    acc = accelerator_spec(topo.accelerator, topo.platform)
    engine = OmegaConf.to_container(cfg.engine, resolve=True) if "engine" in cfg else {}
    if topo.mode == "pd":
        validate.check_engine_compat(topo, engine)
    servers = _server_processes(cfg, topo, acc, _assign_chips(topo, acc), str(run_dir),
                                python, cpus)
    processes: list[Process] = []
    bootstrap_url = proxy_url = None
    if topo.mode == "pd":
        boot = _bootstrap_process(cfg, topo, str(run_dir), python)
        prox = _proxy_process(cfg, topo, proxy, servers, python)
        processes = [boot, *servers, prox]
        bootstrap_url, proxy_url = boot.url, prox.url
    else:
        processes = servers
    validate.check_ports((p.name, kind, p.port_keys.get(kind, f"{p.name}.{kind}"), p.address,
                          port) for p in processes for kind, port in p.ports.items())
    return Plan(topology=topo.name, mode=topo.mode, platform=topo.platform,
                accelerator=topo.accelerator, bootstrap_url=bootstrap_url, proxy_url=proxy_url,
                processes=processes)
