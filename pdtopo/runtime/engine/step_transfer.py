"""One host-to-device transfer per engine step.

A step's inputs are a dozen small int32 arrays (tokens, positions, attention metadata); put one
by one, each is a transfer of its own, and on a fast device those add up to more than the
step. `StepTransfer.put(key, tree)` packs them into one host buffer, transfers it once, and
unpacks it on the devices with a program compiled per step shape (`key`), whose outputs are the
arrays the step programs take. `compile(key, tree)` builds that program ahead of serving
(from shapes only), so serving never compiles.

A step that continues the previous one (overlap scheduling) does not know its input tokens on
the host: `put(key, tree, feed=(prev_tokens, src))` takes them from the previous step's sampled
tokens, still on the device: token slot i gets `prev_tokens[src[i]]` where `src[i] >= 0` (src
travels in the same buffer; the unpacking program, compiled per step shape and number of
previous rows, does the gather).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class StepTransfer:
    """Single owner: the runner (under its lock)."""

    def __init__(self, sharding: Any):
        self.sharding = sharding
        self._unpack: dict[tuple, Any] = {}

    def _program(self, key: tuple, leaves: list[Any], treedef: Any,
                 feed_rows: int | None = None) -> Any:
        """The unpacking program; with `feed_rows`, the last leaf is `src` and the first (the
        tokens) is fed from a `[feed_rows]` array of previous tokens."""
        program = self._unpack.get((key, feed_rows))
        if program is None:
            shapes = [tuple(x.shape) for x in leaves]
            sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]

            def split(flat):
                out, at = [], 0
                for shape, size in zip(shapes, sizes, strict=True):
                    out.append(flat[at:at + size].reshape(shape))
                    at += size
                return out

            def unpack(flat):
                return jax.tree.unflatten(treedef, split(flat))

            def unpack_fed(flat, prev):
                out = split(flat)
                src = out.pop()
                out[0] = jnp.where(src >= 0, prev[jnp.maximum(src, 0)], out[0])
                return jax.tree.unflatten(treedef, out)

            flat = jax.ShapeDtypeStruct((sum(sizes),), np.int32, sharding=self.sharding)
            if feed_rows is None:
                program = jax.jit(unpack, out_shardings=self.sharding).lower(flat)
            else:
                prev = jax.ShapeDtypeStruct((feed_rows,), np.int32, sharding=self.sharding)
                program = jax.jit(unpack_fed, out_shardings=self.sharding).lower(flat, prev)
            program = self._unpack[(key, feed_rows)] = program.compile()
        return program

    def compile(self, key: tuple, tree: Any, feed_rows: int | None = None) -> None:
        """Compile the unpacking of a step shaped like `tree` (arrays or ShapeDtypeStructs),
        fed from `feed_rows` previous tokens when given."""
        if feed_rows is not None:
            tree = (*tree, jax.ShapeDtypeStruct(tree[0].shape, np.int32))
        leaves, treedef = jax.tree.flatten(tree)
        if feed_rows is not None:
            treedef = jax.tree.structure(tree[:-1])
        self._program(key, leaves, treedef, feed_rows)

    def put(self, key: tuple, tree: tuple, feed: tuple[jax.Array, np.ndarray] | None = None):
        """`tree` (a tuple of int32 NumPy arrays and pytrees of them, tokens first) on the
        devices, in one transfer; `feed`: (previous tokens on the device, src per token)."""
        if feed is None:
            leaves, treedef = jax.tree.flatten(tree)
            return self._program(key, leaves, treedef)(jax.device_put(self._pack(leaves),
                                                                      self.sharding))
        prev, src = feed
        leaves, treedef = jax.tree.flatten(tree)
        program = self._program(key, [*leaves, src], treedef, int(prev.shape[0]))
        return program(jax.device_put(self._pack([*leaves, src]), self.sharding),
                       jax.device_put(prev, self.sharding))

    @staticmethod
    def _pack(leaves: list[Any]) -> np.ndarray:
        return np.concatenate([np.asarray(x, np.int32).ravel() for x in leaves])
