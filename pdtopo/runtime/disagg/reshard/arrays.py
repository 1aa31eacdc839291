"""The array side of a KV reshard between P and D laid out differently (`layout.plan_pieces`).

    P: arrays = cut_pieces(packed, p_layout, pieces)      # registered for D's pull
    D: specs = piece_specs(meta, pieces, d_sharding)      # what D pulls (one spec per array)
       packed = assemble(pulled, pieces, d_layout, d_sharding, num_entries)

Arrays are ordered entry by entry (k_0, v_0, k_1, ...), and within an entry piece by piece.
A piece is one single-device array: on P it is its P shard's buffer (a whole shard moves as it
is) or a slice of it along heads (a copy on that device); jax.experimental.transfer moves each to
the device of its D shard. D concatenates the pieces of a shard along heads (nothing to do
when one piece fills it) and joins the shards into an array with its pool's sharding, ready for
the ordinary scatter, or (`slot_offsets`: every D shard takes the same pieces) writes them straight
into head ranges of the pool (`transport.resharding.scatter_pieces`). The pieces have the wire's rows
(`transport.base.wire_rows`: the pages, then padding to a power of two), so slices, joins and piece
scatters compile once per bucket of page counts; both sides warm the buckets before serving.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, Piece


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
    """D: the packed arrays in D's pool sharding from the pulled pieces (those of this
    process's shards, `pieces_of_d_process`, on a multi-process D)."""
    per = len(pieces)
    if len(pulled) != per * num_entries:
        raise ValueError(f"pulled {len(pulled)} arrays, expected {per} pieces x "
                         f"{num_entries} entries")
    devices = shard_devices(d_sharding, d_layout.shards)
    local = sorted({pc.d_shard for pc in pieces})  # a multi-process D: this process's shards
    out = []
    for e in range(num_entries):
        arrays = pulled[e * per:(e + 1) * per]
        by_shard: dict[int, list[jax.Array]] = {s: [] for s in local}
        for pc, x in zip(pieces, arrays, strict=True):
            by_shard[pc.d_shard].append(x)
        shards = [jax.device_put(g[0] if len(g) == 1 else jnp.concatenate(g, axis=2),
                                 devices[s]) for s, g in by_shard.items()]
        n, page, _, hd = shards[0].shape
        out.append(jax.make_array_from_single_device_arrays(
            (n, page, d_layout.pool_heads, hd), d_sharding, shards))
    return out


def slot_offsets(pieces: Sequence[Piece], d_layout: KVShardLayout) -> tuple[int, ...] | None:
    """When every D shard takes the same pieces (the same head offsets and sizes, as for tp
    sizes that divide each other): slot k's local head offset on every shard; else None."""
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for pc in pieces:
        by_shard.setdefault(pc.d_shard, []).append((pc.d_offset, pc.heads))
    shapes = set(map(tuple, by_shard.values()))
    if len(shapes) != 1:
        return None
    return tuple(off for off, _ in next(iter(shapes)))


def piece_slots(pulled: Sequence[jax.Array], pieces: Sequence[Piece], d_layout: KVShardLayout,
                d_sharding: Any, num_entries: int) -> list[list[jax.Array]]:
    """D: per entry, one array per slot, sharded like the pool (this process's shards of it):
    the pulled pieces themselves, no copy. Needs `slot_offsets(...)` to be not None."""
    per = len(pieces)
    devices = shard_devices(d_sharding, d_layout.shards)
    out = []
    for e in range(num_entries):
        slots: dict[int, list[jax.Array]] = {}
        seen: dict[int, int] = {}
        for pc, x in zip(pieces, pulled[e * per:(e + 1) * per], strict=True):
            k = seen.get(pc.d_shard, 0)
            seen[pc.d_shard] = k + 1
            slots.setdefault(k, []).append(jax.device_put(x, devices[pc.d_shard]))
        entry = []
        for k in sorted(slots):
            n, page, heads, hd = slots[k][0].shape
            entry.append(jax.make_array_from_single_device_arrays(
                (n, page, heads * d_layout.shards, hd), d_sharding, slots[k]))
        out.append(entry)
    return out


def warm_cuts(counts: Sequence[int], pool_spec: Any, mine: KVShardLayout,
              pieces: Sequence[Piece]) -> None:
    """P: compile the cuts of `pieces` for every page count in `counts`."""
    _, page, heads, hd = pool_spec.shape
    for n in counts:
        packed = jax.device_put(np.zeros((n, page, heads, hd), pool_spec.dtype),
                                pool_spec.sharding)
        jax.block_until_ready(cut_pieces([packed], mine, pieces))


def zero_pieces(n: int, pool_spec: Any, mine: KVShardLayout, pieces: Sequence[Piece],
                num_entries: int) -> list[jax.Array]:
    """D: zero arrays shaped and placed like the pulled `pieces` of `n` pages (warmup)."""
    _, page, _, hd = pool_spec.shape
    devices = shard_devices(pool_spec.sharding, mine.shards)
    return [jax.device_put(np.zeros((n, page, pc.heads, hd), pool_spec.dtype),
                           devices[pc.d_shard])
            for _ in range(num_entries) for pc in pieces]


# ----------------------------------------------------------------------------- transfer parts
# A P process registers, per decode process that takes pieces from it, one `part`: its pieces
# for that process under `part_uuid(uuid, d_process)`. A D process pulls one part from every P
# process that holds pieces of its shards, and gets back its pieces in plan order.

def part_uuid(uuid: int, d_process: int) -> int:
    """The uuid of the part for decode process `d_process` (0: the room's uuid itself)."""
    if d_process == 0:
        return int(uuid)
    return (int(uuid) ^ (int(d_process) * 0x9E3779B97F4A7C15)) & (2**63 - 1) or 1


def pieces_of_d_process(pieces: Sequence[Piece], d_process: int) -> list[Piece]:
    return [pc for pc in pieces if pc.d_process == d_process]


def register_parts(engine: Any, room: int, packed: Sequence[jax.Array], p_layout: KVShardLayout,
                   pieces: Sequence[Piece], p_process: int, uuid: int,
                   expire_s: float) -> float | None:
    """P process `p_process`: register its pieces of `packed` for every decode process that
    takes any. Returns the registrations' deadline (None when it holds no piece)."""
    deadline = None
    for d_proc in sorted({pc.d_process for pc in pieces if pc.p_process == p_process}):
        mine = [pc for pc in pieces if pc.p_process == p_process and pc.d_process == d_proc]
        _, deadline = engine.register(room, cut_pieces(packed, p_layout, mine), expire_s,
                                      uuid=part_uuid(uuid, d_proc), part=d_proc)
    return deadline


def pull_parts(engine: Any, room: int, p_addrs: Sequence[str], uuid: int,
               mine: Sequence[Piece], d_process: int, num_entries: int, specs_of: Any,
               timeout_s: float) -> cf.Future:
    """D process `d_process`: pull its pieces `mine` (one pull per P process holding some);
    a Future of the pulled arrays, entry by entry, in the order of `mine`."""
    groups: dict[int, list[int]] = {}
    for i, pc in enumerate(mine):
        groups.setdefault(pc.p_process, []).append(i)
    missing = [p for p in groups if p >= len(p_addrs)]
    if missing:
        raise ValueError(f"P processes {missing} hold pieces but P announced transfer "
                         f"addresses for {len(p_addrs)} process(es)")
    specs = {p: specs_of([mine[i] for i in idx]) for p, idx in groups.items()}
    futures = {p: engine.pull(p_addrs[p], part_uuid(uuid, d_process), specs[p], timeout_s,
                              room=room) for p in groups}
    out: cf.Future = cf.Future()
    lock = threading.Lock()

    def settle(_f: cf.Future) -> None:
        with lock:
            if out.done():
                return
            for p, f in futures.items():
                if f.done() and (f.cancelled() or f.exception() is not None):
                    out.set_exception(f.exception() if not f.cancelled() else
                                      RuntimeError(f"the pull from P process {p} was "
                                                   "cancelled"))
                    return
            if not all(f.done() for f in futures.values()):
                return
            where = {i: (p, k) for p, idx in groups.items() for k, i in enumerate(idx)}
            got = {p: f.result() for p, f in futures.items()}
            out.set_result([got[where[i][0]][e * len(groups[where[i][0]]) + where[i][1]]
                            for e in range(num_entries) for i in range(len(mine))])

    for f in futures.values():
        f.add_done_callback(settle)
    return out
