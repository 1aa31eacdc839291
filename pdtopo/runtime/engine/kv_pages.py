"""Page accounting for the scheduler: the KV pool's pages, who holds them, and the prefix cache
that shares them between requests.

`KVPages` holds the `PageAllocator` (reference-counted page ids, page_allocator.py) and the
engine's `PrefixCache` over it (prefix_cache.py; None when the engine keeps none). The
scheduler owns one (`Scheduler.pages`) and calls it on its own thread; requests carry their
page tables (`req.page_ids`) and how far their KV is computed (`req.num_computed`):

    pages_for(tokens)     -> pages a sequence of that many tokens needs
    ensure_free(n)        -> whether n pages are free, after the cache gave back unreferenced
                             pages (LRU): the cache gives way before any request waits or is
                             preempted
    alloc(n)              -> n pages for a request (ensure_free first)
    match(req)            -> a request holding no KV starts at its longest cached prefix
    admits(req, reserve)  -> whether the scheduler's admission of `req` would find its pages
                             now (match, then ensure_free(need + reserve)), with nothing
                             matched, evicted or taken: the overlapped loop's test (overlap.py)
    release(req, keep)    -> a request lets its pages go: its full computed pages offered to the
                             cache first (`keep`: `keeps_kv(req)`, a request that ended well
                             or was preempted), then its references dropped
    problems(tables)      -> the allocator's references against the cache and the page tables
                             of every live request (docs/prefix-cache.md); `idle_problems()`
                             is the same check with no request alive, redone only after the
                             pool changed
    flush(num_reqs)       -> /flush_cache: every page only the cache holds freed
    host_stats()          -> the host tier's counters for the stats snapshot
"""

from __future__ import annotations

import math
from typing import Any

from pdtopo.runtime.engine.host_kv import HostKVTier
from pdtopo.runtime.engine.page_allocator import PageAllocator
from pdtopo.runtime.engine.prefix_cache import PrefixCache, reference_problems
from pdtopo.runtime.engine.request import Req

HOST_STATS = ("host_kv_pages", "host_kv_capacity", "host_hit_pages", "host_spilled_pages",
              "host_bytes_to_host", "host_bytes_to_device")


def keeps_kv(req: Req) -> bool:
    """Whether a request's computed pages go into the prefix cache when it lets them go:
    when it finished normally or is preempted; never after an abort or a failure (its KV
    may be incomplete or the engine may be broken)."""
    reason = req.finish_reason
    return reason is None or reason.get("type") in ("length", "stop")


class KVPages:
    """The pool's pages and the prefix cache, as the scheduler accounts for them."""

    def __init__(self, allocator: PageAllocator, cache: PrefixCache | None, page_size: int):
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self._checked: tuple[int, list[str]] = (-1, [])  # (allocator version, idle problems)
        self._evictable: tuple[int, int] = (-1, 0)  # (allocator holders_version, tree-only pages)

    @property
    def host(self) -> HostKVTier | None:
        """The prefix cache's host tier, if it has one."""
        return self.cache.host if self.cache is not None else None

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def alloc(self, n: int) -> list[int]:
        self.ensure_free(n)
        return self.allocator.alloc(n)

    def ensure_free(self, n: int) -> bool:
        """Whether `n` pages are free, after evicting unreferenced prefix-cache pages (LRU)
        if too few were: the cache gives way before any request is preempted or waits."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.num_free >= n

    def match(self, req: Req) -> None:
        """Start a request that holds no KV at its longest cached prefix: full pages only, and
        never its last token (the logits of the next token come from a forward pass)."""
        if self.cache is None or req.page_ids:
            return
        pages = self.cache.match(req.all_ids, (req.seq_len - 1) // self.page_size)
        req.page_ids = pages
        req.num_computed = len(pages) * self.page_size
        if not req.num_preemptions:  # what the client sees: the prompt's hit on arrival
            req.cached_tokens = min(req.num_computed, len(req.prompt_ids))

    def admits(self, req: Req, reserve: int) -> bool:
        """Whether `match(req)` then `ensure_free(need + reserve)` would succeed now (`need`:
        the pages `req` lacks for its whole sequence after its cached prefix), changing
        nothing. The cache's pages that only it holds count as free (ensure_free evicts them),
        except those of `req`'s own prefix (match takes them first); that count walks the tree,
        so it is redone only after some page's holders changed."""
        cached = self.cache.peek(req.all_ids, (req.seq_len - 1) // self.page_size) if (
            self.cache is not None and not req.page_ids) else []
        need = self.pages_for(req.seq_len) - len(req.page_ids) - len(cached)
        if need <= 0:
            return True
        short = need + reserve - self.allocator.num_free
        if short <= 0:
            return True
        if self.cache is None:
            return False
        version = self.allocator.holders_version
        if self._evictable[0] != version:
            self._evictable = (version, self.cache.num_evictable())
        refcount = self.allocator.refcount
        return self._evictable[1] - sum(1 for p in cached if refcount(p) == 1) >= short

    def release(self, req: Req, keep: bool) -> None:
        """Give up a request's pages: offer its full computed pages to the prefix cache first
        (`keep`), then drop the request's references (pages the cache or others hold stay)."""
        if req.page_ids:
            if keep and self.cache is not None:
                self.cache.insert(req.all_ids, req.page_ids, req.num_computed)
            self.allocator.free(req.page_ids)
            req.page_ids = []
        req.num_computed = 0

    def problems(self, tables: list[list[int]]) -> list[str]:
        """Disagreements between the allocator's references and their holders (the prefix
        cache and the page `tables` of every live request); empty when consistent."""
        if self.cache is not None:  # the tree's structure and its host tier too
            return self.cache.problems(tables)
        return reference_problems(self.allocator, None, tables)

    def idle_problems(self) -> list[str]:
        """The first problems with no request alive, checked again only after the pool changed
        (a stats snapshot asks every step)."""
        version = self.allocator.version
        if self._checked[0] != version:
            self._checked = (version, self.problems([])[:5])
        return self._checked[1]

    def flush(self, num_reqs: int) -> dict[str, Any]:
        """Empty the prefix cache of every page no request holds: what was freed, what is still
        held (`num_reqs`: the live requests, reported beside)."""
        cache = self.cache
        host_pages = cache.num_host_pages if cache is not None else 0
        freed = cache.flush() if cache is not None else 0
        return {"prefix_cache": cache is not None, "flushed_pages": freed,
                "flushed_host_pages": host_pages,
                "tree_pages": cache.num_pages if cache is not None else 0,
                "num_reqs": num_reqs, "free_pages": self.allocator.num_free,
                "total_pages": self.allocator.num_total}

    def host_stats(self) -> dict[str, Any]:
        """The prefix cache's host tier: pages held and their bound, pages loaded back (hits)
        and copied out (spilled), bytes moved each way; zeros without a tier."""
        cache, host = self.cache, self.host
        if host is None:
            return dict.fromkeys(HOST_STATS, 0)
        return {"host_kv_pages": cache.num_host_pages, "host_kv_capacity": host.capacity,
                "host_hit_pages": cache.num_host_hits, "host_spilled_pages": cache.num_spilled,
                "host_bytes_to_host": host.bytes_to_host,
                "host_bytes_to_device": host.bytes_to_device}
