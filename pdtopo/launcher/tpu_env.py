"""Accelerator table and per-process chip environment (TPU chip split, CPU emulation).

One table (`ACCELERATORS`) says, per TPU host type, how many chips it has and which
`TPU_CHIPS_PER_PROCESS_BOUNDS` a process of 1, 2, 4 or all chips gets (research notes:
shared/notes/tpu-env.md). `cpu-N` emulates N chips with XLA's host platform device count.
Everything here is pure: chip lists and ports in, environment dicts out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdtopo.config.schema import TopologyError


@dataclass(frozen=True)
class Accelerator:
    name: str
    platform: str  # "tpu" | "cpu"
    num_chips: int
    # chips per process -> TPU_CHIPS_PER_PROCESS_BOUNDS (empty for cpu: any size goes)
    bounds: dict[int, str] = field(default_factory=dict)

    def split_sizes(self) -> list[int]:
        return sorted(self.bounds) if self.bounds else list(range(1, self.num_chips + 1))


_V6E_LIKE = {1: "1,1,1", 2: "1,2,1", 4: "1,4,1", 8: "2,4,1"}  # host grid 2x4
_V4_LIKE = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}  # host grid 2x2x1, megacore chips

ACCELERATORS: dict[str, Accelerator] = {
    "v6e-8": Accelerator("v6e-8", "tpu", 8, _V6E_LIKE),
    "v5e-8": Accelerator("v5e-8", "tpu", 8, _V6E_LIKE),
    "v5p-8": Accelerator("v5p-8", "tpu", 4, _V4_LIKE),
    "v4-8": Accelerator("v4-8", "tpu", 4, _V4_LIKE),
}

_CPU_RE = re.compile(r"^cpu-([1-9][0-9]*)$")
KNOWN = ", ".join([*ACCELERATORS, "cpu-N"])


def accelerator_spec(name: str, platform: str) -> Accelerator:
    """Look up an accelerator; `cpu-N` is valid for any N >= 1 on platform cpu."""
    match = _CPU_RE.match(str(name))
    if match:
        acc = Accelerator(str(name), "cpu", int(match.group(1)))
    elif name in ACCELERATORS:
        acc = ACCELERATORS[name]
    else:
        raise TopologyError("topology.accelerator", name, f"unknown accelerator (known: {KNOWN})")
    if acc.platform != platform:
        raise TopologyError(
            "topology.accelerator", name,
            f"is a {acc.platform} accelerator but topology.platform={platform!r}",
        )
    return acc


def split_error(acc: Accelerator, chips: list[int]) -> str | None:
    """Why this chip set is not a valid per-process split of `acc`, or None if it is."""
    if not chips:
        return "empty chip list"
    bad = [c for c in chips if not 0 <= c < acc.num_chips]
    if bad:
        return f"chip {bad[0]} out of range 0..{acc.num_chips - 1} for {acc.name}"
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
