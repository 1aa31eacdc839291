"""The engine's prefix cache: a radix tree over full KV pages, shared between requests, with an
optional host-memory tier under it.

Each node below the root is one full page of `page_size` tokens: its key is those tokens, its
path from the root the whole prefix before it, and its KV is in the device pool (`page`), in
the host tier (`host`, see host_kv.py), or in both. Only full pages are shared; a request's
partial last page stays private, so a page in the tree is never written again and a host copy
stays valid for as long as the node lives. The tree holds one allocator reference on each of
its device pages; a request that reuses a page holds one more (see page_allocator.py).

Device pages are prefix-closed: a node's device page is kept only while its parent's is, so a
match is a run of device pages followed by a run of host-only pages.

Data flow, all on the scheduler thread that owns the pool:

    match(tokens, max_pages)   -> pages of the longest cached prefix (at most max_pages), with
                                  a reference added for the caller; host-only pages of it are
                                  given device pages and loaded back first (as many as the pool
                                  can give); LRU clocks refreshed
    insert(tokens, pages, n)   -> a finished (or preempted) request offers the full pages of
                                  its first n computed tokens; pages the tree lacks on the
                                  device are adopted (one more reference), pages whose prefix is
                                  already there stay the request's (freed with its table)
    evict(n)                   -> free up to n device pages (at least 1/64 of the tree: the
                                  walk that finds the leaves is amortized): least recently used
                                  nodes with no device child that nobody but the tree holds;
                                  with a host tier their KV is copied to host memory first
                                  (device -> host -> gone: the host tier drops copies of
                                  pages still on the device first, then its least recently
                                  used host-only rows, to make room), without one they are gone
    flush()                    -> empty both tiers of everything unreferenced (/flush_cache)
    problems(tables)           -> consistency of tree, allocator and host tier against the page
                                  tables of live requests (every page's references accounted for)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdtopo.runtime.engine.page_allocator import PageAllocator


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int | None                  # device page, None when only the host tier has it
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0
    host: Any = None                  # the host tier's reference (HostRef), None if none
    loading: bool = False             # being loaded back: the host tier must not drop it

    def has_device_child(self) -> bool:
        return any(c.page is not None for c in self.children.values())


class HostTier(Protocol):
    """What the cache needs of host_kv.HostKVTier (tests give it fakes)."""

    def free_rows(self) -> int: ...
    def save(self, pages: Sequence[int]) -> list[Any]: ...
    def load(self, refs: Sequence[Any], pages: Sequence[int]) -> None: ...
    def drop(self, ref: Any) -> None: ...
    def live_refs(self) -> set[Any]: ...


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, host: HostTier | None = None):
        self.allocator = allocator
        self.page_size = int(page_size)
        self.host = host
        self._root = _Node((), 0, None)
        self._clock = itertools.count(1)
        self._pages: dict[int, _Node] = {}   # device page -> its node (every one the tree holds)
        self._host_nodes: set[_Node] = set()  # nodes with a host copy
        self.num_evicted = 0                   # device pages given back by evict() since start
        self.num_spilled = 0                   # of which copied to the host tier
        self.num_host_hits = 0                 # pages loaded back from the host tier
        self.num_host_dropped = 0              # host copies dropped to make room

    @property
    def num_pages(self) -> int:
        """Device pages the tree holds (referenced by requests or not)."""
        return len(self._pages)

    @property
    def num_host_pages(self) -> int:
        """Pages the host tier holds for the tree."""
        return len(self._host_nodes)

    def num_evictable(self) -> int:
        """Device pages only the tree holds (what `evict` can free). O(tree size)."""
        return sum(1 for p in self._pages if self.allocator.refcount(p) == 1)

    def _blocks(self, tokens: Sequence[int], n_pages: int) -> Iterable[tuple[int, ...]]:
        ps = self.page_size
        for i in range(n_pages):
            yield tuple(tokens[i * ps:(i + 1) * ps])

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (full pages, at most `max_pages`),
        each with one reference added for the caller (who frees them like its own pages).
        Host-only pages of the prefix are loaded back into fresh device pages (as many as the
        pool can give after evicting; the match ends where they run out)."""
        node, pages, on_host = self._root, [], []
        now = next(self._clock)
        for key in self._blocks(tokens, min(max_pages, len(tokens) // self.page_size)):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            if child.page is None:
                on_host.append(child)
            else:
                pages.append(child.page)
            node = child
        self.allocator.incref(pages)
        if on_host:
            pages += self._load(on_host)
        return pages

    def peek(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The device pages `match` would hand out for `tokens` now, without taking them, loading
        host-only pages (those need fresh pages, as if uncached) or touching the LRU order."""
        node, pages = self._root, []
        for key in self._blocks(tokens, min(max_pages, len(tokens) // self.page_size)):
            node = node.children.get(key)
            if node is None:
                break
            if node.page is not None:
                pages.append(node.page)
        return pages

    def _load(self, nodes: list[_Node]) -> list[int]:
        """Give host-only `nodes` (a run below device pages the caller holds) device pages
        and dispatch their load; returns those pages, referenced for the caller."""
        for n in nodes:
            n.loading = True
        try:
            short = len(nodes) - self.allocator.num_free
            if short > 0:
                self.evict(short)
            loaded = nodes[:min(len(nodes), self.allocator.num_free)]
            if not loaded:
                return []
            fresh = self.allocator.alloc(len(loaded))   # the tree's references
            self.host.load([n.host for n in loaded], fresh)
            for n, page in zip(loaded, fresh, strict=True):
                n.page = page
                self._pages[page] = n
            self.allocator.incref(fresh)                # the caller's
            self.num_host_hits += len(loaded)
            return fresh
        finally:
            for n in nodes:
                n.loading = False

    def insert(self, tokens: Sequence[int], pages: Sequence[int], num_tokens: int) -> int:
        """Offer the full pages covering the first `num_tokens` of `tokens` (their KV is in
        `pages`, in order). Returns how many pages the tree adopted (a host-only node takes
        the request's page as its device copy)."""
        n = min(num_tokens // self.page_size, len(pages))
        node, adopted = self._root, 0
        now = next(self._clock)
        for i, key in enumerate(self._blocks(tokens, n)):
            child = node.children.get(key)
            page = int(pages[i])
            if child is None or child.page is None:
                if page in self._pages:  # cannot happen with private tails; never alias
                    break
                if child is None:
                    child = _Node(key, page, node)
                    node.children[key] = child
                child.page = page
                self._pages[page] = child
                self.allocator.incref([page])
                adopted += 1
            elif child.page != page and page in self._pages:
                break  # the request's page is another prefix's node: stop, never alias
            child.last_used = now
            node = child
        return adopted

    # ------------------------------------------------------------------ freeing
    def evict(self, n: int) -> int:
        """Free up to `n` device pages, least recently used first among the nodes with no
        device child that only the tree holds; with a host tier their KV goes to host memory.
        Finding them walks the whole tree, so a call frees at least 1/64 of the tree (when that
        many are unreferenced): on a busy server with a full pool that walk is paid once per 64
        evicted pages at most, not once per allocation."""
        if n <= 0 or not self._pages:
            return 0
        return self._evict(max(n, len(self._pages) // 64), spill=self.host is not None)

    def _evict(self, n: int, spill: bool) -> int:
        refcount = self.allocator.refcount
        heap = [(node.last_used, id(node), node) for node in self._pages.values()
                if not node.has_device_child() and refcount(node.page) == 1]
        heapq.heapify(heap)
        victims: list[tuple[_Node, int]] = []
        while heap and len(victims) < n:
            _, _, node = heapq.heappop(heap)
            victims.append((node, node.page))
            del self._pages[node.page]
            node.page = None             # off the device from here on, for its parent's test
            parent = node.parent
            if (parent is not self._root and parent is not None and parent.page is not None
                    and not parent.has_device_child() and refcount(parent.page) == 1):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        if spill:
            self._spill([(node, page) for node, page in victims if node.host is None])
        for node, _ in victims:   # not kept on host (nor detached already, with a parent)
            if node.host is None and node.parent.children.get(node.key) is node:
                self._remove(node)
        self.allocator.free([page for _, page in victims])
        self.num_evicted += len(victims)
        return len(victims)

    def _spill(self, victims: list[tuple[_Node, int]]) -> None:
        """Copy the victims' device pages to the host tier, as many as it makes room for (the
        most recently used: `victims` come least recent first)."""
        if not victims:
            return
        room = self._host_room(len(victims))
        kept = victims[len(victims) - room:] if room else []
        refs = self.host.save([page for _, page in kept])
        for (node, _), ref in zip(kept, refs, strict=True):
            node.host = ref
            self._host_nodes.add(node)
        self.num_spilled += len(kept)

    def _host_room(self, rows: int) -> int:
        """Make room for `rows` host rows (up to that many) by dropping host copies: first
        those of nodes still on the device (the page stays cached; only a later eviction copies
        it out again), least recently used first, then host-only nodes without children (whose
        node goes with its copy), least recently used first. So under pressure the two tiers
        hold different pages: up to the pool plus the tier, not the tier alone. Returns the
        rows free now, at most `rows`."""
        host = self.host
        if host.free_rows() >= rows:
            return rows
        heap = [self._drop_key(n) for n in self._host_nodes if self._droppable(n)]
        heapq.heapify(heap)
        while heap and host.free_rows() < rows:
            *_, node = heapq.heappop(heap)
            if not self._droppable(node):
                continue
            parent = node.parent
            self._drop_host(node)
            self.num_host_dropped += 1
            if node.page is None:
                self._remove(node)
                if parent is not None and parent is not self._root and self._droppable(parent):
                    heapq.heappush(heap, self._drop_key(parent))
        return min(rows, max(0, host.free_rows()))

    @staticmethod
    def _drop_key(node: _Node) -> tuple:
        return (node.page is None, node.last_used, id(node), node)

    @staticmethod
    def _droppable(node: _Node) -> bool:
        return (node.host is not None and not node.loading
                and (node.page is not None or not node.children))

    def _drop_host(self, node: _Node) -> None:
        self.host.drop(node.host)
        node.host = None
        self._host_nodes.discard(node)

    def flush(self) -> int:
        """Empty both tiers of everything no request holds: device pages only the tree holds
        are freed (not copied to the host tier), and every host copy is dropped. Returns the
        device pages freed."""
        freed = self._evict(len(self._pages), spill=False) if self._pages else 0
        for node in list(self._host_nodes):
            if node in self._host_nodes:
                self._drop_host(node)
                if node.page is None:
                    self._remove(node)
        return freed

    def _remove(self, node: _Node) -> None:
        """Detach a node without a device page, with its subtree (host-only, like it)."""
        assert node.parent is not None and node.page is None
        del node.parent.children[node.key]
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host is not None:
                self._drop_host(n)
            stack.extend(n.children.values())

    # ------------------------------------------------------------------ checks
    def pages(self) -> set[int]:
        return set(self._pages)

    def _nodes(self) -> Iterable[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def problems(self, tables: Iterable[Sequence[int]]) -> list[str]:
        """See `reference_problems`, plus the tree's own structure and the host tier's rows."""
        out = reference_problems(self.allocator, self, tables)
        for page, node in self._pages.items():
            if node.page != page:
                out.append(f"page {page}: indexed under a node holding page {node.page}")
        seen_host: list[Any] = []
        for node in self._nodes():
            name = f"node {node.key[:4]}... (page {node.page}, host {node.host})"
            if node.parent is None or node.parent.children.get(node.key) is not node:
                out.append(f"{name}: detached from its parent")
            if len(node.key) != self.page_size:
                out.append(f"{name}: {len(node.key)} tokens")
            if node.page is None and node.host is None:
                out.append(f"{name}: in neither tier")
            if node.page is not None and self._pages.get(node.page) is not node:
                out.append(f"{name}: device page not indexed")
            if (node.page is not None and node.parent is not self._root
                    and node.parent is not None and node.parent.page is None):
                out.append(f"{name}: on the device below a host-only parent")
            if node.host is not None:
                seen_host.append(node.host)
            if (node.host is not None) != (node in self._host_nodes):
                out.append(f"{name}: host index disagrees")
        if self.host is not None:
            live = self.host.live_refs()
            if len(seen_host) != len(set(seen_host)) or set(seen_host) != live:
                out.append(f"host tier: {len(live)} live rows, {len(seen_host)} held by nodes "
                           f"({len(set(seen_host) ^ live)} disagree)")
        elif seen_host:
            out.append(f"{len(seen_host)} nodes hold host copies without a host tier")
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
