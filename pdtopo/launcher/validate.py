"""Semantic checks of a typed topology, run by the planner before any process entry exists.

Every check raises `TopologyError(key, value, message)` with the full config key. Chip sets
are checked against the accelerator table (`tpu_env`), port sets against each other; ports
already bound on the host are checked at launch (`pdtopo.launcher.ports`), not here, because
that needs I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pdtopo.config.schema import (
    MODES,
    PLATFORMS,
    PORT_KINDS,
    PROXY_KINDS,
    ProxySchema,
    RoleSchema,
    TopologyError,
    TopologySchema,
)
from pdtopo.launcher.tpu_env import Accelerator, split_error


def check_basics(topo: TopologySchema, proxy: ProxySchema) -> None:
    if topo.mode not in MODES:
        raise TopologyError("topology.mode", topo.mode, f"unknown mode (known: {', '.join(MODES)})")
    if topo.platform not in PLATFORMS:
        raise TopologyError("topology.platform", topo.platform,
                            f"unknown platform (known: {', '.join(PLATFORMS)})")
    if proxy.kind not in PROXY_KINDS:
        raise TopologyError("proxy.kind", proxy.kind,
                            f"unknown proxy kind (known: {', '.join(PROXY_KINDS)})")
    if proxy.kind == "mini_lb" and proxy.api_key:
        raise TopologyError("proxy.api_key", "***",
                            "mini_lb does not check API keys; use proxy=rust or drop the key")
    if proxy.retries is not None and proxy.retries < 0:
        raise TopologyError("proxy.retries", proxy.retries,
                            "must be null (router default), 0 (no retries) or a positive count")
    if not topo.hosts:
        raise TopologyError("topology.hosts", [], "at least one host is needed")
    names = [h.name for h in topo.hosts]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise TopologyError(f"topology.hosts.{i}.name", name, "duplicate host name")


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
    if spec.chips is not None and len(spec.chips) != spec.instances:
        raise TopologyError(f"{key}.chips", spec.chips,
                            f"{len(spec.chips)} chip lists for {spec.instances} instances")
    for axis, size in spec.mesh.items():
        if size < 1:
            raise TopologyError(f"{key}.mesh.{axis}", size, "mesh axis sizes must be >= 1")
    for idx, ports in spec.port_overrides.items():
        if not 0 <= idx < spec.instances:
            raise TopologyError(f"{key}.port_overrides", idx,
                                f"instance index must be 0..{spec.instances - 1}")
        for kind in ports:
            if kind not in PORT_KINDS:
                raise TopologyError(f"{key}.port_overrides.{idx}.{kind}", ports[kind],
                                    f"unknown port kind (known: {', '.join(PORT_KINDS)})")


def check_chip_set(acc: Accelerator, key: str, chips: list[int]) -> None:
    why = split_error(acc, chips)
    if why:
        raise TopologyError(key, chips, why)


def check_mesh(role: str, spec: RoleSchema, chips: list[int]) -> None:
    size = math.prod(spec.mesh.values()) if spec.mesh else 1
    if size != len(chips):
        axis = "tp" if "tp" in spec.mesh or not spec.mesh else next(iter(spec.mesh))
        raise TopologyError(f"topology.{role}.mesh.{axis}", spec.mesh.get(axis, 1),
                            f"mesh {dict(spec.mesh)} has {size} devices but the instance has "
                            f"{len(chips)} chips {chips}")


def check_no_overlap(assigned: Iterable[tuple[str, str, list[int]]]) -> None:
    """assigned: (process name, config key, chips) in plan order."""
    owner: dict[int, str] = {}
    for name, key, chips in assigned:
        for c in chips:
            if c in owner:
                raise TopologyError(key, chips, f"chip {c} is used by both {owner[c]} and {name}")
            owner[c] = name


def check_ports(entries: Iterable[tuple[str, str, str, str, int]]) -> None:
    """entries: (process, kind, config key, address, port). Ports must be valid and unique."""
    seen: dict[tuple[str, int], str] = {}
    for name, kind, key, address, port in entries:
        if not 1 <= port <= 65535:
            raise TopologyError(key, port, f"{name} {kind} port out of range 1..65535")
        if (address, port) in seen:
            raise TopologyError(key, port, f"port {port} of {name} ({kind}) is also used by "
                                           f"{seen[(address, port)]}")
        seen[(address, port)] = f"{name} ({kind})"


def check_engine_compat(topo: TopologySchema, engine: dict) -> None:
    """P and D must agree on page size and KV dtype (KV pages move between their pools).
    One engine config serves all roles today; per-role values must match it."""
    for field_name in ("page_size", "kv_dtype"):
        base = engine.get(field_name)
        p = getattr(topo.prefill.engine, field_name)
        d = getattr(topo.decode.engine, field_name)
        p_eff = base if p is None else p
        d_eff = base if d is None else d
        if p_eff != d_eff:
            key = f"topology.decode.engine.{field_name}" if d is not None else \
                f"topology.prefill.engine.{field_name}"
            raise TopologyError(key, d_eff if d is not None else p_eff,
                                f"prefill {field_name}={p_eff!r} but decode {field_name}={d_eff!r};"
                                " P and D must agree")
        for role, val in (("prefill", p), ("decode", d)):
            if val is not None and val != base:
                raise TopologyError(f"topology.{role}.engine.{field_name}", val,
                                    f"differs from engine.{field_name}={base!r}; the runtime has "
                                    "one engine config today")
