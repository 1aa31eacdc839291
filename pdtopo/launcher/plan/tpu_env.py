"""Accelerator table and per-process chip environment (TPU chip split, CPU emulation).

One table (`ACCELERATORS`) says, per TPU type, how many chips a host has, how many hosts the
slice has, which `TPU_CHIPS_PER_PROCESS_BOUNDS` a process of 1, 2, 4 or all chips gets, which
`TPU_PROCESS_BOUNDS` a multi-process instance of N such processes gets (`process_grids`), and
the GKE node labels of the slice (research notes: shared/notes/tpu-env.md). `cpu-N` emulates N
chips per host with XLA's host platform device count. Everything here is pure: chip lists and
ports in, environment dicts out (`chip_env` for an independent process, `cluster_env` for one
process of a multi-process instance).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pdtopo.config.schema import TopologyError


@dataclass(frozen=True)
class Accelerator:
    name: str
    platform: str  # "tpu" | "cpu"
    num_chips: int
    # chips per process -> TPU_CHIPS_PER_PROCESS_BOUNDS (empty for cpu: any size goes)
    bounds: dict[int, str] = field(default_factory=dict)
    hosts: int = 1  # hosts (VMs) in the slice; num_chips is per host
    # (TPU_CHIPS_PER_PROCESS_BOUNDS, processes per instance) -> TPU_PROCESS_BOUNDS
    process_grids: dict[tuple[str, int], str] = field(default_factory=dict)
    gke_accelerator: str | None = None  # node label cloud.google.com/gke-tpu-accelerator
    gke_topology: str | None = None     # node label cloud.google.com/gke-tpu-topology
    hbm_gib: float | None = None        # memory per chip (KV pool estimates before start)

    def split_sizes(self) -> list[int]:
        return sorted(self.bounds) if self.bounds else list(range(1, self.num_chips + 1))


_V6E_LIKE = {1: "1,1,1", 2: "1,2,1", 4: "1,4,1", 8: "2,4,1"}  # host grid 2x4
_V6E_4 = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}  # host grid 2x2 (the VMs of v6e-16 and up)
_V4_LIKE = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}  # host grid 2x2x1, megacore chips
# The whole instance's chip grid is TPU_PROCESS_BOUNDS x TPU_CHIPS_PER_PROCESS_BOUNDS
# (element-wise). Entries from shared/notes/tpu-env.md; a pair not listed is refused.
_GRIDS_2D = {("1,1,1", 2): "1,2,1", ("1,1,1", 4): "2,2,1", ("1,1,1", 8): "2,4,1",
             ("1,2,1", 2): "2,1,1", ("1,2,1", 4): "2,2,1", ("1,4,1", 2): "2,1,1",
             ("2,2,1", 2): "1,2,1", ("2,2,1", 4): "2,2,1", ("2,4,1", 2): "2,1,1"}
_GRIDS_3D = {("1,1,1", 2): "1,2,1", ("1,1,1", 4): "2,2,1", ("1,2,1", 2): "2,1,1",
             ("2,2,1", 2): "1,1,2"}

ACCELERATORS: dict[str, Accelerator] = {
    "v6e-8": Accelerator("v6e-8", "tpu", 8, _V6E_LIKE, 1, _GRIDS_2D, "tpu-v6e-slice", "2x4", 32),
    "v6e-16": Accelerator("v6e-16", "tpu", 4, _V6E_4, 4, _GRIDS_2D, "tpu-v6e-slice", "4x4", 32),
    "v5e-8": Accelerator("v5e-8", "tpu", 8, _V6E_LIKE, 1, _GRIDS_2D, "tpu-v5-lite-podslice",
                         "2x4", 16),
    "v5p-8": Accelerator("v5p-8", "tpu", 4, _V4_LIKE, 1, _GRIDS_3D, "tpu-v5p-slice", "2x2x1", 95),
    "v4-8": Accelerator("v4-8", "tpu", 4, _V4_LIKE, 1, _GRIDS_3D, "tpu-v4-podslice", "2x2x1", 32),
}

_CPU_RE = re.compile(r"^cpu-([1-9][0-9]*)$")
KNOWN = ", ".join([*ACCELERATORS, "cpu-N"])


def accelerator_spec(name: str, platform: str) -> Accelerator:
    """Look up an accelerator; `cpu-N` is valid for any N >= 1 on platform cpu, and a TPU
    accelerator with platform cpu is emulated there (same chip split, CPU devices)."""
    match = _CPU_RE.match(str(name))
    if match:
        acc = Accelerator(str(name), "cpu", int(match.group(1)))
    elif name in ACCELERATORS:
        acc = ACCELERATORS[name]
    else:
        raise TopologyError("topology.accelerator", name, f"unknown accelerator (known: {KNOWN})")
    if acc.platform == "tpu" and platform == "cpu":
        # emulation: the same chips, hosts and splits, as CPU devices (no TPU env vars)
        return replace(acc, name=f"{acc.name} (emulated on cpu)", platform="cpu")
    if acc.platform != platform:
        raise TopologyError(
            "topology.accelerator", name,
            f"is a {acc.platform} accelerator but topology.platform={platform!r}",
        )
    return acc


def split_error(acc: Accelerator, chips: list[int], host_chips: int | None = None,
                host: str | None = None) -> str | None:
    """Why this chip set is not a valid per-process split of `acc` (on a host of `host_chips`
    chips, default the accelerator's chips per host), or None if it is."""
    if not chips:
        return "empty chip list"
    limit = acc.num_chips if host_chips is None else host_chips
    bad = [c for c in chips if not 0 <= c < limit]
    if bad:
        where = f"host {host} ({limit} chips)" if host else acc.name
        return f"chip {bad[0]} out of range 0..{limit - 1} for {where}"
    if len(set(chips)) != len(chips):
        return "a chip is listed twice"
    if not acc.bounds:
        return None
    ordered = sorted(chips)
    size = len(ordered)
    if size not in acc.bounds:
        return f"{size} chips per process is not a {acc.name} split (allowed: {acc.split_sizes()})"
    if ordered != list(range(ordered[0], ordered[0] + size)) or ordered[0] % size:
        return (f"{acc.name} splits into contiguous aligned ranges of {acc.split_sizes()} chips; "
                f"{ordered} is not one")
    return None


def process_grid(acc: Accelerator, chips_per_process: int, processes: int) -> str | None:
    """TPU_PROCESS_BOUNDS of an instance of `processes` processes, or None if unknown."""
    return acc.process_grids.get((acc.bounds.get(chips_per_process, ""), processes))


def cluster_env(acc: Accelerator, chips: list[int], process_id: int, addresses: list[str],
                tpu_process_port: int) -> dict[str, str]:
    """Environment of process `process_id` of a multi-process instance (one JAX cluster over
    `len(addresses)` processes; `addresses` are every process's "ADDR:TPU_PROCESS_PORT")."""
    if acc.platform == "cpu":
        return chip_env(acc, chips, tpu_process_port)
    grid = process_grid(acc, len(chips), len(addresses))
    if grid is None:
        raise ValueError(f"no TPU_PROCESS_BOUNDS for {len(addresses)} processes of "
                         f"{len(chips)} chips on {acc.name}")
    return {
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in sorted(chips)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": acc.bounds[len(chips)],
        "TPU_PROCESS_BOUNDS": grid,
        "TPU_PROCESS_PORT": str(tpu_process_port),
        "TPU_PROCESS_ADDRESSES": ",".join(addresses),
        "CLOUD_TPU_TASK_ID": str(process_id),
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def chip_env(acc: Accelerator, chips: list[int], tpu_process_port: int) -> dict[str, str]:
    """Environment that confines one independent JAX process to `chips`."""
    if acc.platform == "cpu":
        return {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={len(chips)}",
        }
    return {
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in sorted(chips)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": acc.bounds[len(chips)],
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(tpu_process_port),
        "TPU_PROCESS_ADDRESSES": f"localhost:{tpu_process_port}",
        "CLOUD_TPU_TASK_ID": "0",
    }


def share_cores(num_procs: int, cpus: int | Sequence[int] | None) -> list[list[int] | None]:
    """Fair CPU affinity over `cpus` (a core count meaning cores 0..n-1, or the core ids):
    disjoint contiguous core blocks when there are enough cores, otherwise round-robin single
    cores (each core shared by at most ceil(n/cores) processes). None: no affinity."""
    if not cpus or num_procs <= 0:
        return [None] * max(num_procs, 0)
    ids = list(range(cpus)) if isinstance(cpus, int) else sorted(int(c) for c in cpus)
    return [[ids[i] for i in block] for block in _blocks(num_procs, len(ids))]


def _blocks(num_procs: int, cpu_count: int) -> list[list[int]]:
    if num_procs <= cpu_count:
        base, extra = divmod(cpu_count, num_procs)
        out, start = [], 0
        for i in range(num_procs):
            n = base + (1 if i < extra else 0)
            out.append(list(range(start, start + n)))
            start += n
        return out
    return [[i % cpu_count] for i in range(num_procs)]
