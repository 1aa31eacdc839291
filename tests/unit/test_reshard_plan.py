"""The reshard plan (pure): which heads of which P shard fill each D shard, the layout
checks, the side-channel layout fields, and (in process, 4 emulated devices) that cutting on
P's layout and assembling on D's equals converting the whole array."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdtopo.runtime.disagg.reshard.arrays import assemble, cut_pieces
from pdtopo.runtime.disagg.reshard.layout import (
    KVShardLayout,
    Piece,
    instance_layouts,
    layout_problems,
    moved_heads,
    plan_pieces,
    reshard_problems,
    same_layout,
)
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.engine.pool_format import POOL_FORMAT


def lay(model: int, pool: int, tp: int, procs=None) -> KVShardLayout:
    return KVShardLayout(model, pool, tp, tuple(procs or [0] * tp))


def test_pieces_name_the_processes_on_both_sides():
    # P: 2 processes x 1 device; D: 1 process x 2 devices (and the reverse)
    pieces = plan_pieces(lay(4, 4, 2, [0, 1]), lay(4, 4, 2))
    assert [(pc.p_process, pc.d_process, pc.d_shard) for pc in pieces] == [(0, 0, 0), (1, 0, 1)]
    pieces = plan_pieces(lay(4, 4, 1), lay(4, 4, 2, [0, 1]))
    assert [(pc.p_process, pc.d_process, pc.p_start) for pc in pieces] == [(0, 0, 0), (0, 1, 2)]


def test_wide_p_to_narrow_d_takes_whole_shards():
    pieces = plan_pieces(lay(4, 4, 2), lay(4, 4, 1))
    assert pieces == (Piece(0, 0, 0, 0, 2, 0, 0), Piece(0, 2, 1, 0, 2, 0, 0))
    assert all(pc.whole_p_shard(lay(4, 4, 2)) for pc in pieces)


def test_narrow_p_to_wide_d_slices_one_shard():
    pieces = plan_pieces(lay(8, 8, 1), lay(8, 8, 4))
    assert [(pc.d_shard, pc.p_start, pc.heads) for pc in pieces] == \
        [(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]
    assert moved_heads(pieces) == 8  # the KV once


def test_p4_to_d2_merges_nothing_across_shards():
    pieces = plan_pieces(lay(8, 8, 4), lay(8, 8, 2))
    assert [(pc.d_shard, pc.d_offset, pc.p_shard, pc.heads) for pc in pieces] == \
        [(0, 0, 0, 2), (0, 2, 1, 2), (1, 0, 2, 2), (1, 2, 3, 2)]


def test_replicated_p_sends_first_copies_only():
    # P tp=4 repeats 2 model heads twice (pool heads 0,1 = head 0; 2,3 = head 1)
    pieces = plan_pieces(lay(2, 4, 4), lay(2, 2, 1))
    assert [(pc.p_shard, pc.p_start, pc.d_offset) for pc in pieces] == [(0, 0, 0), (2, 0, 1)]
    assert moved_heads(pieces) == 2


def test_replicated_d_pulls_each_replica():
    pieces = plan_pieces(lay(2, 2, 1), lay(2, 4, 4))
    assert [(pc.d_shard, pc.p_start) for pc in pieces] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert moved_heads(pieces) == 4  # what D's replication requires, no more


def test_layout_checks():
    assert same_layout(lay(4, 4, 2), lay(4, 4, 2))
    assert not same_layout(lay(4, 4, 2), lay(4, 4, 2, [0, 1]))
    assert reshard_problems(lay(4, 4, 2), lay(2, 2, 1)) == \
        ["model KV heads: P has 4, D has 2"]
    assert reshard_problems(lay(4, 4, 2, [0, 1]), lay(4, 4, 1)) == []
    assert reshard_problems(lay(4, 4, 2, [0, 1]), lay(4, 4, 2, [0, 1])) == []
    with pytest.raises(ValueError, match="model KV heads"):
        plan_pieces(lay(4, 4, 2), lay(2, 2, 1))
    with pytest.raises(ValueError, match="multiple"):
        KVShardLayout(4, 6, 2, (0, 0))
    with pytest.raises(ValueError, match="process indices"):
        KVShardLayout(4, 4, 2, (0, 5))


def runner_layout(tp: int, kv: int, model: int, procs=None, **over) -> dict:
    base = {"num_entries": 4, "page_size": 16, "kv_heads": kv, "model_kv_heads": model,
            "head_dim": 8, "dtype": "float32", "partition_spec": [None, None, "tp", None],
            "tp": tp, "num_processes": len(set(procs or [0])),
            "shard_processes": procs or [0] * tp}
    return {**base, **over}


def test_layout_problems_name_the_keys():
    assert layout_problems(runner_layout(1, 4, 4), runner_layout(2, 4, 4)) == []
    assert layout_problems(runner_layout(1, 2, 2), runner_layout(4, 4, 2)) == []
    assert layout_problems(runner_layout(1, 4, 4), runner_layout(1, 4, 4, head_dim=16)) == \
        ["kv_layout.head_dim: this server has 8, peer has 16"]
    assert layout_problems(runner_layout(1, 4, 4), runner_layout(1, 4, 4, page_size=8)) == \
        ["kv_layout.page_size: this server has 16, peer has 8"]
    assert layout_problems(runner_layout(1, 4, 4), runner_layout(2, 4, 4, [0, 1])) == []
    (why,) = layout_problems(runner_layout(1, 4, 4), runner_layout(2, 2, 2))
    assert why == "kv_layout.model_kv_heads: this server has 4, peer has 2"


def test_pool_formats_must_match_and_old_servers_store_todays():
    new = runner_layout(1, 4, 4, pool_format=POOL_FORMAT)
    assert layout_problems(new, runner_layout(1, 4, 4)) == []  # a server without the key
    (why,) = layout_problems(new, runner_layout(1, 4, 4, pool_format="fused-kv/2"))
    assert why.startswith("kv_layout.pool_format: this server stores its KV pool as "
                          f"{POOL_FORMAT!r}, the peer as 'fused-kv/2'")


def test_instance_layouts_from_a_plan():
    procs = [{"role": "prefill", "instance_id": "p0", "mesh": {"tp": 2}},
             {"role": "decode", "instance_id": "d0", "mesh": {"tp": 1}},
             {"role": "decode", "instance_id": "d1", "mesh": {"tp": 4},
              "distributed": {"num_processes": 2}},
             {"role": "decode", "instance_id": "d1", "mesh": {"tp": 4}},
             {"role": "decode", "instance_id": "d2", "mesh": {"tp": 3}}]
    heads = {1: 2, 2: 2, 4: 4}.get  # a 2-head model: tp 4 repeats, tp 3 cannot split
    got = instance_layouts(procs, "decode", 2, heads)
    assert got == {"d0": lay(2, 2, 1), "d1": lay(2, 4, 4, [0, 0, 1, 1]), "d2": None}


def test_side_channel_layout_fields_round_trip_and_are_checked():
    layout = lay(2, 4, 4).to_dict()
    want = m.decode(m.encode(m.Want(room=3, layout=layout)), 65536)
    assert want.layout == layout
    assert m.decode(m.encode(m.Want(room=3)), 65536).layout is None
    ready = m.Ready(room=3, transfer_addr="h:1", transfer_uuid=5, expires_at=1.0, pools=(),
                    prompt_len=0)
    for addrs in (["h:1", ":5"], ["h:99999"], [], ["h:1", 7]):
        raw = dict(m.to_dict(ready), pools=[{"name": "main_kv", "pool_type": "main_kv",
                                             "dtype": "float32", "shape": [1, 4, 2, 8],
                                             "num_entries": 4, "sharding": {"num_devices": 1}}],
                   transfer_addrs=addrs)
        with pytest.raises(m.MessageError, match="transfer_addrs"):
            m.from_dict(raw)
    for bad, why in (({"tp": 2, "kv_heads": 3}, "multiple"),
                     ({"tp": "x", "kv_heads": 2}, "malformed"),
                     ({"tp": 2, "kv_heads": 2, "shard_processes": [0, 9]}, "process"),
                     ({"tp": 2, "kv_heads": 2, "shard_processes": "01"}, "list of integers"),
                     ({"tp": 1, "kv_heads": 0, "model_kv_heads": 2}, "kv_heads=0"),
                     ({"tp": 1, "kv_heads": 1, "model_kv_heads": 2}, "at least"),
                     ({"tp": 10**9, "kv_heads": 2}, "tp=1000000000"),
                     ({"tp": 1e400, "kv_heads": 2}, "malformed"),
                     ({"kv_heads": 2}, "malformed")):
        raw = m.encode(m.Want(room=3, layout=bad))
        with pytest.raises(m.MessageError, match=why):
            m.decode(raw, 65536)


@pytest.mark.parametrize("p_tp,p_pool,d_tp,d_pool,model", [
    (2, 4, 1, 4, 4), (1, 4, 2, 4, 4), (4, 4, 2, 4, 4), (4, 4, 1, 2, 2), (1, 2, 4, 4, 2),
    (2, 4, 4, 4, 4)])
def test_cut_then_assemble_equals_the_layout_conversion(p_tp, p_pool, d_tp, d_pool, model):
    devices = jax.devices()
    assert len(devices) >= 4
    p_layout, d_layout = lay(model, p_pool, p_tp), lay(model, d_pool, d_tp)
    spec = P(None, None, "tp", None)
    p_sharding = NamedSharding(Mesh(np.array(devices[:p_tp]), ("tp",)), spec)
    d_sharding = NamedSharding(Mesh(np.array(devices[-d_tp:]), ("tp",)), spec)
    base = np.arange(3 * 2 * model * 8, dtype=np.float32).reshape(3, 2, model, 8)
    entries = [base, base + 1000]
    packed = [jax.device_put(np.repeat(e, p_pool // model, axis=2), p_sharding)
              for e in entries]
    pieces = plan_pieces(p_layout, d_layout)
    moved = cut_pieces(packed, p_layout, pieces)
    # what the transfer does: each piece lands on its D shard's device
    d_devices = list(d_sharding.mesh.devices.flat)
    landed = [jax.device_put(x, d_devices[pc.d_shard])
              for x, pc in zip(moved, list(pieces) * len(entries), strict=True)]
    out = assemble(landed, pieces, d_layout, d_sharding, len(entries))
    for got, e in zip(out, entries, strict=True):
        assert got.sharding == d_sharding
        np.testing.assert_array_equal(np.asarray(got), np.repeat(e, d_pool // model, axis=2))
    assert sum(x.nbytes for x in moved) == len(entries) * 3 * 2 * d_pool * 8 * 4


@pytest.mark.parametrize("p_tp,p_pool,d_tp,d_pool,model", [
    (2, 4, 1, 4, 4),      # uniform: straight into head ranges
    (1, 4, 2, 4, 4),
    (4, 4, 1, 2, 2),      # replicated on P
    (2, 6, 3, 6, 6),      # D shard 1 takes a head from each P shard: joined first
])
@pytest.mark.parametrize("skip", [0, 2])
def test_scatter_pieces_writes_what_the_layout_conversion_gives(p_tp, p_pool, d_tp, d_pool,
                                                                model, skip):
    from pdtopo.runtime.disagg.reshard.arrays import slot_offsets, zero_pieces
    from pdtopo.runtime.disagg.transport.base import PoolTransferSpec
    from pdtopo.runtime.disagg.transport.resharding import scatter_pieces

    devices = jax.devices()
    p_layout, d_layout = lay(model, p_pool, p_tp), lay(model, d_pool, d_tp)
    spec = P(None, None, "tp", None)
    p_sharding = NamedSharding(Mesh(np.array(devices[:p_tp]), ("tp",)), spec)
    d_sharding = NamedSharding(Mesh(np.array(devices[-d_tp:]), ("tp",)), spec)
    pieces = plan_pieces(p_layout, d_layout)
    assert (slot_offsets(pieces, d_layout) is None) == (d_tp == 3)
    rng = np.random.default_rng(0)
    # the wire's 8 rows (wire_rows(skip + 3)): `skip` pages D holds, the 3 it takes, padding
    entries = [rng.standard_normal((8, 2, model, 8)).astype(np.float32) for _ in range(2)]
    packed = [jax.device_put(np.repeat(e, p_pool // model, axis=2), p_sharding)
              for e in entries]
    d_devices = list(d_sharding.mesh.devices.flat)
    landed = [jax.device_put(x, d_devices[pc.d_shard]) for x, pc in
              zip(cut_pieces(packed, p_layout, pieces), list(pieces) * 2, strict=True)]
    pool = [jax.device_put(np.zeros((8, 2, d_pool, 8), np.float32), d_sharding)
            for _ in range(2)]
    spec_d = PoolTransferSpec.from_kv_caches(pool)
    assert len(zero_pieces(8, spec_d, d_layout, pieces, 2)) == len(landed)

    def fallback(kv, p, ids, first_row):
        return [k.at[np.asarray(ids)].set(x[first_row:first_row + len(ids)])
                for k, x in zip(kv, p, strict=True)]

    out = scatter_pieces(pool, landed, list(pieces), pieces, d_layout, spec_d, [6, 1, 4], skip,
                         fallback)
    for got, e in zip(out, entries, strict=True):
        want = np.zeros((8, 2, d_pool, 8), np.float32)
        want[[6, 1, 4]] = np.repeat(e[skip:skip + 3], d_pool // model, axis=2)
        assert got.sharding == d_sharding
        np.testing.assert_array_equal(np.asarray(got), want)
