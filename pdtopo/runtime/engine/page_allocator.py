"""KV pool pages with reference counts. Page 0 is reserved (padding target) and never handed out.

Owned by the scheduler thread (not locked). `alloc(n)` returns n free page ids, each with one
reference, or raises `OutOfPages` (nothing is taken then). `incref(pages)` adds a holder to
pages already in use (a request reusing pages of the prefix cache, or the cache adopting a
request's page); `free(pages)` drops one reference of each and returns a page to the free list
when its last holder lets go. Freeing a page nobody holds (or the same page twice in one call)
is a bug worth failing loudly on: it raises and changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs: dict[int, int] = {}   # page -> holders (only pages in use)
        self.version = 0                  # bumped by every change (callers cache checks on it)
        self.holders_version = 0          # bumped when holders change other than by alloc

    @property
    def num_total(self) -> int:
        """Pages that can ever be handed out (all but page 0)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def used_pages(self) -> dict[int, int]:
        """A copy of {page: holders} for every page in use (consistency checks)."""
        return dict(self._refs)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_total}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.version += 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        bad = [p for p in pages if p not in self._refs]
        if bad:
            raise ValueError(f"adding a holder to pages that are not allocated: {bad}")
        for p in pages:
            self._refs[p] += 1
        self.version += 1
        self.holders_version += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference of each page; pages left without holders become free."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._refs]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"freeing pages that are not allocated (or repeated): {bad or pages}")
        for p in pages:
            left = self._refs[p] - 1
            if left:
                self._refs[p] = left
            else:
                del self._refs[p]
                self._free.append(p)
        self.version += 1
        self.holders_version += 1

    def reset(self) -> None:
        self._free = deque(range(1, self.num_pages))
        self._refs.clear()
        self.version += 1
        self.holders_version += 1
