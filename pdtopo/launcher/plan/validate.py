"""Semantic checks of a typed topology, run by the planner before any process entry exists.

Every check raises `TopologyError(key, value, message)` with the full config key. Chip sets
are checked against the accelerator table (`tpu_env`), port sets against each other; ports
already bound on the host are checked at launch (`pdtopo.ports`), not here, because
that needs I/O.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterable
from typing import Any

from pdtopo.config import tpu_kernel_budget
from pdtopo.config.schema import (
    MODES,
    OVERRIDE_PORT_KINDS,
    PLATFORMS,
    PROGRAM_STOP_WAIT_S,
    PROXY_KINDS,
    PROXY_POLICIES,
    ProxySchema,
    RoleSchema,
    TopologyError,
    TopologySchema,
)
from pdtopo.config.settings import EngineSettings, ServerSettings, resolved_dtype
from pdtopo.launcher.plan.tpu_env import Accelerator, process_grid, split_error
from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.settings import PlannerSettings

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def address_error(address: str) -> str | None:
    """Why `address` is neither an IP literal nor a DNS host name, or None."""
    try:
        ipaddress.ip_address(address)
        return None
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", address):
        return "not a valid IPv4 address"
    if not _HOSTNAME.match(address):
        return "not an IP address or DNS host name"
    return None


# router flags the plan writes from typed keys: extra_args may not set them a second time
PROXY_OWNED_FLAGS = (
    "--pd-disaggregation", "--prefill", "--decode", "--host", "--port", "--prometheus-host",
    "--prometheus-port", "--prefill-policy", "--decode-policy", "--policy", "--mini-lb",
    "--health-check-interval-secs", "--health-failure-threshold", "--health-check-timeout-secs",
    "--retry-max-retries", "--disable-retries", "--disable-circuit-breaker",
    "--request-timeout-secs", "--shutdown-grace-period-secs", "--log-level", "--api-key",
    "--load-monitor-interval", "--max-payload-size",
)


def check_basics(topo: TopologySchema, proxy: ProxySchema) -> None:
    if topo.mode not in MODES:
        raise TopologyError("topology.mode", topo.mode, f"unknown mode (known: {', '.join(MODES)})")
    if topo.platform not in PLATFORMS:
        raise TopologyError("topology.platform", topo.platform,
                            f"unknown platform (known: {', '.join(PLATFORMS)})")
    if proxy.kind not in PROXY_KINDS:
        raise TopologyError("proxy.kind", proxy.kind,
                            f"unknown proxy kind (known: {', '.join(PROXY_KINDS)})")
    for key_field, offered in PROXY_POLICIES[proxy.kind].items():
        value = getattr(proxy, key_field)
        if value not in offered:
            hint = (" (mini_lb routes at random only; use proxy=rust or proxy=gateway for "
                    "round_robin or cache_aware)" if proxy.kind == "mini_lb" else "")
            raise TopologyError(f"proxy.{key_field}", value,
                                f"not a policy of the {proxy.kind} proxy (it offers: "
                                f"{', '.join(offered)}){hint}")
    if topo.mode == "dp" and proxy.kind == "mini_lb":
        raise TopologyError("proxy.kind", proxy.kind, "mode dp routes colocated instances with "
                            "the router's regular mode, which mini_lb (PD only) does not have; "
                            "use proxy=rust or proxy=gateway")
    if topo.mode == "dp" and proxy.policy == "bucket":
        raise TopologyError("proxy.policy", proxy.policy, "bucket is a prefill-only policy of "
                            "PD mode; mode dp takes random, round_robin, cache_aware, "
                            "power_of_two or manual")
    for key_field, role in (("policy", topo.prefill), ("decode_policy", topo.decode)):
        if topo.mode == "dp" and key_field == "policy":
            role = topo.colocated
        if (topo.mode == "pd" or (topo.mode == "dp" and key_field == "policy")) \
                and getattr(proxy, key_field) == "power_of_two" and role.instances < 2:
            which = ("colocated" if topo.mode == "dp" else "prefill") if key_field == "policy" \
                else "decode"
            raise TopologyError(f"proxy.{key_field}", "power_of_two",
                                f"the router refuses power_of_two with fewer than 2 {which} "
                                f"instances (topology.{which}.instances={role.instances}); use "
                                "round_robin or random")
    for key_field in ("api_key", "api_key_file"):
        if proxy.kind == "mini_lb" and getattr(proxy, key_field):
            raise TopologyError(f"proxy.{key_field}", "***" if key_field == "api_key"
                                else proxy.api_key_file,
                                "mini_lb does not check API keys; use proxy=rust, proxy=gateway "
                                "or drop the key")
    if proxy.api_key and proxy.api_key_file:
        raise TopologyError("proxy.api_key_file", proxy.api_key_file,
                            "give the key once: proxy.api_key or proxy.api_key_file, not both")
    for key in ("health_check_interval_s", "health_failure_threshold", "health_check_timeout_s",
                "request_timeout_s"):
        if getattr(proxy, key) < 1:
            raise TopologyError(f"proxy.{key}", getattr(proxy, key), "must be at least 1")
    if not (isinstance(proxy.client_nodelay, bool) or proxy.client_nodelay == "auto"):
        raise TopologyError("proxy.client_nodelay", proxy.client_nodelay,
                            "must be auto, true or false")
    if proxy.extra_args and proxy.kind == "mini_lb":
        raise TopologyError("proxy.extra_args", list(proxy.extra_args),
                            "mini_lb takes no extra flags; use proxy=rust or proxy=gateway")
    for i, arg in enumerate(proxy.extra_args):
        name = str(arg).split("=", 1)[0]
        if name in PROXY_OWNED_FLAGS:
            raise TopologyError(f"proxy.extra_args.{i}", arg,
                                "pdtopo sets this flag itself; use its proxy.* or "
                                "topology.proxy.* key instead")
    if proxy.load_monitor_interval_s is not None:
        if proxy.kind != "gateway":
            raise TopologyError("proxy.load_monitor_interval_s", proxy.load_monitor_interval_s,
                                f"only the gateway polls worker loads (proxy.kind is "
                                f"{proxy.kind}); set it to null")
        if proxy.load_monitor_interval_s < 1:
            raise TopologyError("proxy.load_monitor_interval_s", proxy.load_monitor_interval_s,
                                "must be at least 1 (seconds)")
    if not 0 <= proxy.shutdown_grace_s < PROGRAM_STOP_WAIT_S:
        raise TopologyError("proxy.shutdown_grace_s", proxy.shutdown_grace_s,
                            f"must be 0 (stop at once) to {PROGRAM_STOP_WAIT_S - 1} seconds (supervisord "
                            f"kills a program {PROGRAM_STOP_WAIT_S} s after asking it to stop)")
    if proxy.retries is not None and proxy.retries < 0:
        raise TopologyError("proxy.retries", proxy.retries,
                            "must be null (router default), 0 (no retries) or a positive count")
    if not topo.hosts:
        raise TopologyError("topology.hosts", [], "at least one host is needed")
    names = [h.name for h in topo.hosts]
    for i, host in enumerate(topo.hosts):
        if not host.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", host.name):
            raise TopologyError(f"topology.hosts.{i}.name", host.name,
                                "host names are letters, digits, '.', '_' and '-'")
        if host.name in names[:i]:
            raise TopologyError(f"topology.hosts.{i}.name", host.name, "duplicate host name")
        why = address_error(str(host.address))
        if why:
            raise TopologyError(f"topology.hosts.{i}.address", host.address, why)
        if host.chips is not None and host.chips < 1:
            raise TopologyError(f"topology.hosts.{i}.chips", host.chips, "must be at least 1")


def check_hosts(topo: TopologySchema, acc: Accelerator) -> None:
    """A multi-host TPU slice names all of its hosts; a host cannot have more chips than the
    accelerator's hosts have."""
    if acc.platform == "tpu" and acc.hosts > 1 and len(topo.hosts) != acc.hosts:
        raise TopologyError("topology.hosts", [h.name for h in topo.hosts],
                            f"{acc.name} is a slice of {acc.hosts} hosts; "
                            f"{len(topo.hosts)} given")
    for i, host in enumerate(topo.hosts):
        if acc.platform == "tpu" and host.chips is not None and host.chips > acc.num_chips:
            raise TopologyError(f"topology.hosts.{i}.chips", host.chips,
                                f"a {acc.name} host has {acc.num_chips} chips")


def check_bind_host(topo: TopologySchema, bind_host: str | None) -> None:
    """Programs listening on loopback cannot be reached from another host."""
    if bind_host is None or not _loopback(str(bind_host)):
        return
    remote = [f"{h.name} {h.address}" for h in topo.hosts if not _loopback(str(h.address))]
    if remote:
        raise TopologyError("server.bind_host", bind_host,
                            f"programs would listen on loopback only, but hosts {remote} are "
                            "reached over the network; set server.bind_host=null (each program "
                            "listens on its plan address)")


def check_credential_proxy(proxy: ProxySchema, mode: str, guarded: list[str],
                           server: ServerSettings) -> None:
    """Servers that require a credential (`server.http_auth`) need a proxy that sends one."""
    if mode == "pd" and proxy.kind == "mini_lb":
        setting = str(server.http_auth).lower()
        why = ("listen beyond loopback, so with server.http_auth=auto their HTTP APIs "
               "require a credential" if setting == "auto" else
               "require a credential (server.http_auth=true)")
        raise TopologyError("proxy.kind", proxy.kind,
                            f"{', '.join(guarded)} {why}, and mini_lb sends none; use "
                            "proxy=rust or proxy=gateway, or server.http_auth=false to leave "
                            "them open")


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def host_chips(topo: TopologySchema, acc: Accelerator, name: str) -> int:
    for h in topo.hosts:
        if h.name == name:
            return acc.num_chips if h.chips is None else int(h.chips)
    raise KeyError(name)


def host_address(topo: TopologySchema, key: str, name: str | None) -> tuple[str, str]:
    """(host name, address) of a placement; None means the first host."""
    if name is None:
        return topo.hosts[0].name, topo.hosts[0].address
    for h in topo.hosts:
        if h.name == name:
            return h.name, h.address
    known = ", ".join(h.name for h in topo.hosts)
    raise TopologyError(key, name, f"unknown host (hosts: {known})")


def check_role(role: str, spec: RoleSchema) -> None:
    key = f"topology.{role}"
    if spec.instances < 1:
        raise TopologyError(f"{key}.instances", spec.instances, "at least one instance is needed")
    if spec.chips is None and spec.chips_per_instance < 1:
        raise TopologyError(f"{key}.chips_per_instance", spec.chips_per_instance,
                            "must be at least 1")
    n = spec.processes_per_instance
    if n < 1:
        raise TopologyError(f"{key}.processes_per_instance", n, "must be at least 1")
    total = spec.instances * n
    what = "instances" if n == 1 else f"processes ({spec.instances} instances x {n})"
    if spec.chips is not None and len(spec.chips) != total:
        raise TopologyError(f"{key}.chips", spec.chips,
                            f"{len(spec.chips)} chip lists for {total} {what}")
    if spec.hosts is not None:
        if len(spec.hosts) != total:
            raise TopologyError(f"{key}.hosts", spec.hosts,
                                f"{len(spec.hosts)} hosts for {total} {what}; give one host "
                                "per process, instance-major")
        if spec.host is not None:
            raise TopologyError(f"{key}.host", spec.host, f"give {key}.host or {key}.hosts, "
                                "not both")
    for axis, size in spec.mesh.items():
        if size < 1:
            raise TopologyError(f"{key}.mesh.{axis}", size, "mesh axis sizes must be >= 1")
    if n > 1 and any(size > 1 for axis, size in spec.mesh.items() if axis != "tp"):
        raise TopologyError(f"{key}.mesh", dict(spec.mesh),
                            "a multi-process instance supports a tp-only mesh")
    chips_per_process(role, spec)
    for idx, ports in spec.port_overrides.items():  # (was unreachable after a return)
        if not 0 <= idx < spec.instances:
            raise TopologyError(f"{key}.port_overrides", idx,
                                f"instance index must be 0..{spec.instances - 1}")
        for kind in ports:
            if kind not in OVERRIDE_PORT_KINDS:
                raise TopologyError(f"{key}.port_overrides.{idx}.{kind}", ports[kind],
                                    f"unknown port kind (known: {', '.join(OVERRIDE_PORT_KINDS)})")


def chips_per_process(role: str, spec: RoleSchema) -> int:
    """Chips of each process of an instance (from chips_per_process or chips_per_instance)."""
    key = f"topology.{role}"
    n = spec.processes_per_instance
    if spec.chips_per_process is not None:
        if spec.chips_per_process < 1:
            raise TopologyError(f"{key}.chips_per_process", spec.chips_per_process,
                                "must be at least 1")
        return int(spec.chips_per_process)
    if spec.chips_per_instance % n:
        raise TopologyError(f"{key}.chips_per_instance", spec.chips_per_instance,
                            f"does not divide into {n} processes (processes_per_instance)")
    return spec.chips_per_instance // n


def check_chip_set(acc: Accelerator, key: str, chips: list[int], host_chips: int | None = None,
                   host: str | None = None) -> None:
    why = split_error(acc, chips, host_chips, host)
    if why:
        raise TopologyError(key, chips, why)


def check_host_tiers(topo: TopologySchema, engines: dict[str, EngineSettings]) -> None:
    """The prefix cache's host tier (`engine.host_kv_pages`) runs in single-process instances
    only: a multi-process instance would have to replay its copies on every process."""
    for role, eng in engines.items():
        spec = getattr(topo, role, None)
        if eng.host_kv_pages and spec is not None and spec.processes_per_instance > 1:
            raise TopologyError("engine.host_kv_pages", eng.host_kv_pages,
                                f"the host KV tier needs single-process instances, but "
                                f"topology.{role}.processes_per_instance="
                                f"{spec.processes_per_instance}; set it to 0")


def check_mesh(role: str, spec: RoleSchema, chips: list[int]) -> None:
    """The instance mesh covers all its processes' chips (N processes x chips each)."""
    size = math.prod(spec.mesh.values()) if spec.mesh else 1
    n = spec.processes_per_instance
    if size != n * len(chips):
        axis = "tp" if "tp" in spec.mesh or not spec.mesh else next(iter(spec.mesh))
        has = (f"{len(chips)} chips {chips}" if n == 1 else
               f"{n} processes x {len(chips)} chips = {n * len(chips)} devices")
        raise TopologyError(f"topology.{role}.mesh.{axis}", spec.mesh.get(axis, 1),
                            f"mesh {dict(spec.mesh)} has {size} devices but the instance has "
                            f"{has}")


def check_process_grid(acc: Accelerator, role: str, spec: RoleSchema, per: int) -> None:
    n = spec.processes_per_instance
    if acc.platform == "tpu" and n > 1 and process_grid(acc, per, n) is None:
        known = sorted(f"{k}x{b}" for b, k in acc.process_grids)
        raise TopologyError(f"topology.{role}.processes_per_instance", n,
                            f"no known TPU_PROCESS_BOUNDS for {n} processes of {per} chips on "
                            f"{acc.name} (known processes x chip bounds: {', '.join(known)})")


def check_no_overlap(assigned: Iterable[tuple[str, str, list[int]]]) -> None:
    """assigned: (process name, config key, chips) in plan order."""
    owner: dict[int, str] = {}
    for name, key, chips in assigned:
        for c in chips:
            if c in owner:
                raise TopologyError(key, chips, f"chip {c} is used by both {owner[c]} and {name}")
            owner[c] = name


def check_ports(entries: Iterable[tuple[str, str, str, str, int]]) -> None:
    """entries: (process, kind, config key, address, port). Ports must be valid and unique
    per address."""
    seen: dict[tuple[str, int], str] = {}
    for name, kind, key, address, port in entries:
        if not 1 <= port <= 65535:
            raise TopologyError(key, port, f"{name} {kind} port out of range 1..65535")
        if (address, port) in seen:
            raise TopologyError(key, port, f"port {port} of {name} ({kind}) is also used by "
                                           f"{seen[(address, port)]}")
        seen[(address, port)] = f"{name} ({kind})"


def check_engine_compat(topo: TopologySchema, engines: dict[str, EngineSettings], *,
                        allow_incompatible: bool = False) -> list[str]:
    """P and D must agree on page size and KV dtype (KV pages move between their pools).
    `engines`: each role's engine settings, `topology.<role>.engine.*` applied
    (`pdtopo.config.settings.runtime_settings(cfg, role)`, as that role's processes see them). With
    `launcher.allow_incompatible_roles=true` (tests, experts) a mismatch is returned as a
    warning instead of raised: the runtime then refuses the transfers at request time."""
    warnings = []
    for field_name in ("page_size", "kv_dtype"):
        d = getattr(topo.decode.engine, field_name)
        p_eff = getattr(engines["prefill"], field_name)
        d_eff = getattr(engines["decode"], field_name)
        if field_name == "kv_dtype":  # "auto" is what it means on this platform
            p_eff, d_eff = (resolved_dtype(v, topo.platform) for v in (p_eff, d_eff))
        if p_eff != d_eff:
            key = f"topology.decode.engine.{field_name}" if d is not None else \
                f"topology.prefill.engine.{field_name}"
            err = TopologyError(key, d_eff if d is not None else p_eff,
                                f"prefill {field_name}={p_eff!r} but decode {field_name}={d_eff!r};"
                                " P and D must agree")
            if not allow_incompatible:
                raise err
            warnings.append(f"{err} (allowed by launcher.allow_incompatible_roles=true: every "
                            "PD request will fail with an incompatible-peer error)")
    return warnings


def check_tpu_attention_budget(topo: TopologySchema, model: Any,
                               engines: dict[str, EngineSettings], acc: Accelerator) -> None:
    """On a TPU, the attention kernel's SMEM (page tables) and VMEM needs fit every role
    (`pdtopo.config.tpu_kernel_budget`); VMEM only where the config states the model's shapes."""
    if acc.platform != "tpu":
        return
    dims = [model.get(k) if model is not None else None
            for k in ("num_kv_heads", "num_heads", "head_dim")]
    for role, engine in engines.items():
        if engine.attention_impl not in ("auto", "pallas"):
            continue
        spec = getattr(topo, role, None)
        tp = int(spec.mesh.get("tp", 1)) if spec is not None else 1
        for key, value, why in tpu_kernel_budget.problems(engine, *dims, tp=tp):
            raise TopologyError(key, value, f"{why} ({role} servers)")


def instance_chips(role: str, spec: RoleSchema) -> int:
    """Chips one instance of `role` holds (its processes' explicit chip lists, or the
    chips_per_* keys)."""
    if spec.chips:
        return sum(len(c) for c in spec.chips[:spec.processes_per_instance])
    return chips_per_process(role, spec) * spec.processes_per_instance


def planner_budget(s: PlannerSettings, topo: TopologySchema, acc: Accelerator) -> Budget:
    """The chips and bounds the planner may hold on this topology's hosts (its budget counts
    instances of the topology's per-role size)."""
    return s.budget([host_chips(topo, acc, h.name) for h in topo.hosts],
                    instance_chips("prefill", topo.prefill), instance_chips("decode", topo.decode))


def check_planner(planner: Any, topo: TopologySchema, acc: Accelerator,
                  proxy_kind: str | None = None) -> list[str]:
    """The `planner` node typed and checked (a config without one, e.g. conf/ at an older
    revision, has no planner); when enabled, the topology must be a one-host PD deployment of
    one-process instances behind a router with a worker registry (what `pdtopo scale`, the
    planner's hands, works on) and its counts must fit the planner's budget and bounds.
    Returns a warning when the planner could change nothing from the start (the budget full
    and neither role above its minimum)."""
    if planner is None:
        return []
    s = PlannerSettings.from_config(planner)
    if not s.enabled:
        return []
    if topo.mode != "pd":
        raise TopologyError("planner.enabled", True, f"the planner re-balances prefill and "
                            f"decode instances; topology.mode={topo.mode!r} has none "
                            "(set planner.enabled=false or use a pd topology)")
    if len(topo.hosts) > 1:
        raise TopologyError("planner.enabled", True, f"the planner acts through `pdtopo scale`,"
                            f" which works on one-host deployments this release; "
                            f"topology.hosts has {len(topo.hosts)}")
    for role in ("prefill", "decode"):
        n = getattr(topo, role).processes_per_instance
        if n > 1:
            raise TopologyError("planner.enabled", True, f"the planner acts through `pdtopo "
                                f"scale`, which works on one-process instances this release; "
                                f"topology.{role}.processes_per_instance={n}")
    if proxy_kind == "mini_lb":
        raise TopologyError("planner.enabled", True, "proxy.kind=mini_lb has a fixed worker "
                            "list, so instances the planner adds or removes would not be "
                            "routed; use proxy=rust or gateway")
    counts = Counts(topo.prefill.instances, topo.decode.instances)
    for role in ("prefill", "decode"):
        bounds = getattr(s, role)
        n = counts.of(role)
        if n < bounds.min or (bounds.max is not None and n > bounds.max):
            key = f"planner.{role}.{'min' if n < bounds.min else 'max'}"
            raise TopologyError(key, bounds.min if n < bounds.min else bounds.max,
                                f"topology.{role}.instances={n} is outside the planner's "
                                f"bounds [{bounds.min}, {bounds.max}]")
    budget = planner_budget(s, topo, acc)
    if budget.chips is not None and budget.chips_of(counts) > budget.chips:
        raise TopologyError("planner.chips", s.chips, f"the topology's {counts} holds "
                            f"{budget.chips_of(counts)} chips, more than the planner's budget "
                            f"of {budget.chips}")
    stuck = all(budget.refusal(counts.add(role, 1)) for role in ("prefill", "decode")) and \
        all(budget.refusal(counts.add(role, -1)) for role in ("prefill", "decode"))
    if stuck:
        return [f"planner: {counts} fills the budget ({budget.refusal(counts.add('prefill', 1))})"
                " and neither role can give an instance up, so the planner can change nothing; "
                "give it room (planner.chips, a bigger topology.accelerator) or lower bounds"]
    return []
