"""PageAllocator: page 0 reserved, all-or-nothing allocation, double-free detection."""

from __future__ import annotations

import pytest

from pdtopo.runtime.engine.page_allocator import OutOfPages, PageAllocator


def test_page_zero_is_never_handed_out():
    a = PageAllocator(8)
    assert a.num_total == 7 and a.num_free == 7
    pages = a.alloc(7)
    assert sorted(pages) == list(range(1, 8))
    assert a.num_free == 0 and a.num_used == 7


def test_alloc_is_all_or_nothing_and_free_returns_pages():
    a = PageAllocator(5)
    p = a.alloc(3)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free"):
        a.alloc(2)
    assert a.num_free == 1  # the failed call took nothing
    a.free(p[:2])
    assert a.num_free == 3 and a.can_alloc(3) and not a.can_alloc(4)
    a.free(p[2:])
    assert a.num_free == a.num_total


def test_double_free_and_foreign_pages_are_rejected():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p)
    with pytest.raises(ValueError):
        a.free([0])
    q = a.alloc(1)
    with pytest.raises(ValueError):
        a.free(q + q)
    assert a.num_free == 2  # rejected frees changed nothing


def test_invalid_sizes():
    with pytest.raises(ValueError, match="page 0 is reserved"):
        PageAllocator(1)
    a = PageAllocator(4)
    with pytest.raises(ValueError):
        a.alloc(-1)
    assert a.alloc(0) == []
