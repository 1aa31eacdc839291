"""The KV transport between P and D: what a transfer is and how it moves.

    kvpoll.py, base.py   the contract: KVPoll, the 4 abstract roles, KVArgs and the pool
                         descriptors (PoolTransferSpec, PackedMeta), KVTransferError
    manager.py           JaxTransferKVManager (one per process; the scheduler's call sequence is
                         in its docstring) -> sender.py (P, one room), receiver.py (D, one room),
                         both on endpoint.py; resharding.py (its paths for unlike layouts)
    transfer_engine.py   JaxTransferKVEngine (jax.experimental.transfer), faults.py
    side_channel.py      ZMQ ROUTER/DEALER + its I/O thread, messages.py (the schema),
                         peer_watch.py (peers, events, disconnects), curve.py (CURVE beyond
                         loopback), zmq_source.py (a frame's connection)
    peers.py, resolve.py, expiring_cache.py   D's lookups of P: registrations and host names

It imports reshard/ (layouts) and nothing else of disagg: the roles sit above it.
"""
