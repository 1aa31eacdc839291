"""KV page gather/scatter kernels (Pallas TPU multi_layer_copy and an XLA implementation).

Public API (pool format: docs/architecture.md, "KV pool format"):

- ``select_from_kv_caches(kv_caches, page_ids)``: packed ``[n, page_size, heads, head_dim]``
  per pool entry, same order and sharding as the pool. Bucketed XLA gather
  (``xla_copy.gather_pages``) followed by a slice to exactly n rows.
- ``insert_kv_chunks(kv_caches, packed, page_ids, impl="auto", interpret=None)``: the new pool
  with ``packed[i][j]`` written at page ``page_ids[j]`` of entry i; the pool buffers are
  donated (do not use ``kv_caches`` afterwards). ``impl``: "xla" (jitted scatter), "pallas"
  (``pallas_multi_layer_copy``: async DMAs over merged page runs) or "auto" (Pallas on TPU,
  XLA elsewhere). ``interpret``: run the Pallas kernel in TPU interpret mode; None = on for
  non-TPU backends.

Both calls accept ``page_ids`` as a list / NumPy / JAX array of ints and validate it.
Compilation: the heavy executables are keyed on power-of-two buckets of n, so request lengths
in one bucket share them; exact-n glue (slice of the gathered pages, zero-padding of packed
pages whose length is not already a bucket) is a separate tiny executable per n. A caller that
already holds packed arrays of bucket length (``runs.bucket_size(n)`` rows, real pages first)
avoids the padding copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from pdtopo.kernels import pallas_multi_layer_copy, xla_copy
from pdtopo.kernels import runs as _runs
from pdtopo.kernels.runs import bucket_size

__all__ = ["select_from_kv_caches", "insert_kv_chunks", "bucket_size", "IMPLS"]

IMPLS = ("auto", "pallas", "xla")


def _check_pool(kv_caches) -> tuple:
    if isinstance(kv_caches, jax.Array) or not isinstance(kv_caches, Sequence):
        raise ValueError("kv_caches must be a list of [num_pages, page_size, heads, head_dim] "
                         f"arrays, got {type(kv_caches).__name__}")
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty")
    first = kv_caches[0]
    if getattr(first, "ndim", None) != 4:
        raise ValueError("kv_caches[0] must be [num_pages, page_size, heads, head_dim], "
                         f"got shape {getattr(first, 'shape', None)}")
    for i, kv in enumerate(kv_caches):
        if kv.shape != first.shape or kv.dtype != first.dtype:
            raise ValueError(f"kv_caches[{i}] has shape {kv.shape} dtype {kv.dtype}; "
                             f"expected {first.shape} {first.dtype} like kv_caches[0]")
    return tuple(kv_caches)


def _pool_shardings(kv_caches: tuple):
    shardings = tuple(kv.sharding for kv in kv_caches)
    if all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return shardings
    return None


def select_from_kv_caches(kv_caches, page_ids) -> list[jax.Array]:
    """Gather pages ``page_ids`` of every pool entry into packed ``[n, ...]`` arrays."""
    pool = _check_pool(kv_caches)
    ids = _runs.validate_page_ids(page_ids, pool[0].shape[0])
    n = len(ids)
    bucket = bucket_size(n)
    shardings = _pool_shardings(pool)
    padded = xla_copy.gather_pages(pool, _runs.pad_ids(ids, bucket, 0), shardings=shardings)
    if n == bucket:
        return list(padded)
    return list(xla_copy.take_leading(padded, n, shardings=shardings))


def _resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "xla"
    return impl


def _check_packed(pool: tuple, packed, n: int) -> tuple:
    if isinstance(packed, jax.Array) or not isinstance(packed, Sequence):
        raise ValueError(f"packed must be a list of arrays, got {type(packed).__name__}")
    if len(packed) != len(pool):
        raise ValueError(f"packed has {len(packed)} entries; the pool has {len(pool)}")
    want_tail = pool[0].shape[1:]
    rows = None
    for i, p in enumerate(packed):
        shape = tuple(np.shape(p))
        if len(shape) != 4 or shape[1:] != want_tail:
            raise ValueError(f"packed[{i}] has shape {shape}; expected [n, {', '.join(map(str, want_tail))}]")
        dtype = np.dtype(getattr(p, "dtype", None))
        if dtype != pool[0].dtype:
            raise ValueError(f"packed[{i}] has dtype {dtype}; the pool holds {pool[0].dtype}")
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            raise ValueError(f"packed[{i}] has {shape[0]} pages; packed[0] has {rows}")
    if rows != n and rows != bucket_size(n):
        raise ValueError(f"packed arrays have {rows} pages but page_ids names {n} pages "
                         f"(allowed: {n}, or the bucket size {bucket_size(n)})")
    return tuple(packed)


def insert_kv_chunks(kv_caches, packed, page_ids, impl: str = "auto",
                     interpret=None) -> list[jax.Array]:
    """Write packed pages into the pool at ``page_ids``; returns the new pool (input donated)."""
    pool = _check_pool(kv_caches)
    impl = _resolve_impl(impl)
    ids = _runs.validate_page_ids(page_ids, pool[0].shape[0], unique=True)
    n = len(ids)
    packed = _check_packed(pool, packed, n)
    if n == 0:
        return list(pool)
    bucket = bucket_size(n)
    shardings = _pool_shardings(pool)
    # packed pages live where the pool lives (same devices, same head sharding)
    packed = tuple(
        p if isinstance(p, jax.Array) and p.sharding == kv.sharding else jax.device_put(p, kv.sharding)
        for p, kv in zip(packed, pool, strict=True))
    if packed[0].shape[0] != bucket:
        packed = xla_copy.pad_leading(packed, bucket, shardings=shardings)
    if impl == "xla":
        num_pages = pool[0].shape[0]
        out = xla_copy.scatter_pages(pool, packed, _runs.pad_ids(ids, bucket, num_pages),
                                     shardings=shardings)
        return list(out)
    return list(pallas_multi_layer_copy.multi_layer_copy(pool, packed, ids, interpret=interpret))


def insert_kv_pieces(kv_caches, slots, page_ids, offsets) -> list[jax.Array]:
    """Write a reshard's piece slots into head ranges of the pool at ``page_ids`` (XLA, every
    platform); returns the new pool (input donated). ``slots[i]`` holds entry i's pieces, each
    sharded like the pool with the same heads per device; ``offsets[k]`` is slot k's first
    local head on every device."""
    pool = _check_pool(kv_caches)
    ids = _runs.validate_page_ids(page_ids, pool[0].shape[0], unique=True)
    shardings = _pool_shardings(pool)
    if shardings is None:
        raise ValueError("insert_kv_pieces needs a pool with a NamedSharding")
    if len(slots) != len(pool) or any(len(e) != len(offsets) for e in slots):
        raise ValueError(f"slots must hold {len(offsets)} pieces for each of {len(pool)} "
                         "entries")
    for entry in slots:
        for pc in entry:
            if pc.shape[0] != len(ids) or pc.shape[1] != pool[0].shape[1] or \
                    pc.shape[3] != pool[0].shape[3]:
                raise ValueError(f"piece shape {pc.shape} does not fit {len(ids)} pages of "
                                 f"the pool {pool[0].shape}")
    if len(ids) == 0:
        return list(pool)
    return list(xla_copy.scatter_piece_pages(
        pool, tuple(tuple(e) for e in slots), np.asarray(ids, dtype=np.int32),
        tuple(int(o) for o in offsets), shardings[0]))
