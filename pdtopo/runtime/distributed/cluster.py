"""One multi-process P or D instance = one JAX cluster: read the plan entry, start JAX's
distributed runtime, find the instance's leader.

A process entry of a multi-process instance (plan.json, written by the launcher) carries
`distributed: {"coordinator": "ADDR:PORT", "num_processes": N, "process_id": i,
"local_device_ids": [...]}` and `leader: true` on process 0. The leader entry also has
`ports.coordinator` and `ports.control` (the lockstep channel, `pdtopo.runtime.distributed.control`).
`ClusterSpec.from_context(ctx)` validates that block (every error names the key and value);
`initialize(spec)` calls `jax.distributed.initialize` (gloo collectives on the CPU backend) before
anything else touches JAX, after which `jax.devices()` lists the devices of every process of the
instance and the instance mesh (`pdtopo.runtime.engine.mesh.build_mesh`) spans them all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdtopo.distributed")


class ClusterConfigError(ValueError):
    """The plan's `distributed` block of a process is unusable."""


def _addr(value: Any, key: str) -> str:
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(f"{key} must be 'host:port', got {value!r}")
    return f"{host}:{int(port)}"


@dataclass(frozen=True)
class ClusterSpec:
    """The validated `distributed` block of one process plus where its leader listens."""

    instance_id: str
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None
    leader: bool
    control_addr: str          # leader's lockstep endpoint host:port
    leader_entry: dict[str, Any]

    @classmethod
    def from_context(cls, ctx: Any) -> ClusterSpec | None:
        """None for a single-process instance (`distributed` missing or null)."""
        proc = ctx.process
        d = proc.get("distributed")
        if not d:
            return None
        name = proc.get("name", "?")
        key = f"plan process {name!r} distributed"
        if not isinstance(d, dict):
            raise ClusterConfigError(f"{key} must be a mapping or null, got {d!r}")
        n, pid = d.get("num_processes"), d.get("process_id")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ClusterConfigError(f"{key}.num_processes must be an integer >= 1, got {n!r}")
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < n:
            raise ClusterConfigError(f"{key}.process_id must be in [0, {n}), got {pid!r}")
        ids = d.get("local_device_ids")
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ClusterConfigError(f"{key}.local_device_ids must be a list of device ids, "
                                     f"got {ids!r}")
        leader = bool(proc.get("leader", pid == 0))
        if leader != (pid == 0):
            raise ClusterConfigError(f"plan process {name!r}: leader={leader} but process_id="
                                     f"{pid} (process 0 leads its instance)")
        instance = str(proc.get("instance_id", name))
        lead = leader_entry(ctx, instance) if not leader else proc
        control = (lead.get("ports") or {}).get("control")
        if control is None:
            raise ClusterConfigError(f"plan process {lead.get('name')!r} (leader of instance "
                                     f"{instance!r}) has no ports.control")
        return cls(instance_id=instance, coordinator=_addr(d.get("coordinator"),
                                                           f"{key}.coordinator"),
                   num_processes=n, process_id=pid,
                   local_device_ids=tuple(ids) if ids is not None else None, leader=leader,
                   control_addr=_addr(f"{lead.get('address', '127.0.0.1')}:{control}",
                                      f"plan process {lead.get('name')!r} ports.control"),
                   leader_entry=lead)


def leader_entry(ctx: Any, instance_id: str) -> dict[str, Any]:
    """The plan entry of `instance_id`'s leader (process 0)."""
    members = [p for p in ctx.plan.get("processes", []) if p.get("instance_id") == instance_id]
    leaders = [p for p in members if p.get("leader")
               or (p.get("distributed") or {}).get("process_id") == 0]
    if len(leaders) != 1:
        raise ClusterConfigError(
            f"instance {instance_id!r} needs exactly one leader process in plan.json, found "
            f"{[p.get('name') for p in leaders]} among {[p.get('name') for p in members]}")
    return leaders[0]


def initialize(spec: ClusterSpec, *, timeout_s: int = 300) -> None:
    """Join the instance's JAX cluster. Call before any other JAX use in the process."""
    import jax  # deferred: only a multi-process instance initialises a cluster

    # CPU backend: cross-process collectives need gloo (no effect on TPU / GPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw: dict[str, Any] = {}
    if spec.local_device_ids is not None:
        kw["local_device_ids"] = list(spec.local_device_ids)
    log.info("joining JAX cluster of instance %s at %s as process %d/%d", spec.instance_id,
             spec.coordinator, spec.process_id, spec.num_processes)
    jax.distributed.initialize(spec.coordinator, num_processes=spec.num_processes,
                               process_id=spec.process_id, initialization_timeout=timeout_s,
                               **kw)
    log.info("JAX cluster up: %d devices over %d processes (%d local)", jax.device_count(),
             jax.process_count(), jax.local_device_count())


def mesh_num_processes(mesh: Any) -> int:
    """How many processes own the devices of `mesh` (1 for a single-process mesh)."""
    return len({int(d.process_index) for d in mesh.devices.flat})
