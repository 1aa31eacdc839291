"""The host KV tier (HostKVTier over a small JAX pool on the CPU), alone and under the prefix
cache: its copies are bit-exact, a dropped row is free at once, a hit moves only the rows it
loads, and serving compiles nothing after warmup; conversations whose working set is the device
pool plus 90 % of the tier keep hitting when they come back (in turn, or in a new order each
round with lengths that spread a conversation over many copies), every page loaded back holding
its own bytes."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from pdtopo.runtime.engine.host_kv import ROWS_PER_CALL, HostKVTier
from pdtopo.runtime.engine.page_allocator import PageAllocator
from pdtopo.runtime.engine.prefix_cache import PrefixCache

PS = 4
SHAPE_TAIL = (PS, 2, 8)    # page_size, kv heads, head_dim
ENTRIES = 4                # pool entries (K and V of two layers)


@jax.jit
def _write_page(pool, page, value):
    return [kv.at[page].set(value + 1e4 * e) for e, kv in enumerate(pool)]


def page_value(conv: int, i: int) -> float:
    return float(conv * 100 + i + 1)


class Runner:
    def __init__(self, num_pages: int, entries: int = ENTRIES):
        self.kv_caches = [jax.device_put(np.zeros((num_pages, *SHAPE_TAIL), np.float32))
                          for _ in range(entries)]


def test_rows_copy_exact_bytes_free_one_by_one_and_a_hit_moves_only_its_rows():
    entries = 10                                     # two groups of pool entries (8 and 2)
    runner = Runner(48, entries)
    runner.kv_caches = [jax.device_put(np.arange(48 * np.prod(SHAPE_TAIL), dtype=np.float32)
                                       .reshape(48, *SHAPE_TAIL) + 1e5 * e)
                        for e in range(entries)]
    values = [np.asarray(kv) for kv in runner.kv_caches]
    tier = HostKVTier(runner, capacity_pages=24)
    assert tier.warmup() == ROWS_PER_CALL
    compiled: list[str] = []

    def on_event(event: str, _secs: float, **_kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        serve(runner, tier, values)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiled == []                            # serving compiled nothing


def serve(runner: Runner, tier: HostKVTier, values: list[np.ndarray]) -> None:
    src = list(range(1, ROWS_PER_CALL + 5))          # 20 pages: two calls (16 and 4)
    refs = tier.save(src)
    assert tier.memory_kind == "pinned_host" and tier.bytes_to_host == 20 * tier.page_bytes
    assert tier.used_rows == 20 and tier.free_rows() == 4
    with pytest.raises(RuntimeError, match="host KV tier full"):
        tier.save([30, 31, 32, 33, 34])
    for r in refs[3:6]:                              # rows dropped anywhere are free at once
        tier.drop(r)
    assert tier.used_rows == 17 and tier.free_rows() == 7
    assert tier.live_refs() == set(refs[:3] + refs[6:])
    more = tier.save([40, 41, 42, 43, 44, 45, 46])   # the freed rows take new copies
    assert tier.free_rows() == 0
    dst = list(range(47, 27, -1))                    # other pages, reversed
    picked = [0, 7, 16, 19]                          # rows of both save calls
    tier.load([refs[i] for i in picked], [dst[i] for i in picked])
    assert tier.bytes_to_device == 4 * tier.page_bytes   # only the rows loaded move
    for e, kv in enumerate(runner.kv_caches):
        got = np.asarray(kv)
        for i in range(len(src)):
            want = values[e][src[i]] if i in picked else values[e][dst[i]]
            np.testing.assert_array_equal(got[dst[i]], want)
    kept = refs[:3] + refs[6:] + more                # 24 rows: a load of two calls
    kept_src = src[:3] + src[6:] + [40, 41, 42, 43, 44, 45, 46]
    tier.load(kept, list(range(1, 25)))
    for e, kv in enumerate(runner.kv_caches):
        np.testing.assert_array_equal(np.asarray(kv)[1:25], values[e][kept_src])


def turn(cache: PrefixCache, runner: Runner, conv: int, n_pages: int) -> int:
    """One request for conversation `conv` (n_pages full pages, then a token or two of its
    own): match, check what the match gives, compute the rest, offer it all. Returns the pages
    hit."""
    tokens = [conv * 1000 + t for t in range(n_pages * PS)]
    alloc = cache.allocator
    got = cache.match(tokens, n_pages)
    pool = [np.asarray(kv) for kv in runner.kv_caches]
    for i, p in enumerate(got):
        for e in range(ENTRIES):
            assert (pool[e][p] == page_value(conv, i) + 1e4 * e).all(), (conv, i, p)
    need = n_pages - len(got)
    if need > alloc.num_free:
        cache.evict(need - alloc.num_free)
    fresh = alloc.alloc(need)
    for i, p in enumerate(fresh, start=len(got)):
        runner.kv_caches = _write_page(runner.kv_caches, p, np.float32(page_value(conv, i)))
    cache.insert(tokens, got + fresh, n_pages * PS)
    alloc.free(got + fresh)
    return len(got)


def workload(name: str, pages: int) -> tuple[list[int], list[list[int]]]:
    """Conversation lengths (pages, summing to `pages`) and the order of 4 rounds after the
    first: "cycle" comes back in turn (4 pages each); "mixed" has 1..8 pages each and a new
    order every round (evictions then spread a conversation's pages over many saves)."""
    rng = random.Random(7)
    if name == "cycle":
        lens = [4] * (pages // 4)
    else:
        lens = []
        while sum(lens) < pages:
            lens.append(min(rng.randint(1, 8), pages - sum(lens)))
    rounds = []
    for _ in range(4):
        order = list(range(len(lens)))
        if name == "mixed":
            rng.shuffle(order)
        rounds.append(order)
    return lens, rounds


@pytest.mark.parametrize("name", ["cycle", "mixed"])
def test_a_working_set_of_the_pool_and_most_of_the_host_tier_keeps_hitting(name):
    device_pages, host_pages = 24, 48
    lens, rounds = workload(name, device_pages + int(0.9 * host_pages))   # 67 pages
    runner = Runner(device_pages + 1)                                    # page 0 is reserved
    tier = HostKVTier(runner, capacity_pages=host_pages)
    tier.warmup()
    cache = PrefixCache(PageAllocator(device_pages + 1), PS, tier)
    for conv, n in enumerate(lens):                                      # the first round: misses
        turn(cache, runner, conv, n)
    hit = looked_up = held = 0
    for order in rounds:
        for conv in order:
            hit += turn(cache, runner, conv, lens[conv])
            looked_up += lens[conv]
            # every row the tier counts against its bound holds a page of the tree
            held += cache.num_host_pages
            assert tier.used_rows == len(tier.live_refs()) == cache.num_host_pages <= host_pages
    ratio = hit / looked_up
    print(f"{name}: hit ratio {ratio:.3f}, host pages held on average "
          f"{held / sum(map(len, rounds)):.1f} of {host_pages}, dropped {cache.num_host_dropped}")
    assert ratio >= 0.85, ratio
    assert cache.problems([]) == []
