"""What JAX's TPU interpreter needs to run pdtopo's kernels on several CPU devices.

The interpreter (``interpret=pltpu.InterpretParams(...)``) runs a kernel as a chain of
``io_callback``s. In jax 0.10.2, ``io_callback``'s host side first ``device_put``s every operand
onto CPU device 0 and only then converts it to NumPy. Under ``shard_map`` each device runs its
own callbacks at the same time, and a copy of a large operand (measured here: a few hundred KB,
e.g. one device's share of a KV pool) from device i to device 0 waits for device 0, which is
itself inside a callback: every device then waits forever (seen with tp=4, a 650 KB pool shard,
on this 2-core machine; small operands are copied inline and do not hang).

``install()`` replaces that host side with one that converts each operand to NumPy where it
already lives (a CPU buffer: no copy between devices), which is all the interpreter's callbacks
need. It is installed only when a kernel is run interpreted, never on a TPU, and only once.
"""

from __future__ import annotations

import threading

import numpy as np
from jax._src import callback as _callback
from jax._src import tree_util

_lock = threading.Lock()
_installed = False


def _io_callback_on_own_device(*args, result_avals, callback, sharding, ordered):
    del result_avals, sharding, ordered
    args = tree_util.tree_map(np.asarray, args)
    return tree_util.tree_map(np.asarray, callback(*args))


def install() -> None:
    """Make interpreted kernels safe under a multi-device ``shard_map`` (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            _callback.io_callback_impl = _io_callback_on_own_device
            _installed = True
