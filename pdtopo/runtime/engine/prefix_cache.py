"""The engine's prefix cache: a radix tree over full KV pages, shared between requests.

Each node below the root is one full page of `page_size` tokens: its key is those tokens, its
value the pool page holding their KV, and its path from the root the whole prefix before it.
Only full pages are shared; a request's partial last page stays private, so a page in the tree
is never written again. The tree holds one allocator reference on each of its pages; a request
that reuses a page holds one more (see page_allocator.py).

Data flow, all on the scheduler thread that owns the pool:

    match(tokens, max_pages)   -> pages of the longest cached prefix (at most max_pages), with
                                  a reference added for the caller; LRU clocks refreshed
    insert(tokens, pages, n)   -> a finished (or preempted) request offers the full pages of
                                  its first n computed tokens; pages the tree lacks are adopted
                                  (one more reference), pages whose prefix is already cached stay
                                  the request's (it frees them with the rest of its table)
    evict(n)                   -> free up to n pages (at least 1/64 of the tree: the walk that
                                  finds the leaves is amortized): least recently used leaves that
                                  nobody but the tree holds, then their parents as they become
                                  leaves
    flush()                    -> evict everything unreferenced (POST /flush_cache)
    problems(tables)           -> consistency of tree and allocator against the page tables
                                  of live requests (every page's references accounted for)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdtopo.runtime.engine.page_allocator import PageAllocator


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = int(page_size)
        self._root = _Node((), 0, None)
        self._clock = itertools.count(1)
        self._pages: dict[int, _Node] = {}   # page -> its node (every page the tree holds)
        self.num_evicted = 0                   # pages given back by evict() since start

    @property
    def num_pages(self) -> int:
        """Pages the tree holds (referenced by requests or not)."""
        return len(self._pages)

    def num_evictable(self) -> int:
        """Pages only the tree holds (what `evict` can free). O(tree size)."""
        return sum(1 for p in self._pages if self.allocator.refcount(p) == 1)

    def _blocks(self, tokens: Sequence[int], n_pages: int) -> Iterable[tuple[int, ...]]:
        ps = self.page_size
        for i in range(n_pages):
            yield tuple(tokens[i * ps:(i + 1) * ps])

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (full pages, at most `max_pages`),
        each with one reference added for the caller (who frees them like its own pages)."""
        node, pages = self._root, []
        now = next(self._clock)
        for key in self._blocks(tokens, min(max_pages, len(tokens) // self.page_size)):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            pages.append(child.page)
            node = child
        self.allocator.incref(pages)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], num_tokens: int) -> int:
        """Offer the full pages covering the first `num_tokens` of `tokens` (their KV is in
        `pages`, in order). Returns how many pages the tree adopted."""
        n = min(num_tokens // self.page_size, len(pages))
        node, adopted = self._root, 0
        now = next(self._clock)
        for i, key in enumerate(self._blocks(tokens, n)):
            child = node.children.get(key)
            if child is None:
                page = int(pages[i])
                if page in self._pages:  # cannot happen with private tails; never alias
                    break
                child = _Node(key, page, node)
                node.children[key] = child
                self._pages[page] = child
                self.allocator.incref([page])
                adopted += 1
            elif child.page != pages[i] and self._pages.get(int(pages[i])) is not None:
                break  # the request's page is another prefix's node: stop, never alias
            child.last_used = now
            node = child
        return adopted

    # ------------------------------------------------------------------ freeing
    def evict(self, n: int) -> int:
        """Free up to `n` pages, least recently used unreferenced leaves first. Finding the
        leaves walks the whole tree, so a call frees at least 1/64 of the tree (when that many
        are unreferenced): on a busy server with a full pool that walk is paid once per 64
        evicted pages at most, not once per allocation."""
        if n <= 0 or not self._pages:
            return 0
        n = max(n, len(self._pages) // 64)
        refcount = self.allocator.refcount
        heap = [(node.last_used, id(node), node) for node in self._pages.values()
                if not node.children and refcount(node.page) == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            self._remove(node)
            freed += 1
            self.num_evicted += 1
            parent = node.parent
            if (parent is not self._root and parent is not None and not parent.children
                    and refcount(parent.page) == 1):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def flush(self) -> int:
        """Evict every page nobody but the tree holds; returns how many were freed."""
        return self.evict(len(self._pages))

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key]
        del self._pages[node.page]
        self.allocator.free([node.page])

    # ------------------------------------------------------------------ checks
    def pages(self) -> set[int]:
        return set(self._pages)

    def problems(self, tables: Iterable[Sequence[int]]) -> list[str]:
        """See `reference_problems`, plus the tree's own structure."""
        out = reference_problems(self.allocator, self, tables)
        for page, node in self._pages.items():
            if node.parent is None or node.parent.children.get(node.key) is not node:
                out.append(f"page {page}: tree node detached from its parent")
            if len(node.key) != self.page_size:
                out.append(f"page {page}: tree node of {len(node.key)} tokens")
            if (node.parent is not None and node.parent is not self._root
                    and node.parent.page not in self._pages):
                out.append(f"page {page}: parent page {node.parent.page} not in the tree")
        return out


def reference_problems(allocator: PageAllocator, cache: PrefixCache | None,
                       tables: Iterable[Sequence[int]]) -> list[str]:
    """Why the allocator's references disagree with their holders (empty: they agree): every
    page in use has exactly one reference per holder (the cache, if it holds the page, and each
    live request's page table that lists it), and no other page is in use."""
    expected: dict[int, int] = dict.fromkeys(cache.pages(), 1) if cache is not None else {}
    for table in tables:
        for p in table:
            expected[int(p)] = expected.get(int(p), 0) + 1
    actual = allocator.used_pages()
    return [f"page {p}: {actual.get(p, 0)} references in the allocator, "
            f"{expected.get(p, 0)} holders (cache + requests)"
            for p in sorted(set(expected) | set(actual)) if expected.get(p, 0) != actual.get(p, 0)]
