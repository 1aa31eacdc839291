"""Throughput of the KV page kernels against a NumPy memcpy of the same bytes.

``measure_kernel_throughput`` builds a pool of ``num_entries`` arrays of ``entry_mb`` MB each,
scatters (``insert_kv_chunks``) and gathers (``select_from_kv_caches``) ``num_pages`` scattered
pages per entry, and times a NumPy ``copyto`` of the same number of bytes (and a NumPy
fancy-index scatter into a pool of the same size) as the baseline. Compilation is excluded
(one warm-up call). Known CPU effect: XLA:CPU has no native bf16 scatter, so a bf16 scatter
converts the whole pool entry to f32 and back on every call (far below memcpy speed); f32 pools
scatter at about memcpy speed.
``python -m pdtopo.kernels.bench`` prints the result as JSON.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pdtopo.kernels import insert_kv_chunks, select_from_kv_caches


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_kernel_throughput(num_entries: int = 32, entry_mb: int = 16, num_pages: int = 64,
                              page_size: int = 16, kv_heads: int = 8, head_dim: int = 128,
                              dtype=jnp.bfloat16, impl: str = "xla", repeats: int = 5,
                              seed: int = 0) -> dict:
    """Seconds and GB/s of scatter, gather and the NumPy baselines for the same bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    page_bytes = page_size * kv_heads * head_dim * itemsize
    pool_pages = max(entry_mb * 2**20 // page_bytes, num_pages + 1)
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(np.arange(1, pool_pages), size=num_pages, replace=False))
    shape = (pool_pages, page_size, kv_heads, head_dim)
    pool = [jnp.zeros(shape, dtype) + i for i in range(num_entries)]
    packed = [jnp.full((num_pages,) + shape[1:], i, dtype) for i in range(num_entries)]
    moved = num_entries * num_pages * page_bytes

    state = {"pool": pool}

    def scatter():
        state["pool"] = insert_kv_chunks(state["pool"], packed, ids, impl=impl)
        jax.block_until_ready(state["pool"])

    def gather():
        jax.block_until_ready(select_from_kv_caches(state["pool"], ids))

    scatter()
    gather()
    t_scatter, t_gather = _best(scatter, repeats), _best(gather, repeats)
    for e in {0, num_entries - 1}:  # the timed calls really wrote the pages
        got = np.asarray(state["pool"][e][ids].astype(jnp.float32))
        if not (got == e).all():
            raise RuntimeError(f"scatter ({impl}) left wrong values in pool entry {e}")

    src = np.ones(moved // itemsize, np.uint16 if itemsize == 2 else np.float32)
    dst = np.empty_like(src)
    t_memcpy = _best(lambda: np.copyto(dst, src), repeats)
    np_pool = [np.zeros(shape, src.dtype) for _ in range(num_entries)]
    np_packed = [np.ones((num_pages,) + shape[1:], src.dtype) for _ in range(num_entries)]

    def np_scatter():
        for dst_entry, src_entry in zip(np_pool, np_packed, strict=True):
            dst_entry[ids] = src_entry

    t_np_scatter = _best(np_scatter, repeats)

    def gbps(t):
        return round(moved / t / 1e9, 2)

    return {
        "impl": impl, "backend": jax.default_backend(), "num_entries": num_entries,
        "pool_entry_mb": round(pool_pages * page_bytes / 2**20, 1), "pages": num_pages,
        "dtype": str(jnp.dtype(dtype)), "bytes_moved": moved,
        "scatter_s": t_scatter, "scatter_gbps": gbps(t_scatter),
        "gather_s": t_gather, "gather_gbps": gbps(t_gather),
        "numpy_memcpy_s": t_memcpy, "numpy_memcpy_gbps": gbps(t_memcpy),
        "numpy_fancy_scatter_s": t_np_scatter, "numpy_fancy_scatter_gbps": gbps(t_np_scatter),
    }


if __name__ == "__main__":
    print(json.dumps(measure_kernel_throughput(), indent=1))
