"""Planning of `pdtopo scale`: a running PD plan and new instance counts -> the new config and plan.

Pure: no I/O, no clock (a `port_taken(address, port)` predicate comes in from the caller).

    counts = parse_counts(["prefill=3"])                     # {"prefill": 3}
    new_cfg = scaled_config(cfg, plan, counts)               # the topology that will run
    new_plan = scaled_plan(new_cfg, plan, run_dir=..., python=..., cpus=...)

Running programs keep everything they have: their chips, ports and environment. The new
config says so explicitly (`topology.<role>.chips` and one `port_overrides` entry per instance),
so expanding it gives the plan that runs: status, stop, diff and render agree with it. A role
grows at the end (`prefill_2`, ...) on the first free aligned block of chips and, per port kind,
the next port above the role servers' highest that no program holds (the base + k scheme would
hand `prefill_2` the ports `decode_0` holds); it shrinks from the end. One host, one-process
instances this release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.schema import PORT_KINDS, TopologyError, typed_topology
from pdtopo.launcher.plan import validate
from pdtopo.launcher.plan.expand import Plan, Process, expand_plan
from pdtopo.launcher.plan.tpu_env import accelerator_spec

ROLES = ("prefill", "decode")


def parse_counts(args: Sequence[str]) -> dict[str, int]:
    """`["prefill=3", "decode=1"]` -> counts; TopologyError naming the bad argument."""
    counts: dict[str, int] = {}
    for arg in args:
        role, sep, value = arg.partition("=")
        key = f"topology.{role}.instances"
        if not sep or role not in ROLES:
            raise TopologyError("scale", arg, "give ROLE=N with ROLE prefill or decode, e.g. "
                                "prefill=3")
        if role in counts:
            raise TopologyError(key, arg, f"{role} is given twice")
        if not value.isdigit() or int(value) < 1:
            raise TopologyError(key, value, "must be a whole number >= 1 (a PD deployment "
                                "keeps at least one instance of each role)")
        counts[role] = int(value)
    if not counts:
        raise TopologyError("scale", "", "nothing to scale: give prefill=N and/or decode=M")
    return counts


def role_leaders(plan: Plan, role: str) -> list[Process]:
    """The role's instance leaders, by instance index."""
    procs = [p for p in plan.processes if p.role == role and p.leader]
    return sorted(procs, key=lambda p: int(p.instance_id.rsplit("_", 1)[1]))


def _free_block(num_chips: int, per: int, used: set[int]) -> list[int] | None:
    for start in range(0, num_chips - per + 1, per):  # aligned, as TPU splits must be
        block = list(range(start, start + per))
        if not used.intersection(block):
            return block
    return None


def _next_port(start: int, used: set[int], address: str,
               port_taken: Callable[[str, int], bool]) -> int:
    port = start
    while port in used or port_taken(address, port):
        port += 1
        if port > 65535:
            raise TopologyError("topology.ports", start, "no free port above it")
    return port


def scaled_config(cfg: DictConfig, plan: Plan, counts: dict[str, int], *,
                  port_taken: Callable[[str, int], bool] = lambda address, port: False,
                  ) -> DictConfig:
    """The config of the deployment after scaling (a new object; `cfg` is not changed)."""
    topo = typed_topology(cfg)
    if topo.mode != "pd":
        raise TopologyError("topology.mode", topo.mode, "scale needs a PD deployment")
    if len(plan.hosts()) > 1:
        raise TopologyError("topology.hosts", plan.hosts(), "scale works on one-host "
                            "deployments this release; render the new shape and launch it")
    for role in ROLES:
        n = getattr(topo, role).processes_per_instance
        if n > 1:
            raise TopologyError(f"topology.{role}.processes_per_instance", n,
                                "scale works on one-process instances this release")
    acc = accelerator_spec(topo.accelerator, topo.platform)
    host_chips = validate.host_chips(topo, acc, plan.hosts()[0])
    leaders = {role: role_leaders(plan, role) for role in ROLES}
    kept = {role: procs[:counts.get(role, len(procs))] for role, procs in leaders.items()}
    used_chips = {c for procs in kept.values() for p in procs for c in p.chips}
    used_ports = {port for p in plan.processes for port in p.ports.values()}
    kinds = (*PORT_KINDS, "tpu_process") if acc.platform == "tpu" else PORT_KINDS
    servers = [p for p in plan.processes if p.role in ROLES]
    data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    for role in ROLES:
        spec = getattr(topo, role)
        per = validate.chips_per_process(role, spec)
        target = counts.get(role, len(leaders[role]))
        chips = [list(p.chips) for p in kept[role]]
        overrides = {i: {k: p.ports[k] for k in kinds if k in p.ports}
                     for i, p in enumerate(kept[role])}
        for i in range(len(kept[role]), target):
            block = _free_block(host_chips, per, used_chips)
            if block is None:
                raise TopologyError(
                    f"topology.{role}.instances", target,
                    f"no {per} free chips for {role}_{i}: {topo.accelerator} has {host_chips}, "
                    f"the programs that stay hold {sorted(used_chips)}; use a bigger "
                    "topology.accelerator")
            used_chips.update(block)
            ports = {}
            for kind in kinds:
                highest = max((p.ports[kind] for p in servers if kind in p.ports), default=None)
                start = (getattr(topo.ports, f"{kind}_base") if highest is None else highest + 1)
                ports[kind] = _next_port(start, used_ports, servers[0].address, port_taken)
                used_ports.add(ports[kind])
            chips.append(block)
            overrides[i] = ports
        section = data["topology"][role]
        section["instances"] = target
        section["chips"] = chips
        section["port_overrides"] = overrides
    return OmegaConf.create(data)


def scaled_plan(new_cfg: DictConfig, old: Plan, *, run_dir: str, python: str,
                cpus: Sequence[int]) -> Plan:
    """`expand_plan(new_cfg)` with the running programs' entries kept as they are (their CPU
    shares were fixed when they started); raises if the expansion moved a running program."""
    new = expand_plan(new_cfg, run_dir=run_dir, python=python, cpus=cpus)
    before = old.by_name()
    merged = []
    for proc in new.processes:
        prev = before.get(proc.name)
        if prev is None or proc.role == "proxy":  # new programs; the proxy's worker list
            merged.append(proc)
            continue
        if (prev.ports, prev.chips) != (proc.ports, proc.chips):
            raise RuntimeError(f"scale would move running program {proc.name}: ports "
                               f"{prev.ports} -> {proc.ports}, chips {prev.chips} -> "
                               f"{proc.chips}")
        merged.append(prev)
    return Plan(new.topology, new.mode, new.platform, new.accelerator, new.bootstrap_url,
                new.proxy_url, merged, warnings=new.warnings)


def changed_leaders(old: Plan, new: Plan) -> tuple[list[Process], list[Process]]:
    """(leaders to add, leaders to remove), adds in plan order, removals highest index first."""
    names_old = {p.name for p in old.processes}
    names_new = {p.name for p in new.processes}
    added = [p for role in ROLES for p in role_leaders(new, role) if p.name not in names_old]
    removed = [p for role in ROLES for p in reversed(role_leaders(old, role))
               if p.name not in names_new]
    return added, removed
