"""Host-side page bookkeeping of the KV kernels: validation, buckets, runs, DMA chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtopo.kernels import runs


def test_bucket_size_powers_of_two():
    assert runs.bucket_size(0) == runs.MIN_BUCKET
    assert runs.bucket_size(1) == 8
    assert runs.bucket_size(8) == 8
    assert runs.bucket_size(9) == 16
    assert runs.bucket_size(1000) == 1024
    assert runs.bucket_size(3, minimum=1) == 4
    with pytest.raises(ValueError, match="page count"):
        runs.bucket_size(-1)


def test_validate_page_ids_errors_name_the_field_and_value():
    assert runs.validate_page_ids([1, 2], 4).dtype == np.int32
    assert runs.validate_page_ids(np.array([], np.int64), 4).shape == (0,)
    with pytest.raises(ValueError, match=r"page_ids holds page id 4 outside the pool \[0, 4\)"):
        runs.validate_page_ids([1, 4], 4)
    with pytest.raises(ValueError, match="page id -1"):
        runs.validate_page_ids([-1], 4)
    with pytest.raises(ValueError, match="dst_ids must hold integers"):
        runs.validate_page_ids([1.5], 4, name="dst_ids")
    with pytest.raises(ValueError, match="1-D"):
        runs.validate_page_ids([[1]], 4)
    with pytest.raises(ValueError, match="page id 2 more than once"):
        runs.validate_page_ids([2, 3, 2], 4, unique=True)
    runs.validate_page_ids([2, 3, 2], 4)  # duplicates are fine for a gather


def test_page_runs_merges_consecutive_destinations():
    r = runs.page_runs(np.array([5, 6, 7, 2, 3, 9, 8]))
    assert r.src.tolist() == [0, 3, 5, 6]
    assert r.dst.tolist() == [5, 2, 9, 8]
    assert r.length.tolist() == [3, 2, 1, 1]
    assert len(runs.page_runs(np.array([], np.int32)).src) == 0


def test_dma_chunks_split_runs_into_powers_of_two():
    c = runs.dma_chunks(runs.Runs(np.array([0]), np.array([10]), np.array([11])), max_chunk=4)
    # 11 = 4 + 4 + 2 + 1
    assert c.src.tolist() == [0, 4, 8, 10]
    assert c.dst.tolist() == [10, 14, 18, 20]
    assert c.size_class.tolist() == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="max_chunk"):
        runs.dma_chunks(runs.page_runs(np.array([1])), max_chunk=3)


def test_pad_chunks_and_max_chunk_for():
    chunks = runs.dma_chunks(runs.page_runs(np.array([3, 4, 9])), max_chunk=8)
    padded, count = runs.pad_chunks(chunks, 8)
    assert count == 2 and len(padded.src) == 8
    assert padded.dst.tolist()[:2] == [3, 9] and padded.dst.tolist()[2:] == [0] * 6
    with pytest.raises(ValueError, match="do not fit"):
        runs.pad_chunks(chunks, 1)
    assert runs.max_chunk_for(8, 64) == 8
    assert runs.max_chunk_for(256, 64) == 64


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200), unique=True, max_size=80), st.sampled_from([1, 2, 8, 64]))
def test_chunks_cover_exactly_the_page_mapping(ids, max_chunk):
    ids = np.asarray(ids, np.int32)
    chunks = runs.dma_chunks(runs.page_runs(ids), max_chunk)
    mapping = {}
    for s, d, c in zip(chunks.src, chunks.dst, chunks.size_class, strict=True):
        assert 1 << c <= max_chunk
        for i in range(1 << int(c)):
            assert int(s) + i not in mapping
            mapping[int(s) + i] = int(d) + i
    assert mapping == {i: int(p) for i, p in enumerate(ids)}
    assert len(chunks.src) <= len(ids)  # so the page bucket always holds the chunk list
