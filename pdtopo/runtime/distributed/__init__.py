"""Multi-process P / D / colocated instances: one JAX cluster per instance, lockstep execution.

    cluster.py   plan entry `distributed` -> ClusterSpec; jax.distributed.initialize (gloo on CPU)
    control.py   leader <-> followers command channel (ZMQ ROUTER/DEALER, JSON)
    leader.py    LeaderRunner (forward broadcast first) + LeaderMirror (KV pool ops replayed)
    follower.py  the follower process: same runner, own transfer server, lockstep loop
    health.py    the follower's tiny /health endpoint

Entry: `start_process(ctx)` from the server's main(): None for a single-process instance or a
leader (which then runs the normal server; `make_scheduler` attaches the lockstep), or the exit
code of a follower's whole life.
"""

from __future__ import annotations

from typing import Any

from pdtopo.runtime.distributed.cluster import ClusterSpec, initialize


def start_process(ctx: Any) -> int | None:
    spec = ClusterSpec.from_context(ctx)
    if spec is None:
        return None
    initialize(spec)
    if spec.leader:
        return None
    # deferred: the follower's modules import JAX; a single-process server loads it later
    from pdtopo.runtime.distributed.follower import run_follower

    return run_follower(ctx, spec)
