"""Page-id bookkeeping for the KV copy kernels: validation, buckets, runs and DMA chunks.

Host-side (NumPy) only. Data flow for a scatter of ``n`` packed pages into pool pages
``page_ids``:

    page_ids --validate_page_ids--> int32[n]
             --bucket_size--------> B (power of two >= n): every array that reaches a jitted
                                    function has a bucketed length, so request lengths in the
                                    same bucket share one compiled executable
             --page_runs----------> runs (src offset in packed, dst page, length): consecutive
                                    destination pages merged
             --dma_chunks---------> chunks whose lengths are powers of two (a DMA needs a static
                                    size; the Pallas kernel picks one of a few static sizes)
             --pad_chunks---------> fixed-length chunk arrays + the real chunk count
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MIN_BUCKET = 8


def validate_page_ids(page_ids, num_pages: int, *, name: str = "page_ids",
                      unique: bool = False) -> np.ndarray:
    """``page_ids`` (list / NumPy / JAX array of ints) as a 1-D int32 NumPy array.

    Raises ValueError naming ``name`` and the offending value when the ids are not a 1-D
    sequence of integers in ``[0, num_pages)``, or (``unique=True``) contain a duplicate.
    """
    arr = np.asarray(page_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of page ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros((0,), np.int32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    bad = arr[(arr < 0) | (arr >= num_pages)]
    if bad.size:
        raise ValueError(
            f"{name} holds page id {int(bad[0])} outside the pool [0, {num_pages})")
    if unique:
        vals, counts = np.unique(arr, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"{name} holds page id {int(vals[counts > 1][0])} more than once "
                "(a scatter destination must be unique)")
    return arr.astype(np.int32)


def bucket_size(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two that is >= max(n, minimum)."""
    if n < 0:
        raise ValueError(f"page count must be >= 0, got {n}")
    b = max(int(minimum), 1)
    while b < n:
        b *= 2
    return b


def pad_ids(ids: np.ndarray, bucket: int, fill: int) -> np.ndarray:
    """``ids`` padded with ``fill`` to length ``bucket`` (int32)."""
    if len(ids) > bucket:
        raise ValueError(f"{len(ids)} page ids do not fit in bucket {bucket}")
    out = np.full((bucket,), fill, np.int32)
    out[: len(ids)] = ids
    return out


class Runs(NamedTuple):
    """Contiguous copies: packed[src[i] : src[i]+length[i]] -> pool[dst[i] : dst[i]+length[i]]."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray


def page_runs(dst_ids: np.ndarray) -> Runs:
    """Merge destination page ids into runs of consecutive pages (packed order kept)."""
    dst_ids = np.asarray(dst_ids, np.int64)
    n = len(dst_ids)
    if n == 0:
        empty = np.zeros((0,), np.int32)
        return Runs(empty, empty, empty)
    breaks = np.nonzero(np.diff(dst_ids) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [n]])
    return Runs(starts.astype(np.int32), dst_ids[starts].astype(np.int32),
                (ends - starts).astype(np.int32))


class Chunks(NamedTuple):
    """DMA chunks: packed[src:src+2**size_class] -> pool[dst:dst+2**size_class]."""

    src: np.ndarray
    dst: np.ndarray
    size_class: np.ndarray


def dma_chunks(runs: Runs, max_chunk: int) -> Chunks:
    """Split every run into power-of-two sized chunks of at most ``max_chunk`` pages.

    ``max_chunk`` must be a power of two. A run of length L becomes L // max_chunk full
    chunks plus one chunk per set bit of L % max_chunk (largest first).
    """
    if max_chunk < 1 or max_chunk & (max_chunk - 1):
        raise ValueError(f"max_chunk must be a power of two >= 1, got {max_chunk}")
    top = max_chunk.bit_length() - 1
    src, dst, cls = [], [], []
    for s, d, length in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        off = 0
        while length - off >= max_chunk:
            src.append(s + off)
            dst.append(d + off)
            cls.append(top)
            off += max_chunk
        rest = length - off
        for k in range(top - 1, -1, -1):
            if rest & (1 << k):
                src.append(s + off)
                dst.append(d + off)
                cls.append(k)
                off += 1 << k
    return Chunks(np.asarray(src, np.int32), np.asarray(dst, np.int32),
                  np.asarray(cls, np.int32))


def pad_chunks(chunks: Chunks, bucket: int) -> tuple[Chunks, int]:
    """Chunk arrays padded with zeros to length ``bucket``, and the real chunk count."""
    count = len(chunks.src)
    if count > bucket:
        raise ValueError(f"{count} DMA chunks do not fit in bucket {bucket}")
    return Chunks(*(pad_ids(a, bucket, 0) for a in chunks)), count


def max_chunk_for(bucket: int, cap: int) -> int:
    """Largest power-of-two chunk size usable with a packed bucket of ``bucket`` pages."""
    m = 1
    while m * 2 <= min(bucket, cap):
        m *= 2
    return m
