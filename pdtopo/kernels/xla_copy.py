"""XLA gather/scatter of KV pages over all layer entries of a pool (bucketed, jit-cached).

Gather:  kv_caches[i][ids_padded] for every entry i, one jitted call per GROUP entries (so the
         compile time does not grow with the model's depth); ids are padded to a
         power-of-two bucket with page 0 (a valid page whose rows are then dropped), so all
         request lengths of a bucket share one executable. The caller slices the result to n
         (``take_leading``), a separate tiny jitted slice.
Scatter: kv_caches[i].at[ids_padded].set(packed_padded[i], mode="drop") with the pool donated;
         padding ids point one past the pool (``num_pages``) so padded rows are dropped and no
         real page is touched.

Pieces:  `scatter_piece_pages` writes a reshard's pieces straight into head ranges of the
         pool (per device, under shard_map: every device writes its own pieces at the same
         local head offsets), skipping the join of the pieces into packed arrays; one executable
         per row count (the pieces are written as pulled; rows whose id is past the pool are
         dropped).

Sharding: the pool's sharding (e.g. heads over "tp") is passed as a static argument and
imposed on the results with ``with_sharding_constraint``, so packed arrays come out sharded
like the pool and the scattered pool keeps its layout.

``TRACE_COUNTS`` counts Python traces of each jitted function (tests use it to prove that
lengths inside one bucket do not retrace).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np

TRACE_COUNTS: collections.Counter = collections.Counter()


def _constrain(xs, shardings):
    if shardings is None:
        return xs
    return tuple(jax.lax.with_sharding_constraint(x, s) for x, s in zip(xs, shardings, strict=True))


# Pool entries per compiled gather / scatter: a program's compile time grows with the arrays it
# takes, so a deep model's pool (2 entries per layer) is copied by a few calls of one program of
# GROUP entries (and one for the rest) instead of one program of every entry. 8 entries (4
# layers): a 30-layer pool's scatter of 16 pages compiles in about 0.2 s instead of 0.6 s per
# bucket, and costs 8 dispatches instead of 1 (1.25 ms instead of 0.9 ms on the CPU here).
GROUP = 8


def _groups(n: int) -> list[slice]:
    return [slice(i, min(i + GROUP, n)) for i in range(0, n, GROUP)]


def _part(shardings, g: slice):
    return None if shardings is None else shardings[g]


def gather_pages(kv_caches: tuple, ids, shardings=None) -> tuple:
    """Packed ``[B, page_size, heads, head_dim]`` per entry, B = len(ids)."""
    ids = np.asarray(ids, np.int32)  # host ids: placed like the pool by each call
    return tuple(x for g in _groups(len(kv_caches))
                 for x in _gather_group(kv_caches[g], ids, shardings=_part(shardings, g)))


def scatter_pages(kv_caches: tuple, packed: tuple, ids, shardings=None) -> tuple:
    """Pool entries with ``packed[i][j]`` written at page ``ids[j]`` (out-of-range ids dropped);
    the pool entries are donated."""
    ids = np.asarray(ids, np.int32)  # host ids: placed like the pool by each call
    return tuple(x for g in _groups(len(kv_caches))
                 for x in _scatter_group(kv_caches[g], packed[g], ids,
                                         shardings=_part(shardings, g)))


@functools.partial(jax.jit, static_argnames=("shardings",))
def _gather_group(kv_caches: tuple, ids, shardings=None) -> tuple:
    TRACE_COUNTS["gather"] += 1
    return _constrain(tuple(jnp.take(kv, ids, axis=0) for kv in kv_caches), shardings)


@functools.partial(jax.jit, static_argnames=("shardings",), donate_argnums=(0,))
def _scatter_group(kv_caches: tuple, packed: tuple, ids, shardings=None) -> tuple:
    TRACE_COUNTS["scatter"] += 1
    out = tuple(kv.at[ids].set(p.astype(kv.dtype), mode="drop")
                for kv, p in zip(kv_caches, packed, strict=True))
    return _constrain(out, shardings)


@functools.partial(jax.jit, static_argnames=("n", "shardings"))
def take_leading(xs: tuple, n: int, shardings=None) -> tuple:
    """The first ``n`` rows of every array (glue: one tiny executable per distinct n)."""
    TRACE_COUNTS["take_leading"] += 1
    return _constrain(tuple(x[:n] for x in xs), shardings)


@functools.partial(jax.jit, static_argnames=("bucket", "shardings"))
def pad_leading(xs: tuple, bucket: int, shardings=None) -> tuple:
    """Every array zero-padded along axis 0 to ``bucket`` rows (glue, per distinct n)."""
    TRACE_COUNTS["pad_leading"] += 1
    out = tuple(jnp.pad(x, [(0, bucket - x.shape[0])] + [(0, 0)] * (x.ndim - 1)) for x in xs)
    return _constrain(out, shardings)


@functools.partial(jax.jit, static_argnames=("offsets", "sharding"), donate_argnums=(0,))
def scatter_piece_pages(kv_caches: tuple, slots: tuple, ids, offsets: tuple, sharding) -> tuple:
    """Pool entries with piece slot k of entry i written at local heads
    ``[offsets[k], offsets[k] + heads_k)`` of pages ``ids`` (one per row; out-of-range ids
    dropped) on every device of the pool's mesh. ``slots[i][k]`` is sharded like the pool (heads_k per device)."""
    TRACE_COUNTS["scatter_pieces"] += 1
    spec = sharding.spec

    def local(kvs, pieces, ids):
        out = []
        for kv, entry in zip(kvs, pieces, strict=True):
            for off, pc in zip(offsets, entry, strict=True):
                kv = kv.at[ids, :, off:off + pc.shape[2]].set(pc.astype(kv.dtype), mode="drop")
            out.append(kv)
        return tuple(out)

    return jax.shard_map(local, mesh=sharding.mesh, in_specs=(spec, spec, jax.sharding.PartitionSpec()),
                         out_specs=spec)(kv_caches, slots, ids)
