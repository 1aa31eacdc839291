"""The array side of a KV reshard between P and D laid out differently (`reshard.plan_pieces`).

    P: arrays = cut_pieces(packed, p_layout, pieces)      # registered for D's pull
    D: specs = piece_specs(meta, pieces, d_sharding)      # what D pulls (one spec per array)
       packed = assemble(pulled, pieces, d_layout, d_sharding, num_entries)

Arrays are ordered entry by entry (k_0, v_0, k_1, ...), and within an entry piece by piece.
A piece is one single-device array: on P it is its P shard's buffer (a whole shard moves as it
is) or a slice of it along heads (a copy on that device); jax.experimental.transfer moves each to
the device of its D shard. D concatenates the pieces of a shard along heads (nothing to do
when one piece fills it) and joins the shards into an array with its pool's sharding, ready for
the ordinary scatter. Slices and concatenations compile once per page count; both sides warm
the counts a request can have before serving (`warm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdtopo.runtime.disagg.reshard import KVShardLayout, Piece


def shard_devices(sharding: Any, shards: int) -> list[Any]:
    """The device of each shard (index along heads) of a pool sharding over a 1-D tp mesh."""
    mesh = getattr(sharding, "mesh", None)
    devices = list(mesh.devices.flat) if mesh is not None else list(sharding.device_set)
    if len(devices) != shards:
        raise ValueError(f"the pool sharding spans {len(devices)} devices, its layout "
                         f"{shards} shards")
    return devices


def _shards_by_index(a: jax.Array, layout: KVShardLayout) -> dict[int, jax.Array]:
    out = {}
    for sh in a.addressable_shards:
        start = sh.index[2].start or 0
        out[start // layout.heads_per_shard] = sh.data
    return out


def cut_pieces(packed: Sequence[jax.Array], p_layout: KVShardLayout,
               pieces: Sequence[Piece]) -> list[jax.Array]:
    """P: the single-device arrays of `pieces` for every packed entry, in transfer order."""
    out = []
    for a in packed:
        shards = _shards_by_index(a, p_layout)
        for pc in pieces:
            if pc.p_shard not in shards:
                raise ValueError(f"P shard {pc.p_shard} is not on this process "
                                 f"(holds {sorted(shards)})")
            x = shards[pc.p_shard]
            out.append(x if pc.whole_p_shard(p_layout)
                       else x[:, :, pc.p_start:pc.p_start + pc.heads])
    return out


def piece_specs(num_pages: int, page_size: int, head_dim: int, dtype: Any, num_entries: int,
                pieces: Sequence[Piece], d_sharding: Any, d_layout: KVShardLayout) -> list[Any]:
    """D: ShapeDtypeStructs of every array `cut_pieces` registers, each on its D shard's
    device."""
    devices = shard_devices(d_sharding, d_layout.shards)
    one_entry = [jax.ShapeDtypeStruct((int(num_pages), int(page_size), pc.heads, int(head_dim)),
                                      dtype, sharding=jax.sharding.SingleDeviceSharding(
                                          devices[pc.d_shard]))
                 for pc in pieces]
    return one_entry * int(num_entries)


def assemble(pulled: Sequence[jax.Array], pieces: Sequence[Piece], d_layout: KVShardLayout,
             d_sharding: Any, num_entries: int) -> list[jax.Array]:
    """D: the packed arrays in D's pool sharding from the pulled pieces."""
    per = len(pieces)
    if len(pulled) != per * num_entries:
        raise ValueError(f"pulled {len(pulled)} arrays, expected {per} pieces x "
                         f"{num_entries} entries")
    devices = shard_devices(d_sharding, d_layout.shards)
    out = []
    for e in range(num_entries):
        arrays = pulled[e * per:(e + 1) * per]
        by_shard: list[list[jax.Array]] = [[] for _ in range(d_layout.shards)]
        for pc, x in zip(pieces, arrays, strict=True):
            by_shard[pc.d_shard].append(x)
        shards = [g[0] if len(g) == 1 else jnp.concatenate(g, axis=2) for g in by_shard]
        n, page, _, hd = shards[0].shape
        shards = [jax.device_put(s, d) for s, d in zip(shards, devices, strict=True)]
        out.append(jax.make_array_from_single_device_arrays(
            (n, page, d_layout.pool_heads, hd), d_sharding, shards))
    return out


def warm(role: str, counts: Sequence[int], pool_spec: Any, mine: KVShardLayout,
         peers: Sequence[KVShardLayout], pieces_for: Any) -> int:
    """Compile the cuts (P) or concatenations (D) of every page count in `counts` for each
    peer layout that differs from `mine`; `pieces_for(peer)` plans them. Returns the number of
    (peer, count) pairs warmed."""
    done = 0
    _, page, heads, hd = pool_spec.shape
    for peer in peers:
        pieces = pieces_for(peer)
        for n in counts:
            if role == "prefill":
                packed = jax.device_put(np.zeros((n, page, heads, hd), pool_spec.dtype),
                                        pool_spec.sharding)
                jax.block_until_ready(cut_pieces([packed], mine, pieces))
            else:
                devices = shard_devices(pool_spec.sharding, mine.shards)
                pulled = [jax.device_put(np.zeros((n, page, pc.heads, hd), pool_spec.dtype),
                                         devices[pc.d_shard]) for pc in pieces]
                jax.block_until_ready(assemble(pulled, pieces, mine, pool_spec.sharding, 1))
            done += 1
    return done
