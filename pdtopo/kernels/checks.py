"""Checks of what the KV copy entry points (kv_copy.py) are handed, before anything is traced:
the pool (a non-empty list of equal [num_pages, page_size, heads, head_dim] arrays) and packed
arrays (one per pool entry, the pool's page shape and dtype, as many rows as the pages named or
their bucket). Each raises ValueError naming the argument and what was wrong; page ids are
checked by runs.validate_page_ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from pdtopo.kernels.runs import bucket_size


def check_pool(kv_caches) -> tuple:
    """The pool as a tuple, once its entries are known to be equal 4-D arrays."""
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


def pool_shardings(kv_caches: tuple):
    """The pool entries' shardings when all are NamedShardings (the copies keep them), else
    None."""
    shardings = tuple(kv.sharding for kv in kv_caches)
    if all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return shardings
    return None


def check_packed(pool: tuple, packed, n: int, first_row: int = 0) -> tuple:
    """`packed` as a tuple, once it fits `pool` and `n` pages after `first_row` rows."""
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
    need = first_row + n
    if rows != need and rows != bucket_size(need):
        skipped = f" after {first_row} skipped rows" if first_row else ""
        raise ValueError(f"packed arrays have {rows} pages but page_ids names {n} pages"
                         f"{skipped} (allowed: {need}, or the bucket size "
                         f"{bucket_size(need)})")
    return tuple(packed)
