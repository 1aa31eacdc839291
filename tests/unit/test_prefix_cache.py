"""PrefixCache + PageAllocator references: matching full pages only, adoption on insert,
duplicates left to their request, LRU eviction of unreferenced leaves only, flush, and the
consistency check catching a wrong reference."""

from __future__ import annotations

import pytest

from pdtopo.runtime.engine.page_allocator import PageAllocator
from pdtopo.runtime.engine.prefix_cache import PrefixCache

PS = 4


def seq(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def finished(cache: PrefixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """A request that computed `tokens` in fresh pages and finished: insert, then release."""
    pages = alloc.alloc(-(-len(tokens) // PS))
    cache.insert(tokens, pages, len(tokens))
    alloc.free(pages)
    return pages


def test_refcounts_free_a_page_only_when_its_last_holder_lets_go():
    a = PageAllocator(4)
    (p,) = a.alloc(1)
    a.incref([p])
    a.free([p])
    assert a.refcount(p) == 1 and a.num_free == 2
    a.free([p])
    assert a.refcount(p) == 0 and a.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        a.incref([p])


def test_only_full_pages_are_cached_and_matched():
    a = PageAllocator(16)
    c = PrefixCache(a, PS)
    pages = finished(c, a, seq(10))           # 2 full pages + 2 tokens
    assert c.num_pages == 2 and a.num_used == 2
    assert c.match(seq(3), 10) == []          # less than a page: nothing
    got = c.match(seq(10), 10)
    assert got == pages[:2]
    assert [a.refcount(p) for p in got] == [2, 2]
    a.free(got)
    assert c.match(seq(12), 1) == pages[:1]   # max_pages bounds the match
    a.free(pages[:1])
    other = seq(8)
    other[5] = 99                              # differs inside page 2
    got = c.match(other, 10)
    assert got == pages[:1]
    a.free(got)
    assert c.problems([]) == []


def test_a_duplicate_prefix_stays_with_its_request_and_new_pages_are_adopted():
    a = PageAllocator(16)
    c = PrefixCache(a, PS)
    first = finished(c, a, seq(8))
    dup = a.alloc(3)                           # computed the same 8 tokens privately, then 4 more
    assert c.insert(seq(12), dup, 12) == 1     # only the third page is new
    assert c.problems([dup]) == []
    a.free(dup)
    assert a.refcount(dup[0]) == 0 and a.refcount(dup[1]) == 0  # duplicates went back
    assert c.match(seq(12), 3) == first + [dup[2]]


def test_eviction_is_lru_over_unreferenced_leaves_and_never_touches_held_pages():
    a = PageAllocator(32)
    c = PrefixCache(a, PS)
    old = finished(c, a, seq(8, base=100))
    new = finished(c, a, seq(8, base=200))
    held = c.match(seq(8, base=100), 2)        # a request holds the older branch
    assert c.evict(3) == 2                      # only the unreferenced branch can go
    assert c.num_pages == 2 and set(c.pages()) == set(old)
    assert all(a.refcount(p) == 0 for p in new)
    a.free(held)
    c.match(seq(8, base=100), 2)  # refresh and release: still LRU-ordered leaves first
    a.free(old)
    assert c.evict(1) == 1 and c.pages() == {old[0]}  # the leaf before its parent
    assert c.flush() == 1 and c.num_pages == 0 and a.num_free == a.num_total
    assert c.problems([]) == []


def test_evicting_a_leaf_exposes_its_parent_in_lru_order():
    a = PageAllocator(32)
    c = PrefixCache(a, PS)
    trunk = finished(c, a, seq(12))             # chain of 3 pages
    branch = finished(c, a, seq(4) + seq(4, base=50))  # reuses trunk[0], adds one page
    assert branch[0] != trunk[0] and c.num_pages == 4
    order = []
    for _ in range(4):
        before = c.pages()
        assert c.evict(1) == 1
        order += list(before - c.pages())
    # the oldest leaf, then its parent (now a leaf, older than the branch), then the branch's
    # leaf; the shared first page goes last, once it has no children
    assert order == [trunk[2], trunk[1], branch[1], trunk[0]]
    assert a.num_free == a.num_total


def test_problems_name_a_reference_nobody_accounts_for():
    a = PageAllocator(8)
    c = PrefixCache(a, PS)
    finished(c, a, seq(4))
    stray = a.alloc(1)
    assert c.problems([]) == [f"page {stray[0]}: 1 references in the allocator, "
                              f"0 holders (cache + requests)"]
    assert c.problems([stray]) == []
    (tree_page,) = c.pages()
    a.incref([tree_page])                        # a reference without a holder
    assert any(f"page {tree_page}: 2 references" in p for p in c.problems([stray]))
