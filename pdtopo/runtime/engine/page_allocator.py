"""Free list of KV pool pages. Page 0 is reserved (padding target) and never handed out.

Owned by the scheduler thread (not locked). `alloc(n)` returns n page ids or raises
`OutOfPages` (nothing is taken then); `free(pages)` gives them back and rejects pages that are
out of range or not currently allocated (a double free is a bug worth failing loudly on).
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
        self._used: set[int] = set()

    @property
    def num_total(self) -> int:
        """Pages that can ever be handed out (all but page 0)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_total}")
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"freeing pages that are not allocated (or repeated): {bad or pages}")
        self._used.difference_update(pages)
        self._free.extend(pages)

    def reset(self) -> None:
        self._free = deque(range(1, self.num_pages))
        self._used.clear()
