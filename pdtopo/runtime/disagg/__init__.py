"""PD disaggregation: KVPoll, the 4-tuple ABC, the JAX transfer engine, side channel, mixins.

Modules: kvpoll (KVPoll + monotonic holder), base (ABCs, KVArgs, PoolTransferSpec, PackedMeta),
messages (side-channel schema), side_channel (ZMQ ROUTER/DEALER + I/O thread),
transfer_engine (JaxTransferKVEngine), faults (fault injection), jax_transfer
(JaxTransferKVManager / Sender / Receiver: the call sequence for the scheduler is in its
docstring).
"""
