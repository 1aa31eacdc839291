"""In-process KV transfer pieces: small sharded KV pools (`pool`, SHAPE over a "tp" mesh), a
JaxTransferKVManager per role with its own engine and side channel (`make_mgr`), and `drive`,
which polls senders/receivers until a condition on their states holds (`done`: all terminal).
Used by tests/e2e/test_transfer_engine.py and tests/e2e/test_multiprocess_unit.py."""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pdtopo.runtime.disagg.transport.base import KVArgs, PoolTransferSpec
from pdtopo.runtime.disagg.transport.manager import JaxTransferKVManager
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

SHAPE = (16, 4, 2, 8)


def sharding(tp: int) -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:tp]), ("tp",)),
                         PartitionSpec(None, None, "tp", None))


def pool(tp: int, fill: bool, entries: int = 4, dtype=np.float32):
    n = int(np.prod(SHAPE))
    return [jax.device_put((np.arange(n, dtype=dtype).reshape(SHAPE) + e * n) if fill
                           else np.zeros(SHAPE, dtype), sharding(tp)) for e in range(entries)]


class Runner:
    def __init__(self, kv):
        self.kv_caches = kv


def make_mgr(role: str, kv, **kw):
    engine = JaxTransferKVEngine(transfer_sockets=1, pull_workers=2, sweep_interval_s=0.2)
    channel = SideChannel(bind="127.0.0.1:0" if role == "prefill" else None, name=role)
    mgr = JaxTransferKVManager(KVArgs(pools=[PoolTransferSpec.from_kv_caches(kv)]),
                               engine=engine, channel=channel, owns_transport=True,
                               kernels_impl="xla", **kw)
    mgr.register_runner(Runner(kv))
    return mgr


def drive(*objs, until, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [o.poll() for o in objs]
        if until(states):
            return
        time.sleep(0.005)
    raise AssertionError(f"states {[o.poll() for o in objs]} after {timeout} s")


def done(states):
    return all(s.terminal for s in states)
