"""Sample side-channel messages: META (a tp=2 main_kv pool's PackedMeta) and READY (a P->D
Ready that carries it, with every optional field set). Used by tests/unit/test_side_channel.py
and tests/unit/test_pd_timeline.py."""

from __future__ import annotations

from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.base import PackedMeta

META = PackedMeta(name="main_kv", pool_type="main_kv", dtype="float32", shape=(3, 4, 2, 8),
                  num_entries=4, sharding={"kind": "named", "mesh": [["tp", 2]],
                                           "spec": [None, None, "tp", None], "num_devices": 2})
READY = m.Ready(room=2**64 - 1, transfer_addr="127.0.0.1:1234", transfer_uuid=99,
                expires_at=1.5e9, pools=(META,), prompt_len=12, first_token=5,
                first_logprob=-0.25)
