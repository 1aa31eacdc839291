"""KV gather/scatter kernels: XLA and Pallas (TPU interpret mode) against a NumPy reference.

Shapes are tiny on purpose: interpret mode emulates every DMA in Python.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdtopo.kernels import (
    bucket_size,
    insert_kv_chunks,
    pallas_multi_layer_copy,
    select_from_kv_caches,
    xla_copy,
)

NUM_PAGES, PAGE, HEADS, HEAD_DIM = 16, 4, 4, 8


def _rand(rng, shape, dtype):
    return np.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _sharding(ndev: int):
    if ndev == 1:
        return None
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("tp",))
    return NamedSharding(mesh, P(None, None, "tp", None))


def _put(arrays, sharding):
    if sharding is None:
        return [jnp.asarray(a) for a in arrays]
    return [jax.device_put(a, sharding) for a in arrays]


def _pool(rng, num_entries=4, dtype=jnp.float32, num_pages=NUM_PAGES, heads=HEADS):
    return [_rand(rng, (num_pages, PAGE, heads, HEAD_DIM), dtype) for _ in range(num_entries)]


def _np_scatter(ref_pool, packed, ids):
    out = [p.copy() for p in ref_pool]
    for o, pk in zip(out, packed, strict=True):
        o[np.asarray(ids)] = pk
    return out


def _assert_pool(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), w)


SCATTER_CASES = {
    "contiguous": [4, 5, 6, 7, 8, 9, 10, 11],
    "scattered": [9, 2, 14, 5, 6, 1],
    "single_page": [7],
    "full_pool": list(range(NUM_PAGES)),
    "full_pool_permuted": [int(i) for i in np.random.default_rng(7).permutation(NUM_PAGES)],
    "padded_runs": [3, 4, 5, 12, 13],  # 2 runs in a chunk bucket of 8
}


@pytest.mark.parametrize("case", list(SCATTER_CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_equals_xla_and_numpy(case, dtype):
    ids = SCATTER_CASES[case]
    rng = np.random.default_rng(len(ids))
    ref = _pool(rng, num_entries=6, dtype=dtype)  # 3 layers
    packed = [_rand(rng, (len(ids), PAGE, HEADS, HEAD_DIM), dtype) for _ in ref]
    want = _np_scatter(ref, packed, ids)
    got_xla = insert_kv_chunks(_put(ref, None), _put(packed, None), ids, impl="xla")
    got_pallas = insert_kv_chunks(_put(ref, None), _put(packed, None), ids, impl="pallas")
    _assert_pool(got_xla, want)
    _assert_pool(got_pallas, want)


@pytest.mark.parametrize("ndev", [2, 4])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_sharded_pool_scatter(ndev, impl):
    sharding = _sharding(ndev)
    rng = np.random.default_rng(ndev)
    ids = [11, 12, 13, 2, 6]
    ref = _pool(rng, num_entries=4)
    packed = [_rand(rng, (len(ids), PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
    pool = _put(ref, sharding)
    got = insert_kv_chunks(pool, _put(packed, sharding), ids, impl=impl)
    _assert_pool(got, _np_scatter(ref, packed, ids))
    assert all(g.sharding == sharding for g in got)
    assert all(p.is_deleted() for p in pool)  # donated


def test_long_runs_split_into_several_dma_chunks(monkeypatch):
    monkeypatch.setattr(pallas_multi_layer_copy, "MAX_CHUNK_PAGES", 2)
    rng = np.random.default_rng(3)
    ids = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12]  # runs of 7 and 4 -> chunks of 2,2,2,1,2,2
    ref = _pool(rng, num_entries=2)
    packed = [_rand(rng, (len(ids), PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
    got = insert_kv_chunks(_put(ref, None), _put(packed, None), ids, impl="pallas")
    _assert_pool(got, _np_scatter(ref, packed, ids))


def test_odd_entry_count_and_bucket_length_packed():
    rng = np.random.default_rng(5)
    ids = [8, 3, 4]
    ref = _pool(rng, num_entries=3)
    packed = [_rand(rng, (len(ids), PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
    # packed already of bucket length: real pages first, the rest is ignored
    bucket = bucket_size(len(ids))
    padded = [np.concatenate([p, np.full((bucket - len(ids),) + p.shape[1:], 99, p.dtype)])
              for p in packed]
    for impl in ("pallas", "xla"):
        got = insert_kv_chunks(_put(ref, None), _put(padded, None), ids, impl=impl)
        _assert_pool(got, _np_scatter(ref, packed, ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("ndev", [1, 2])
def test_gather_equals_numpy_and_keeps_sharding(dtype, ndev):
    sharding = _sharding(ndev)
    rng = np.random.default_rng(11)
    ref = _pool(rng, num_entries=4, dtype=dtype)
    pool = _put(ref, sharding)
    for ids in ([3], [5, 1, 9], [2, 2, 7], list(range(NUM_PAGES)), np.array([15, 0, 4])):
        got = select_from_kv_caches(pool, ids)
        assert len(got) == len(ref)
        for g, r in zip(got, ref, strict=True):
            assert g.shape == (len(ids), PAGE, HEADS, HEAD_DIM)
            assert g.dtype == r.dtype
            np.testing.assert_array_equal(np.asarray(g), r[np.asarray(ids)])
            if sharding is not None:
                assert g.sharding == sharding
    assert not any(p.is_deleted() for p in pool)  # gather does not consume the pool


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gather_then_scatter_round_trips(impl, dtype):
    rng = np.random.default_rng(13)
    src_ref = _pool(rng, num_entries=4, dtype=dtype)
    dst_ref = _pool(rng, num_entries=4, dtype=dtype)
    src_ids, dst_ids = [4, 5, 6, 10, 1], [12, 13, 2, 3, 9]
    packed = select_from_kv_caches(_put(src_ref, None), src_ids)
    new = insert_kv_chunks(_put(dst_ref, None), packed, dst_ids, impl=impl)
    want = [d.copy() for d in dst_ref]
    for w, s in zip(want, src_ref, strict=True):
        w[dst_ids] = s[src_ids]
    _assert_pool(new, want)
    back = select_from_kv_caches(new, dst_ids)
    for b, s in zip(back, src_ref, strict=True):
        np.testing.assert_array_equal(np.asarray(b), s[src_ids])


def test_same_bucket_lengths_do_not_retrace():
    # A page size no other test uses, so the first call of each function traces exactly once.
    rng = np.random.default_rng(17)
    ref = [_rand(rng, (NUM_PAGES, 3, 2, 8), np.float32) for _ in range(2)]
    pool = _put(ref, None)
    g, x, p = (xla_copy.TRACE_COUNTS, xla_copy.TRACE_COUNTS,
               pallas_multi_layer_copy.TRACE_COUNTS)
    deltas = []
    for n, first in ((5, 1), (7, 0), (6, 0)):  # all in bucket 8
        before = (g["gather"], x["scatter"], p["multi_layer_copy"])
        packed = select_from_kv_caches(pool, list(range(1, n + 1)))
        pool = insert_kv_chunks(pool, packed, list(range(9, 9 + n)), impl="xla")
        pool = insert_kv_chunks(pool, packed, list(range(8, 8 + n))[::-1], impl="pallas")
        after = (g["gather"], x["scatter"], p["multi_layer_copy"])
        deltas.append(tuple(a - b for a, b in zip(after, before, strict=True)))
        assert deltas[-1] == (first, first, first), deltas
    # a length in the next bucket compiles new bucketed executables
    before = g["gather"]
    select_from_kv_caches(pool, list(range(1, 10)))
    assert g["gather"] == before + 1


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(19)
    ref = _pool(rng, num_entries=2)
    pool = _put(ref, None)
    packed = [jnp.zeros((2, PAGE, HEADS, HEAD_DIM), jnp.float32)] * 2
    with pytest.raises(ValueError, match=r"page id 16 outside the pool \[0, 16\)"):
        select_from_kv_caches(pool, [1, 16])
    with pytest.raises(ValueError, match="impl must be one of"):
        insert_kv_chunks(pool, packed, [1, 2], impl="cuda")
    with pytest.raises(ValueError, match="page id 3 more than once"):
        insert_kv_chunks(pool, packed, [3, 3])
    with pytest.raises(ValueError, match="packed arrays have 2 pages but page_ids names 3"):
        insert_kv_chunks(pool, packed, [1, 2, 3])
    with pytest.raises(ValueError, match="packed has 1 entries; the pool has 2"):
        insert_kv_chunks(pool, packed[:1], [1, 2])
    with pytest.raises(ValueError, match=r"packed\[1\] has shape \(2, 4, 2, 8\)"):
        insert_kv_chunks(pool, [packed[0], jnp.zeros((2, PAGE, 2, HEAD_DIM))], [1, 2])
    with pytest.raises(ValueError, match=r"packed\[0\] has dtype bfloat16; the pool holds float32"):
        insert_kv_chunks(pool, [p.astype(jnp.bfloat16) for p in packed], [1, 2])
    with pytest.raises(ValueError, match="interpret must be None, a bool or"):
        insert_kv_chunks(pool, packed, [1, 2], impl="pallas", interpret="yes")
    with pytest.raises(ValueError, match="kv_caches must be a list"):
        select_from_kv_caches(pool[0], [1])
    with pytest.raises(ValueError, match=r"kv_caches\[1\] has shape"):
        select_from_kv_caches([pool[0], pool[1][:4]], [1])
    # nothing above consumed the pool
    _assert_pool(pool, ref)
    assert insert_kv_chunks(pool, [p[:0] for p in packed], []) == pool


def test_explicit_interpret_params_and_numpy_packed():
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(23)
    ids = [6, 7, 1]
    ref = _pool(rng, num_entries=2)
    packed = [_rand(rng, (len(ids), PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
    got = insert_kv_chunks(_put(ref, None), packed, np.asarray(ids), impl="pallas",
                           interpret=pltpu.InterpretParams(dma_execution_mode="eager"))
    _assert_pool(got, _np_scatter(ref, packed, ids))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_packed_on_other_devices_is_moved_to_the_pool_sharding(impl):
    sharding = _sharding(2)
    rng = np.random.default_rng(29)
    ref = _pool(rng, num_entries=2)
    for ids in ([2, 3, 4], list(range(5, 13))):  # padded and exact-bucket lengths
        packed = [_rand(rng, (len(ids), PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
        on_dev3 = [jax.device_put(p, jax.devices()[3]) for p in packed]
        got = insert_kv_chunks(_put(ref, sharding), on_dev3, ids, impl=impl)
        _assert_pool(got, _np_scatter(ref, packed, ids))
        assert all(g.sharding == sharding for g in got)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_throughput_helper_runs_on_tiny_pool(impl):
    from pdtopo.kernels.bench import measure_kernel_throughput

    r = measure_kernel_throughput(num_entries=2, entry_mb=1, num_pages=3, page_size=4,
                                  kv_heads=2, head_dim=8, dtype=jnp.float32, impl=impl,
                                  repeats=1)
    assert r["bytes_moved"] == 2 * 3 * 4 * 2 * 8 * 4
    assert r["impl"] == impl
    for key in ("scatter", "gather", "numpy_memcpy", "numpy_fancy_scatter"):
        assert r[f"{key}_s"] > 0 and r[f"{key}_gbps"] >= 0


@pytest.mark.parametrize("ndev", [1, 2])
def test_padded_gather_gives_the_bucket_with_the_pages_first(ndev):
    """What P registers for D: bucket rows, the pages first; every count of a bucket runs the
    one gather program and no per-count slice."""
    sharding = _sharding(ndev)
    rng = np.random.default_rng(13)
    ref = _pool(rng, num_entries=4)
    pool = _put(ref, sharding)
    before = dict(xla_copy.TRACE_COUNTS)
    for ids in ([9, 3, 4], [1, 2, 3, 4, 5, 6, 7], [12]):
        got = select_from_kv_caches(pool, ids, padded=True)
        for g, r in zip(got, ref, strict=True):
            assert g.shape == (bucket_size(len(ids)), PAGE, HEADS, HEAD_DIM)
            np.testing.assert_array_equal(np.asarray(g)[:len(ids)], r[np.asarray(ids)])
            if sharding is not None:
                assert g.sharding == sharding
    assert xla_copy.TRACE_COUNTS["take_leading"] == before.get("take_leading", 0)
    assert xla_copy.TRACE_COUNTS["gather"] - before.get("gather", 0) <= 1


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("first_row", [0, 2, 5])
def test_scatter_from_a_later_row_writes_only_the_named_pages(impl, first_row):
    """D drops the leading pages its prefix cache holds by starting at `first_row` of the
    pulled bucket: the rows before it and the padding after the pages touch nothing."""
    rng = np.random.default_rng(17 + first_row)
    ids = [6, 7, 8, 2, 11][: 8 - first_row]
    bucket = bucket_size(first_row + len(ids))
    ref = _pool(rng, num_entries=3)
    packed = [_rand(rng, (bucket, PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
    want = _np_scatter(ref, [p[first_row:first_row + len(ids)] for p in packed], ids)
    got = insert_kv_chunks(_put(ref, None), _put(packed, None), ids, impl=impl,
                           first_row=first_row)
    _assert_pool(got, want)


def test_scatter_refuses_rows_that_do_not_fit_first_row():
    rng = np.random.default_rng(19)
    ref = _pool(rng, num_entries=2)
    packed = [_rand(rng, (32, PAGE, HEADS, HEAD_DIM), np.float32) for _ in ref]
    with pytest.raises(ValueError, match="after 7 skipped rows"):  # 7 + 2 rows: 9 or 16
        insert_kv_chunks(_put(ref, None), _put(packed, None), [1, 2], impl="xla", first_row=7)
    with pytest.raises(ValueError, match="first_row must be >= 0"):
        insert_kv_chunks(_put(ref, None), _put(packed, None), [1], impl="xla", first_row=-1)
