"""The process's device mesh: a 1-D mesh with axis "tp" over the first `tp` local devices.

Model weights are sharded Megatron style and the KV pool along kv heads over this axis (see
`pdtopo.runtime.model.llama.param_specs` and `docs/architecture.md`). On the CPU the devices
are the emulated host devices (`--xla_force_host_platform_device_count`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXIS = "tp"


def build_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh(("tp",)) over `devices[:tp]` (default: `jax.devices()`)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"mesh tp={tp!r} must be a positive integer")
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < tp:
        raise ValueError(
            f"mesh tp={tp} needs {tp} devices but this process sees {len(devs)} "
            f"({jax.default_backend()}); on the CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp}"
        )
    return Mesh(np.array(devs[:tp]), (AXIS,))


def local_process_index(mesh: Mesh) -> int:
    """This process's index among the processes `mesh` spans (0 for one process): the numbering
    of a KV layout's `shard_processes`."""
    procs = sorted({int(d.process_index) for d in mesh.devices.flat})
    return procs.index(jax.process_index()) if jax.process_index() in procs else 0
