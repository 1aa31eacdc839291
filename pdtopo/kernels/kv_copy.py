"""The KV copy entry points: pages gathered out of the pool into packed arrays and packed rows
scattered back into it, each call checked (checks.py, runs.validate_page_ids), then handed to
an implementation: the XLA programs (xla_copy.py) or the Pallas TPU kernel
(pallas_multi_layer_copy.py), by `impl`. The package's face (`pdtopo.kernels`) re-exports them.

Calls (pool format: docs/architecture.md, "KV pool format"):

- ``select_from_kv_caches(kv_caches, page_ids, padded=False)``: packed
  ``[rows, page_size, heads, head_dim]`` per pool entry, same order and sharding as the pool.
  A bucketed XLA gather (``xla_copy.gather_pages``): ``padded=True`` returns it as it is,
  ``bucket_size(n)`` rows with the n pages first (what P registers for D: no per-count
  program); ``padded=False`` slices it to exactly n rows.
- ``insert_rows(kv_caches, packed, row_pages)``: the new pool with packed row r written at page
  ``row_pages[r]`` of every entry, rows whose page is -1 skipped (XLA, every platform; the
  host KV tier's load-back, whose rows come back in any order and subset).
- ``insert_kv_chunks(kv_caches, packed, page_ids, impl="auto", interpret=None, first_row=0)``:
  the new pool with ``packed[i][first_row + j]`` written at page ``page_ids[j]`` of entry i;
  the pool buffers are donated (do not use ``kv_caches`` afterwards). Rows before
  ``first_row`` and after the last page are not written (pages D already holds, bucket
  padding). ``impl``: "xla" (jitted scatter), "pallas" (``pallas_multi_layer_copy``: async
  DMAs over merged page runs) or "auto" (Pallas on TPU, XLA elsewhere). ``interpret``: run
  the Pallas kernel in TPU interpret mode; None = on for non-TPU backends.
- ``insert_kv_pieces(kv_caches, slots, page_ids, offsets, first_row=0)``: a reshard's pieces
  written into head ranges of the pool (XLA, every platform).

The calls accept ``page_ids`` as a list / NumPy / JAX array of ints and validate it.
Compilation: the executables are keyed on power-of-two buckets of the row count, so request
lengths in one bucket share them. Packed arrays of bucket length (what ``padded=True`` gives,
and what the PD transfer moves) need nothing else; exact-length ones cost a tiny glue
executable per distinct length (the slice after the gather, the zero-padding before the
scatter).
"""

from __future__ import annotations

import jax
import numpy as np

from pdtopo.kernels import pallas_multi_layer_copy, xla_copy
from pdtopo.kernels import runs as _runs
from pdtopo.kernels.checks import check_packed, check_pool, pool_shardings
from pdtopo.kernels.runs import bucket_size

IMPLS = ("auto", "pallas", "xla")


def select_from_kv_caches(kv_caches, page_ids, padded: bool = False) -> list[jax.Array]:
    """Gather pages ``page_ids`` of every pool entry into packed arrays: ``[n, ...]``, or with
    ``padded`` ``[bucket_size(n), ...]`` (the n pages first, then copies of page 0)."""
    pool = check_pool(kv_caches)
    ids = _runs.validate_page_ids(page_ids, pool[0].shape[0])
    n = len(ids)
    bucket = bucket_size(n)
    shardings = pool_shardings(pool)
    gathered = xla_copy.gather_pages(pool, _runs.pad_ids(ids, bucket, 0), shardings=shardings)
    if padded or n == bucket:
        return list(gathered)
    return list(xla_copy.take_leading(gathered, n, shardings=shardings))


def _resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "xla"
    return impl


def insert_kv_chunks(kv_caches, packed, page_ids, impl: str = "auto",
                     interpret=None, first_row: int = 0) -> list[jax.Array]:
    """Write packed rows ``first_row, first_row + 1, ...`` into the pool at ``page_ids``;
    returns the new pool (input donated)."""
    pool = check_pool(kv_caches)
    impl = _resolve_impl(impl)
    ids = _runs.validate_page_ids(page_ids, pool[0].shape[0], unique=True)
    n = len(ids)
    first_row = int(first_row)
    if first_row < 0:
        raise ValueError(f"first_row must be >= 0, got {first_row}")
    packed = check_packed(pool, packed, n, first_row)
    if n == 0:
        return list(pool)
    bucket = bucket_size(first_row + n)
    shardings = pool_shardings(pool)
    packed = _placed(pool, packed, bucket, shardings)
    if impl == "xla":
        out = xla_copy.scatter_pages(pool, packed, _row_targets(ids, first_row, bucket,
                                                                pool[0].shape[0]),
                                     shardings=shardings)
        return list(out)
    return list(pallas_multi_layer_copy.multi_layer_copy(pool, packed, ids, interpret=interpret,
                                                         first_row=first_row))


def _placed(pool: tuple, packed: tuple, bucket: int, shardings) -> tuple:
    """Packed arrays where the pool lives (same devices, same head sharding), padded to
    ``bucket`` rows."""
    packed = tuple(
        p if isinstance(p, jax.Array) and p.sharding == kv.sharding else jax.device_put(p, kv.sharding)
        for p, kv in zip(packed, pool, strict=True))
    if packed[0].shape[0] != bucket:
        packed = xla_copy.pad_leading(packed, bucket, shardings=shardings)
    return packed


def insert_rows(kv_caches, packed, row_pages) -> list[jax.Array]:
    """Write packed row r at page ``row_pages[r]`` of every pool entry (-1: skip the row);
    returns the new pool (input donated)."""
    pool = check_pool(kv_caches)
    num_pages = pool[0].shape[0]
    pages = np.asarray(row_pages)
    wanted = pages[pages != -1] if pages.ndim == 1 else pages
    _runs.validate_page_ids(wanted, num_pages, name="row_pages", unique=True)
    rows = len(pages)
    packed = check_packed(pool, packed, rows)
    if not wanted.size:
        return list(pool)
    bucket = bucket_size(rows)
    shardings = pool_shardings(pool)
    targets = np.full((bucket,), num_pages, np.int32)
    targets[:rows] = np.where(pages == -1, num_pages, pages)
    return list(xla_copy.scatter_pages(pool, _placed(pool, packed, bucket, shardings), targets,
                                       shardings=shardings))


def _row_targets(ids: np.ndarray, first_row: int, rows: int, num_pages: int) -> np.ndarray:
    """The pool page of every packed row: ``ids`` from ``first_row`` on, ``num_pages`` (one
    past the pool: the scatter drops it) for the rows before and after them."""
    out = np.full((rows,), num_pages, np.int32)
    out[first_row:first_row + len(ids)] = ids
    return out


def insert_kv_pieces(kv_caches, slots, page_ids, offsets, first_row: int = 0
                     ) -> list[jax.Array]:
    """Write a reshard's piece slots into head ranges of the pool at ``page_ids`` (XLA, every
    platform): row ``first_row + j`` of every piece goes to page ``page_ids[j]``, other rows
    (pages D already holds, bucket padding) are not written. Returns the new pool (input
    donated). ``slots[i]`` holds entry i's pieces, each sharded like the pool with the same
    heads per device; ``offsets[k]`` is slot k's first local head on every device."""
    pool = check_pool(kv_caches)
    ids = _runs.validate_page_ids(page_ids, pool[0].shape[0], unique=True)
    shardings = pool_shardings(pool)
    if shardings is None:
        raise ValueError("insert_kv_pieces needs a pool with a NamedSharding")
    if len(slots) != len(pool) or any(len(e) != len(offsets) for e in slots):
        raise ValueError(f"slots must hold {len(offsets)} pieces for each of {len(pool)} "
                         "entries")
    rows = slots[0][0].shape[0] if slots and slots[0] else 0
    for entry in slots:
        for pc in entry:
            if pc.shape[0] != rows or rows < first_row + len(ids) or \
                    pc.shape[1] != pool[0].shape[1] or pc.shape[3] != pool[0].shape[3]:
                raise ValueError(f"piece shape {pc.shape} does not fit {len(ids)} pages "
                                 f"after {first_row} skipped rows of the pool {pool[0].shape}")
    if len(ids) == 0:
        return list(pool)
    return list(xla_copy.scatter_piece_pages(
        pool, tuple(tuple(e) for e in slots),
        _row_targets(ids, int(first_row), rows, pool[0].shape[0]),
        tuple(int(o) for o in offsets), shardings[0]))
