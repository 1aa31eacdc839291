"""How a server process joins its instance: `start_process(ctx)`, called from the server's
main(). It returns None for a single-process instance or a leader (which then runs the normal
server; `make_scheduler` attaches the lockstep), or the exit code of a follower's whole life
(follower.py).
"""

from __future__ import annotations

from typing import Any

from pdtopo.runtime.distributed.cluster import ClusterSpec, initialize


def start_process(ctx: Any) -> int | None:
    """None: go on as a server (single process, or the leader); else a follower's exit code."""
    spec = ClusterSpec.from_context(ctx)
    if spec is None:
        return None
    initialize(spec)
    if spec.leader:
        return None
    # deferred: the follower's modules import JAX; a single-process server loads it later
    from pdtopo.runtime.distributed.follower import run_follower

    return run_follower(ctx, spec)
