"""The prefix cache's host tier, with a fake tier over a fake pool (page -> the tokens whose KV it
holds): eviction copies device pages to the host before freeing them (device -> host -> gone),
a match loads host pages back into fresh device pages with the right bytes, the host tier's
bound drops copies of pages still on the device first, then its least recently used copies, a
request's insert gives a host-only node its device page back, flush empties both tiers, and a
random soak (requests holding pages, aborts, evictions both ways) keeps every page and every host
row accounted for."""

from __future__ import annotations

import random

import pytest

from pdtopo.runtime.engine.page_allocator import PageAllocator
from pdtopo.runtime.engine.prefix_cache import PrefixCache

PS = 4


class FakeHost:
    """A host tier of `capacity` rows whose 'bytes' are copies of the fake pool's entries."""

    def __init__(self, pool: dict[int, tuple], capacity: int):
        self.pool, self.capacity = pool, capacity
        self.rows: dict[int, tuple] = {}
        self.ids = iter(range(10**9))
        self.saved = self.loaded = 0

    def free_rows(self) -> int:
        return self.capacity - len(self.rows)

    def save(self, pages):
        assert len(pages) <= self.free_rows(), "the cache must make room first"
        refs = []
        for p in pages:
            ref = next(self.ids)
            self.rows[ref] = self.pool[p]
            refs.append(ref)
        self.saved += len(pages)
        return refs

    def load(self, refs, pages):
        for ref, p in zip(refs, pages, strict=True):
            self.pool[p] = self.rows[ref]
        self.loaded += len(pages)

    def drop(self, ref):
        del self.rows[ref]

    def live_refs(self):
        return set(self.rows)


def setup(num_pages: int, capacity: int):
    pool: dict[int, tuple] = {}
    alloc = PageAllocator(num_pages)
    host = FakeHost(pool, capacity)
    return alloc, PrefixCache(alloc, PS, host), host, pool


def finish(cache, alloc, pool, tokens) -> list[int]:
    """A request that computed `tokens` from scratch (fresh pages written) and finished."""
    pages = alloc.alloc(-(-len(tokens) // PS))
    for i, p in enumerate(pages):
        pool[p] = tuple(tokens[i * PS:(i + 1) * PS])
    cache.insert(tokens, pages, len(tokens))
    alloc.free(pages)
    return pages


def seq(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def check_pages_hold(pool, tokens, pages):
    for i, p in enumerate(pages):
        assert pool[p] == tuple(tokens[i * PS:(i + 1) * PS]), f"page {i} holds other KV"


def test_evicted_pages_go_to_host_and_a_match_loads_them_back_with_their_bytes():
    alloc, cache, host, pool = setup(num_pages=9, capacity=16)
    a, b = seq(4 * PS, 100), seq(4 * PS, 200)
    finish(cache, alloc, pool, a)
    finish(cache, alloc, pool, b)
    assert cache.evict(4) == 4            # a's four pages: least recently used
    assert cache.num_pages == 4 and cache.num_host_pages == 4 and host.saved == 4
    pool.clear()                           # the device copies are gone for good
    for p in cache.pages():
        pool[p] = ("b",)
    got = cache.match(a, 4)
    assert len(got) == 4 and cache.num_host_hits == 4 and host.loaded == 4
    check_pages_hold(pool, a, got)
    assert cache.problems([got]) == []
    alloc.free(got)
    assert cache.problems([]) == []


def test_a_match_runs_device_pages_then_host_pages_and_device_stays_prefix_closed():
    alloc, cache, host, pool = setup(num_pages=7, capacity=16)
    a = seq(5 * PS, 0)
    finish(cache, alloc, pool, a)
    cache.evict(2)                         # the last two pages of a go to host
    assert cache.num_pages == 3 and cache.num_host_pages == 2
    assert cache.problems([]) == []
    got = cache.match(a, 5)
    assert len(got) == 5 and cache.num_host_hits == 2
    check_pages_hold(pool, a, got)
    alloc.free(got)
    assert cache.problems([]) == []


def test_a_match_loads_only_what_the_pool_can_hold():
    alloc, cache, host, pool = setup(num_pages=5, capacity=16)   # 4 usable pages
    a = seq(4 * PS, 0)
    finish(cache, alloc, pool, a)
    cache.evict(4)
    held = alloc.alloc(2)                  # a running request holds half the pool
    got = cache.match(a, 4)
    assert len(got) == 2                   # the first two pages of a, loaded back
    check_pages_hold(pool, a, got)
    assert cache.problems([got, held]) == []
    alloc.free(got + held)


def test_a_full_host_tier_drops_its_least_recently_used_pages_first():
    alloc, cache, host, pool = setup(num_pages=5, capacity=4)    # 4 device pages, 4 host rows
    a, b, c = seq(2 * PS, 0), seq(2 * PS, 100), seq(2 * PS, 200)
    finish(cache, alloc, pool, a)
    finish(cache, alloc, pool, b)
    cache.evict(4)                         # a and b on host: it is full
    alloc.free(cache.match(b, 2))          # b loaded back: now more recent than a
    finish(cache, alloc, pool, c)          # the pool is full again (b, c)
    cache.evict(4)                         # c needs 2 rows: a (least recent) makes room
    assert cache.num_host_dropped == 2 and host.saved == 6   # b's copy was still valid
    assert cache.match(a, 2) == []
    for t in (b, c):
        got = cache.match(t, 2)
        assert len(got) == 2
        check_pages_hold(pool, t, got)
        alloc.free(got)
    assert cache.problems([]) == []


def test_a_full_host_tier_drops_copies_of_device_pages_before_host_only_pages():
    alloc, cache, host, pool = setup(num_pages=5, capacity=4)    # 4 device pages, 4 host rows
    a, b, c = seq(2 * PS, 0), seq(2 * PS, 100), seq(2 * PS, 200)
    finish(cache, alloc, pool, a)
    finish(cache, alloc, pool, b)
    cache.evict(4)                         # a and b on host: it is full
    alloc.free(cache.match(b, 2))          # b loaded back: on the device, its copy kept
    finish(cache, alloc, pool, c)
    alloc.free(cache.match(b, 2))          # b more recent than c, c than a
    cache.evict(2)                         # c goes to host: b's copies make room, not a
    assert cache.num_host_dropped == 2 and cache.num_pages == 2 and cache.num_host_pages == 4
    for t in (a, b, c):                    # the two tiers hold all three
        got = cache.match(t, 2)
        assert len(got) == 2
        check_pages_hold(pool, t, got)
        alloc.free(got)
    assert cache.problems([]) == []


def test_an_insert_gives_a_host_only_page_its_device_copy_back():
    alloc, cache, host, pool = setup(num_pages=9, capacity=16)
    a = seq(3 * PS, 0)
    finish(cache, alloc, pool, a)
    cache.evict(3)
    assert cache.num_pages == 0 and cache.num_host_pages == 3
    pages = finish(cache, alloc, pool, a)   # recomputed (e.g. matched before the spill)
    assert cache.num_pages == 3 and cache.pages() == set(pages)
    assert cache.num_host_pages == 3        # the host copies stay valid: no second copy out
    cache.evict(3)
    assert host.saved == 3                  # evicting again copied nothing
    assert cache.problems([]) == []


def test_flush_empties_both_tiers():
    alloc, cache, host, pool = setup(num_pages=9, capacity=16)
    finish(cache, alloc, pool, seq(4 * PS, 0))
    finish(cache, alloc, pool, seq(4 * PS, 100))
    cache.evict(4)
    held = cache.match(seq(4 * PS, 100), 4)    # held by a request: stays on the device
    assert cache.flush() == 0
    assert cache.num_host_pages == 0 and host.rows == {}
    assert cache.num_pages == 4
    assert cache.problems([held]) == []
    alloc.free(held)
    assert cache.flush() == 4 and cache.num_pages == 0 and alloc.num_free == alloc.num_total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_soak_every_page_and_host_row_stays_accounted_for(seed):
    rng = random.Random(seed)
    alloc, cache, host, pool = setup(num_pages=33, capacity=24)
    systems = [seq(rng.randint(1, 6) * PS, 1000 * i) for i in range(12)]
    live: list[list[int]] = []               # page tables of requests in flight
    for _ in range(400):
        op = rng.random()
        if op < 0.55:                         # a turn: match, compute the rest, maybe finish
            tokens = rng.choice(systems) + seq(rng.randint(1, 9), rng.randint(0, 50) * 10 + 5)
            got = cache.match(tokens, (len(tokens) - 1) // PS)
            check_pages_hold(pool, tokens, got)
            need = -(-len(tokens) // PS) - len(got)
            short = need - alloc.num_free
            if short > 0:
                cache.evict(short)
            if alloc.num_free < need:
                alloc.free(got)               # would wait: lets its pages go
                continue
            fresh = alloc.alloc(need)
            for i, p in enumerate(fresh, start=len(got)):
                pool[p] = tuple(tokens[i * PS:(i + 1) * PS])
            table = got + fresh
            if rng.random() < 0.3:
                live.append(table)            # still running
                continue
            if rng.random() < 0.8:            # finished (an abort offers nothing)
                cache.insert(tokens, table, len(tokens))
            alloc.free(table)
        elif op < 0.75 and live:
            alloc.free(live.pop(rng.randrange(len(live))))
        elif op < 0.97:
            cache.evict(rng.randint(1, 8))
        else:
            cache.flush()
        assert cache.problems(live) == []
        assert len(host.rows) <= host.capacity
    for table in live:
        alloc.free(table)
    assert cache.problems([]) == []
    assert cache.num_host_hits > 0 and cache.num_spilled > 0 and cache.num_host_dropped > 0
    cache.flush()
    assert alloc.num_free == alloc.num_total and host.rows == {}
