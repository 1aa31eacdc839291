"""Multi-process P / D / colocated instances: one JAX cluster per instance, lockstep execution.

    entry.py     start_process(ctx): how a server process joins its instance (re-exported)
    cluster.py   plan entry `distributed` -> ClusterSpec; jax.distributed.initialize (gloo on CPU)
    control.py   leader <-> followers command channel (ZMQ ROUTER/DEALER, JSON)
    leader.py    LeaderRunner (forward broadcast first) + LeaderMirror (KV pool ops replayed)
    follower.py  the follower process: same runner, own transfer server, lockstep loop
    health.py    the follower's tiny /health endpoint
"""

from pdtopo.runtime.distributed.entry import start_process

__all__ = ["start_process"]
