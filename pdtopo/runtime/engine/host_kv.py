"""The host tier of the prefix cache: bounded copies of KV pages in host memory.

The prefix cache (prefix_cache.py) decides which pages go where; this module moves their bytes.
Pages are copied in blocks of at most BLOCK_PAGES: one gather of the pool (the PD gather, its
programs warmed), one `jax.device_put` of its packed arrays to host memory (memory kind
`pinned_host` where the backend has it), and back the same way. Every call only dispatches:
JAX orders the copies with the steps around them on the pool's buffers, so a page freed right
after `save` is rewritten only after its copy was read, and a page filled by `load` is read by
the next step only after it was written. The scheduler thread never waits on either.

    save(pages)        -> one HostRef (block, row) per page, in order; bytes_to_host grows
    load(refs, pages)  -> writes each ref's rows at the device pages given (runner.kv_caches
                          replaced); bytes_to_device grows
    drop(ref)          -> forgets a row; a block's host memory goes when its last row does
    free_rows()        -> room: a block of n pages holds n rows, and the capacity
                          (`engine.host_kv_pages`) bounds the rows of live blocks

Owned by the scheduler thread (like the pool and the allocator): no lock.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from pdtopo.kernels import insert_rows, select_from_kv_caches

log = logging.getLogger(__name__)

BLOCK_PAGES = 16   # pages per host block (one gather, one transfer each way)
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


class HostRef(NamedTuple):
    block: int
    row: int


@dataclass(eq=False)
class _Block:
    arrays: list[Any]            # packed [rows, page_size, heads, head_dim] per pool entry, host
    live: set[int] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return int(self.arrays[0].shape[0])


def host_memory_kind(device: Any, key: str = "engine.host_kv_pages") -> str:
    """The host memory kind a device's arrays can be copied to (pinned first); `key` is the
    setting that asked, named in the error when there is none."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return kind
    raise ValueError(f"{key}: device {device} has no host memory kind ({sorted(kinds)}); "
                     "turn it off")


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class HostKVTier:
    def __init__(self, runner: Any, capacity_pages: int):
        if capacity_pages < 1:
            raise ValueError(f"engine.host_kv_pages must be >= 1 for a host tier, got {capacity_pages}")
        if getattr(runner, "kv_mirror", None) is not None:
            raise ValueError("engine.host_kv_pages: the host KV tier needs a single-process "
                             "instance (this one spans several processes); set it to 0")
        self.runner = runner
        self.capacity = int(capacity_pages)
        pool = runner.kv_caches
        self.memory_kind = host_memory_kind(next(iter(pool[0].devices())))
        self._host = [kv.sharding.with_memory_kind(self.memory_kind) for kv in pool]
        self._device = [kv.sharding for kv in pool]
        self.page_bytes = sum(kv.nbytes // kv.shape[0] for kv in pool)
        self._blocks: dict[int, _Block] = {}
        self._ids = itertools.count()
        self.used_rows = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    # ------------------------------------------------------------------ room
    def free_rows(self) -> int:
        return self.capacity - self.used_rows

    def live_refs(self) -> set[HostRef]:
        return {HostRef(i, r) for i, b in self._blocks.items() for r in b.live}

    # ------------------------------------------------------------------ copies
    def save(self, pages: Sequence[int]) -> list[HostRef]:
        """Dispatch host copies of device `pages`; the caller may free them right away."""
        refs: list[HostRef] = []
        for chunk in _chunks(list(pages), BLOCK_PAGES):
            if len(chunk) > self.free_rows():
                raise RuntimeError(f"host KV tier full: {len(chunk)} rows wanted, "
                                   f"{self.free_rows()} free of {self.capacity}")
            packed = select_from_kv_caches(self.runner.kv_caches, chunk)
            block_id = next(self._ids)
            self._blocks[block_id] = _Block(jax.device_put(packed, self._host),
                                            set(range(len(chunk))))
            self.used_rows += len(chunk)
            self.bytes_to_host += len(chunk) * self.page_bytes
            refs.extend(HostRef(block_id, r) for r in range(len(chunk)))
        return refs

    def load(self, refs: Sequence[HostRef], pages: Sequence[int]) -> None:
        """Dispatch writes of the rows `refs` into device `pages` (one transfer per block)."""
        by_block: dict[int, dict[int, int]] = {}
        for ref, page in zip(refs, pages, strict=True):
            by_block.setdefault(ref.block, {})[ref.row] = int(page)
        for block_id, rows in by_block.items():
            block = self._blocks[block_id]
            row_pages = np.full((block.rows,), -1, np.int64)
            for row, page in rows.items():
                row_pages[row] = page
            on_device = jax.device_put(block.arrays, self._device)
            self.runner.kv_caches = insert_rows(self.runner.kv_caches, on_device, row_pages)
            self.bytes_to_device += block.rows * self.page_bytes

    def drop(self, ref: HostRef) -> None:
        block = self._blocks[ref.block]
        block.live.remove(ref.row)
        if not block.live:
            del self._blocks[ref.block]
            self.used_rows -= block.rows

    # ------------------------------------------------------------------ warmup
    def warmup(self) -> int:
        """Compile every program a save or a load can run (gathers, the exact-length slices
        and pads of 1..BLOCK_PAGES rows, the scatters) while the pool is idle, so that serving
        never compiles: pages 1..n are read, and page 1 is written with its own bytes.
        Returns the block sizes warmed."""
        t0 = time.perf_counter()
        most = min(BLOCK_PAGES, self.runner.kv_caches[0].shape[0] - 1)
        for n in range(1, most + 1):
            packed = select_from_kv_caches(self.runner.kv_caches, list(range(1, n + 1)))
            back = jax.device_put(jax.device_put(packed, self._host), self._device)
            # page 1 gets its own bytes back: the scatter compiles, nothing changes
            self.runner.kv_caches = insert_rows(self.runner.kv_caches, back, [1] + [-1] * (n - 1))
        jax.block_until_ready(self.runner.kv_caches)
        log.info("warmed the host KV tier's copies (1..%d pages, %s) in %.2fs", most,
                 self.memory_kind, time.perf_counter() - t0)
        return most
