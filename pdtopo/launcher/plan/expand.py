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

from omegaconf import DictConfig

from pdtopo.config.credentials import (
    API_KEY_DERIVED_ENV,
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    http_auth_on,
)
from pdtopo.config.local_slices import local_layout
from pdtopo.config.schema import (
    PORT_KINDS,
    ProxySchema,
    RoleSchema,
    TopologySchema,
    typed_proxy,
    typed_topology,
)
from pdtopo.config.settings import (
    LauncherSettings,
    RuntimeSettings,
    ServerSettings,
    group_settings,
    runtime_settings,
)
from pdtopo.launcher.plan import validate
from pdtopo.launcher.plan.tpu_env import (
    Accelerator,
    accelerator_spec,
    chip_env,
    cluster_env,
    share_cores,
)

# wraps the Rust router so the client connections it accepts get TCP_NODELAY

PRIORITY = {"bootstrap": 100, "prefill": 200, "decode": 200, "colocated": 200, "local": 200,
            "proxy": 300}
BOOTSTRAP_MODULE = "pdtopo.runtime.bootstrap"
ROUTER_MODULE = "sglang_router.launch_router"
# proxy.kind=gateway: the sglang model gateway (package smg), the same PD flags
GATEWAY_MODULE = "smg.launch_router"
# runs the same router with the API key from the environment or a file, never from argv
ROUTER_KEY_MODULE = "pdtopo.launcher.programs.router_entry"
# proxy.kind=mini_lb: sglang-router's MiniLB with pdtopo's body limit (it enforces none)
MINI_LB_MODULE = "pdtopo.launcher.programs.mini_lb_entry"
# the wrapper giving the router's accepted connections TCP_NODELAY (proxy.client_nodelay)
NODELAY_MODULE = "pdtopo.launcher.programs.nodelay_exec"


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
    # multi-process instance membership (None: a one-process instance or not a server)
    distributed: dict[str, Any] | None = None
    leader: bool = True
    # port kind -> config key it came from (for error messages; not part of plan.json)
    port_keys: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # environment that holds secrets (the proxy API key): rendered into supervisord.conf
    # (mode 0600) only, never into plan.json or a command line
    secret_env: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "host": self.host, "address": self.address,
            "instance_id": self.instance_id, "rank": dict(self.rank), "chips": list(self.chips),
            "mesh": dict(self.mesh), "ports": dict(self.ports), "env": dict(self.env),
            "command": list(self.command), "health_url": self.health_url,
            "priority": self.priority,
            "cpu_affinity": None if self.cpu_affinity is None else list(self.cpu_affinity),
            "distributed": None if self.distributed is None else dict(self.distributed),
            "leader": self.leader,
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
    # loud notes for the user (e.g. launcher.allow_incompatible_roles); not part of plan.json
    warnings: list[str] = field(default_factory=list, compare=False)

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

    def hosts(self) -> list[str]:
        """Host names that run at least one program, in plan order."""
        return list(dict.fromkeys(p.host for p in self.processes))

    def for_host(self, host: str) -> Plan:
        """The same plan restricted to the programs of one host (what its supervisord runs)."""
        return Plan(self.topology, self.mode, self.platform, self.accelerator,
                    self.bootstrap_url, self.proxy_url,
                    [p for p in self.processes if p.host == host])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        procs = [Process(**{k: v for k, v in p.items() if k not in ("port_keys", "secret_env")})
                 for p in data["processes"]]
        return cls(data["topology"], data["mode"], data["platform"], data["accelerator"],
                   data.get("bootstrap_url"), data.get("proxy_url"), procs)


@dataclass
class _Server:
    """A server process being planned (before ports/env are attached)."""

    name: str
    role: str
    index: int          # instance index within the role
    process_index: int  # 0..processes_per_instance-1 within the instance
    spec: RoleSchema
    host: str
    address: str
    chips: list[int]
    chips_key: str

    @property
    def instance_id(self) -> str:
        return f"{self.role}_{self.index}"

    @property
    def leader(self) -> bool:
        return self.process_index == 0


def _server_roles(topo: TopologySchema) -> list[tuple[str, RoleSchema]]:
    if topo.mode == "pd":
        return [("prefill", topo.prefill), ("decode", topo.decode)]
    if topo.mode in ("colocated", "dp"):
        return [("colocated", topo.colocated)]
    return [("prefill", topo.prefill), ("decode", topo.decode)]  # local: chips of both meshes


def process_name(role: str, index: int, process_index: int, processes: int) -> str:
    """`prefill_0` for a one-process instance, `prefill_0_p0`, `prefill_0_p1`, ... otherwise."""
    base = f"{role}_{index}"
    return base if processes == 1 else f"{base}_p{process_index}"


def _assign_chips(topo: TopologySchema, acc: Accelerator) -> list[_Server]:
    """Place every process of every instance on a host and on chips of that host: explicit
    lists, or the next free block of chips_per_process on the process's host."""
    servers: list[_Server] = []
    next_free: dict[str, int] = {}
    for role, spec in _server_roles(topo):
        validate.check_role(role, spec)
        n = spec.processes_per_instance
        per = validate.chips_per_process(role, spec)
        validate.check_process_grid(acc, role, spec, per)
        for i in range(spec.instances):
            for j in range(n):
                flat = i * n + j
                if spec.hosts is not None:
                    host_key, host_name = f"topology.{role}.hosts.{flat}", spec.hosts[flat]
                else:
                    host_key, host_name = f"topology.{role}.host", spec.host
                host, address = validate.host_address(topo, host_key, host_name)
                if spec.chips is not None:
                    chips = [int(c) for c in spec.chips[flat]]
                    key = f"topology.{role}.chips"
                else:
                    start = next_free.get(host, 0)
                    chips, next_free[host] = list(range(start, start + per)), start + per
                    key = (f"topology.{role}.chips_per_process" if spec.chips_per_process
                           is not None else f"topology.{role}.chips_per_instance")
                cap = validate.host_chips(topo, acc, host)
                validate.check_chip_set(acc, key, chips, cap if cap != acc.num_chips else None,
                                        host if len(topo.hosts) > 1 else None)
                if n > 1 and len(chips) != per:
                    raise validate.TopologyError(key, chips, f"every process of a {role} "
                                                 f"instance needs {per} chips")
                validate.check_mesh(role, spec, chips)
                servers.append(_Server(process_name(role, i, j, n), role, i, j, spec, host,
                                       address, chips, key))
    for host in dict.fromkeys(s.host for s in servers):
        validate.check_no_overlap((s.name, s.chips_key, s.chips) for s in servers
                                  if s.host == host)
    return servers


def _common_env(launcher: LauncherSettings) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if launcher.compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = launcher.compilation_cache_dir
    return env


def _runtime_cmd(python: str, module: str, run_dir: str, name: str) -> list[str]:
    return [python, "-m", module, "--run-dir", run_dir, "--process", name]


def _host_affinity(servers: list[_Server], acc: Accelerator,
                   cpus: int | Sequence[int] | None) -> list[list[int] | None]:
    """CPU shares per server: the cores are shared among the server processes of each host."""
    out: list[list[int] | None] = [None] * len(servers)
    if acc.platform != "cpu":
        return out
    for host in dict.fromkeys(s.host for s in servers):
        idx = [k for k, s in enumerate(servers) if s.host == host]
        for k, share in zip(idx, share_cores(len(idx), cpus), strict=True):
            out[k] = share
    return out


def _server_ports(topo: TopologySchema, s: _Server, k: int) -> tuple[dict[str, int],
                                                                     dict[str, str]]:
    """Port kind -> port of the k-th server process (base + k unless overridden; an
    instance's port_overrides apply to its leader)."""
    overrides = s.spec.port_overrides.get(s.index, {}) if s.leader else {}
    ports, keys = {}, {}
    for kind in PORT_KINDS:
        if kind in overrides:
            ports[kind] = int(overrides[kind])
            keys[kind] = f"topology.{s.role}.port_overrides.{s.index}.{kind}"
        else:
            ports[kind] = getattr(topo.ports, f"{kind}_base") + k
            keys[kind] = f"topology.ports.{kind}_base"
    if s.spec.processes_per_instance > 1 and s.leader:
        for kind in ("coordinator", "control"):
            ports[kind] = getattr(topo.ports, f"{kind}_base") + k
            keys[kind] = f"topology.ports.{kind}_base"
    return ports, keys


def _tpu_override(s: _Server) -> int | None:
    if not s.leader or s.spec.processes_per_instance != 1:
        return None
    return s.spec.port_overrides.get(s.index, {}).get("tpu_process")


def _tpu_port(topo: TopologySchema, s: _Server, k: int) -> int:
    """TPU_PROCESS_PORT of the k-th server process: base + k, or a one-process instance's
    port_overrides.<i>.tpu_process."""
    port = _tpu_override(s)
    return topo.ports.tpu_process_base + k if port is None else int(port)


def _tpu_port_key(s: _Server) -> str:
    if _tpu_override(s) is None:
        return "topology.ports.tpu_process_base"
    return f"topology.{s.role}.port_overrides.{s.index}.tpu_process"


def local_process_layout(topo: TopologySchema) -> tuple[list[int], RoleSchema]:
    """Chips and role spec (mesh: engine -> devices) of the one program of mode local."""
    layout = local_layout(topo.prefill_slices, topo.decode_slices)
    return list(range(layout.num_chips)), replace(topo.prefill, mesh=layout.mesh_summary())


def _server_processes(cfg: DictConfig, topo: TopologySchema, acc: Accelerator,
                      servers: list[_Server], run_dir: str, python: str,
                      cpus: int | Sequence[int] | None,
                      launcher: LauncherSettings) -> list[Process]:
    if topo.mode == "local":  # one in-process disagg program over the P and D chips
        if any(s.spec.processes_per_instance > 1 for s in servers):
            raise validate.TopologyError("topology.prefill.processes_per_instance",
                                         topo.prefill.processes_per_instance,
                                         "mode local runs one process")
        chips, local_spec = local_process_layout(topo)  # topology.prefill/decode_slices
        validate.check_chip_set(acc, "topology.decode_slices", chips)
        first = servers[0]
        servers = [_Server("local_0", "local", 0, 0, local_spec, first.host, first.address,
                           chips, "topology.decode_slices")]
    affinity = _host_affinity(servers, acc, cpus)
    server_module = launcher.server_module
    planned = [_server_ports(topo, s, k) for k, s in enumerate(servers)]
    tpu_ports = [_tpu_port(topo, s, k) for k, s in enumerate(servers)]
    out = []
    for k, s in enumerate(servers):
        ports, keys = planned[k]
        n = s.spec.processes_per_instance
        members = [m for m, t in enumerate(servers) if t.instance_id == s.instance_id]
        distributed = None
        if acc.platform == "tpu":
            ports["tpu_process"], keys["tpu_process"] = tpu_ports[k], _tpu_port_key(s)
        if n == 1:
            chip = chip_env(acc, s.chips, tpu_ports[k])
        else:
            lead = members[0]
            distributed = {
                "coordinator": f"{servers[lead].address}:{planned[lead][0]['coordinator']}",
                "num_processes": n, "process_id": s.process_index,
                "local_device_ids": list(range(len(s.chips))),
            }
            chip = cluster_env(acc, s.chips, s.process_index,
                               [f"{servers[m].address}:{tpu_ports[m]}" for m in members],
                               tpu_ports[k])
        tp = int(s.spec.mesh.get("tp", 1))
        rank = default_rank(tp)
        rank["tp_rank"] = s.process_index
        out.append(Process(
            name=s.name, role=s.role, host=s.host, address=s.address,
            instance_id=s.instance_id if s.role != "local" else s.name, rank=rank,
            chips=list(s.chips), mesh=dict(s.spec.mesh), ports=ports,
            env={**_common_env(launcher), **chip},
            command=_runtime_cmd(python, server_module, run_dir, s.name),
            health_url=f"http://{s.address}:{ports['http']}/health", priority=PRIORITY[s.role],
            cpu_affinity=affinity[k], distributed=distributed, leader=s.leader,
            port_keys=keys,
        ))
    return out


def _bootstrap_process(topo: TopologySchema, run_dir: str, python: str,
                       launcher: LauncherSettings) -> Process:
    host, address = validate.host_address(topo, "topology.bootstrap.host", topo.bootstrap.host)
    port = topo.bootstrap.port
    return Process(
        name="bootstrap", role="bootstrap", host=host, address=address, instance_id="bootstrap",
        rank=default_rank(), chips=[], mesh={}, ports={"http": port}, env=_common_env(launcher),
        command=_runtime_cmd(python, BOOTSTRAP_MODULE, run_dir, "bootstrap"),
        health_url=f"http://{address}:{port}/health", priority=PRIORITY["bootstrap"],
        port_keys={"http": "topology.bootstrap.port"},
    )


def router_command(python: str, proxy: ProxySchema, address: str, ports: dict[str, int],
                   prefills: list[Process], decodes: list[Process], *, max_body_bytes: int,
                   derived_key: bool = False, workers: Sequence[Process] = ()) -> list[str]:
    """`derived_key`: the router's key is the one derived from the deployment token.
    `workers`: regular mode (mode dp), one colocated worker per instance, routed by
    `proxy.policy`; else PD mode over `prefills` and `decodes`. `max_body_bytes`
    (server.max_body_bytes): every proxy kind answers 413 to a bigger body."""
    router = GATEWAY_MODULE if proxy.kind == "gateway" else ROUTER_MODULE
    if proxy.kind == "mini_lb":
        cmd = [python, "-m", MINI_LB_MODULE]
    elif proxy.api_key or proxy.api_key_file or derived_key:
        cmd = [python, "-m", ROUTER_KEY_MODULE]
        if router != ROUTER_MODULE:
            cmd += ["--router-module", router]
    else:
        cmd = [python, "-m", router]
    if workers:
        cmd += ["--worker-urls", *(w.url for w in workers)]
    else:
        cmd += ["--pd-disaggregation"]
    for p in prefills:
        cmd += ["--prefill", p.url, str(p.ports["zmq"])]
    for d in decodes:
        cmd += ["--decode", d.url]
    cmd += ["--host", address, "--port", str(ports["http"])]
    if proxy.kind == "mini_lb":
        cmd += ["--mini-lb", "--policy", "random"]
    else:
        policies = (["--policy", proxy.policy] if workers else
                    ["--prefill-policy", proxy.policy, "--decode-policy", proxy.decode_policy])
        cmd += ["--prometheus-host", address, "--prometheus-port", str(ports["prometheus"]),
                *policies,
                "--health-check-interval-secs", str(proxy.health_check_interval_s),
                "--health-failure-threshold", str(proxy.health_failure_threshold),
                "--health-check-timeout-secs", str(proxy.health_check_timeout_s)]
        if proxy.retries is not None:
            cmd += (["--disable-retries"] if proxy.retries == 0
                    else ["--retry-max-retries", str(proxy.retries)])
        if not proxy.circuit_breaker:
            cmd += ["--disable-circuit-breaker"]
        if proxy.kind == "gateway":
            if proxy.load_monitor_interval_s is not None:
                cmd += ["--load-monitor-interval", str(proxy.load_monitor_interval_s)]
            cmd += ["--shutdown-grace-period-secs", str(proxy.shutdown_grace_s),
                    "--log-level", "warn"]
    cmd += ["--request-timeout-secs", str(proxy.request_timeout_s),
            "--max-payload-size", str(max_body_bytes)]
    cmd += [str(a) for a in proxy.extra_args]
    if proxy.kind == "rust" and proxy.client_nodelay is not False:
        cmd = [python, "-m", NODELAY_MODULE,
               *(["--required"] if proxy.client_nodelay is True else []), "--", *cmd]
    return cmd  # an API key travels in the environment (proxy_key_env), not in argv


def _proxy_process(topo: TopologySchema, proxy: ProxySchema, servers: list[Process],
                   python: str, settings: RuntimeSettings, derived_key: bool) -> Process:
    launcher = settings.launcher
    host, address = validate.host_address(topo, "topology.proxy.host", topo.proxy.host)
    ports = {"http": topo.proxy.port}
    keys = {"http": "topology.proxy.port"}
    if proxy.kind in ("rust", "gateway"):
        if topo.proxy.prometheus_port is None:
            raise validate.TopologyError("topology.proxy.prometheus_port", None,
                                         f"the {proxy.kind} proxy needs a prometheus port")
        ports["prometheus"] = topo.proxy.prometheus_port
        keys["prometheus"] = "topology.proxy.prometheus_port"
    prefills = [p for p in servers if p.role == "prefill" and p.leader]
    decodes = [p for p in servers if p.role == "decode" and p.leader]
    workers = [p for p in servers if p.role == "colocated" and p.leader]
    env = _common_env(launcher)
    env.update(_key_env(proxy))
    if derived_key:
        env[API_KEY_DERIVED_ENV] = "1"
    return Process(
        name="proxy", role="proxy", host=host, address=address, instance_id="proxy",
        rank=default_rank(), chips=[], mesh={}, ports=ports, env=env,
        command=router_command(python, proxy, address, ports, prefills, decodes,
                               max_body_bytes=settings.server.max_body_bytes,
                               derived_key=derived_key, workers=workers),
        health_url=f"http://{address}:{ports['http']}/health", priority=PRIORITY["proxy"],
        port_keys=keys,
        secret_env=_key_secret_env(proxy),
    )


def _key_env(proxy: ProxySchema) -> dict[str, str]:
    return {API_KEY_FILE_ENV: str(proxy.api_key_file)} if proxy.api_key_file else {}  # a path


def _key_secret_env(proxy: ProxySchema) -> dict[str, str]:
    return {API_KEY_ENV: str(proxy.api_key)} if proxy.api_key else {}


def _guard_servers(servers: list[Process], proxy: ProxySchema, server: ServerSettings,
                   mode: str, routable: bool = False) -> tuple[list[Process], bool]:
    """The servers with the proxy key in their environment where `server.http_auth` makes
    them require a credential, and whether the key is the derived one (servers that need a
    key, none configured). `routable`: every server listens beyond loopback whatever its
    plan address (a k8s render: pods listen on their DNS names)."""
    guarded = {p.name for p in servers
               if http_auth_on(server.http_auth, p.role,
                               None if routable else server.bind_host or p.address, mode)}
    if not guarded:
        return servers, False
    validate.check_credential_proxy(proxy, mode, sorted(guarded), server)
    derived = not (proxy.api_key or proxy.api_key_file)
    env = {**_key_env(proxy), **({API_KEY_DERIVED_ENV: "1"} if derived else {})}
    return [replace(p, env={**p.env, **env}, secret_env={**p.secret_env,
                                                         **_key_secret_env(proxy)})
            if p.name in guarded else p for p in servers], derived


def expand_plan(cfg: DictConfig, *, run_dir: str = "RUN_DIR", python: str = "python",
                cpus: int | Sequence[int] | None = None, routable: bool = False) -> Plan:
    """Expand a composed config into a validated Plan (pure; raises TopologyError).
    `routable`: the servers will listen beyond loopback whatever their plan addresses say
    (a k8s render), so `server.http_auth: auto` guards them."""
    topo = typed_topology(cfg)
    proxy = typed_proxy(cfg)
    validate.check_basics(topo, proxy)
    acc = accelerator_spec(topo.accelerator, topo.platform)
    validate.check_hosts(topo, acc)
    settings = runtime_settings(cfg)  # every runtime group typed and checked, as P/D will
    validate.check_bind_host(topo, settings.server.bind_host)
    warnings: list[str] = []
    engines = {role: group_settings(cfg, "engine", role) for role, _ in _server_roles(topo)}
    if topo.mode == "pd":
        warnings = validate.check_engine_compat(
            topo, engines, allow_incompatible=settings.launcher.allow_incompatible_roles)
    validate.check_tpu_attention_budget(topo, cfg.get("model"), engines, acc)
    validate.check_host_tiers(topo, engines)
    warnings += validate.check_planner(cfg.get("planner"), topo, acc, proxy.kind)
    servers = _server_processes(cfg, topo, acc, _assign_chips(topo, acc), str(run_dir),
                                python, cpus, settings.launcher)
    servers, derived_key = _guard_servers(servers, proxy, settings.server, topo.mode, routable)
    processes: list[Process] = []
    bootstrap_url = proxy_url = None
    if topo.mode == "pd":
        boot = _bootstrap_process(topo, str(run_dir), python, settings.launcher)
        prox = _proxy_process(topo, proxy, servers, python, settings, derived_key)
        processes = [boot, *servers, prox]
        bootstrap_url, proxy_url = boot.url, prox.url
    elif topo.mode == "dp":  # data-parallel colocated: the router in regular mode, no bootstrap
        prox = _proxy_process(topo, proxy, servers, python, settings, derived_key)
        processes, proxy_url = [*servers, prox], prox.url
    else:
        processes = servers
    validate.check_ports((p.name, kind, p.port_keys.get(kind, f"{p.name}.{kind}"), p.address,
                          port) for p in processes for kind, port in p.ports.items())
    return Plan(topology=topo.name, mode=topo.mode, platform=topo.platform,
                accelerator=topo.accelerator, bootstrap_url=bootstrap_url, proxy_url=proxy_url,
                processes=processes, warnings=warnings)
