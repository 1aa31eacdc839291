"""One host-to-device transfer per engine step.

A step's inputs are a dozen small int32 arrays (tokens, positions, attention metadata); put one
by one, each is a transfer of its own, and on a fast device those add up to more than the
step. `StepTransfer.put(key, tree)` packs them into one host buffer, transfers it once, and
unpacks it on the devices with a program compiled per step shape (`key`), whose outputs are the
arrays the step programs take. `compile(key, tree)` builds that program ahead of serving
(from shapes only), so serving never compiles.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class StepTransfer:
    """Single owner: the runner (under its lock)."""

    def __init__(self, sharding: Any):
        self.sharding = sharding
        self._unpack: dict[tuple, Any] = {}

    def _program(self, key: tuple, leaves: list[Any], treedef: Any) -> Any:
        program = self._unpack.get(key)
        if program is None:
            shapes = [tuple(x.shape) for x in leaves]
            sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]

            def unpack(flat):
                out, at = [], 0
                for shape, size in zip(shapes, sizes, strict=True):
                    out.append(flat[at:at + size].reshape(shape))
                    at += size
                return jax.tree.unflatten(treedef, out)

            flat = jax.ShapeDtypeStruct((sum(sizes),), np.int32, sharding=self.sharding)
            program = jax.jit(unpack, out_shardings=self.sharding).lower(flat).compile()
            self._unpack[key] = program
        return program

    def compile(self, key: tuple, tree: Any) -> None:
        """Compile the unpacking of a step shaped like `tree` (arrays or ShapeDtypeStructs)."""
        leaves, treedef = jax.tree.flatten(tree)
        self._program(key, leaves, treedef)

    def put(self, key: tuple, tree: Any) -> Any:
        """`tree` (int32 NumPy arrays) on the devices, in one transfer."""
        leaves, treedef = jax.tree.flatten(tree)
        flat = np.concatenate([np.asarray(x, np.int32).ravel() for x in leaves])
        return self._program(key, leaves, treedef)(jax.device_put(flat, self.sharding))
