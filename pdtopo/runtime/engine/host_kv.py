"""The host tier of the prefix cache: bounded copies of KV pages in host memory, one row each.

The prefix cache (prefix_cache.py) decides which pages go where; this module moves their bytes.
A row is one page's KV of every pool entry, held in host memory (memory kind `pinned_host`
where the backend has it) as one array `[entries, page_size, heads, head_dim]` per group of
pool entries (xla_copy.GROUP of them: the programs' compile time stays flat with depth). Each
row is its own host allocation, so dropping a row gives its memory back at once and the
capacity (`engine.host_kv_pages`) counts live rows, the unit that is really freed.

    save(pages)        -> one HostRef per page, in order: a gather program (one call per
                          group of entries) cuts the pages into rows on the device, one
                          `jax.device_put` moves them to host memory;
                          bytes_to_host grows
    load(refs, pages)  -> one `device_put` of exactly those rows, one scatter program writes
                          them at the device pages given (runner.kv_caches replaced);
                          bytes_to_device grows by those rows only
    drop(ref)          -> forgets a row: its host memory goes, one row more is free
    free_rows()        -> capacity minus live rows

Both programs take 1, 4 or 16 rows (ROW_BUCKETS; fewer are padded with rows that go nowhere
and move nothing to or from host memory, more take several calls), and `warmup` compiles them
for each: serving never compiles. Copies are bit-exact (a gather and a scatter, nothing computed). Every call only
dispatches: JAX orders the copies with the steps around them on the pool's buffers, so a page
freed right after `save` is rewritten only after its copy was read, and a page filled by `load`
is read by the next step only after it was written. The scheduler thread never waits on either.

Owned by the scheduler thread (like the pool and the allocator): no lock.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdtopo.kernels.xla_copy import GROUP

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16)   # rows a save or load program call moves (padded up to one)
ROWS_PER_CALL = ROW_BUCKETS[-1]   # more take several calls
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


class HostRef(NamedTuple):
    row: int


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


def _bucket(n: int) -> int:
    """Rows a program call moves for n rows (<= ROWS_PER_CALL); padding rows are dropped."""
    return next(b for b in ROW_BUCKETS if b >= n)


def _constrain(xs, sharding):
    return xs if sharding is None else tuple(jax.lax.with_sharding_constraint(x, sharding)
                                             for x in xs)


@functools.partial(jax.jit, static_argnames=("sharding",))
def _gather_rows(kv_caches: tuple, ids, sharding=None) -> tuple:
    """One row `[entries, page_size, heads, head_dim]` of this group per id, on the device."""
    stacked = jnp.stack([jnp.take(kv, ids, axis=0) for kv in kv_caches], axis=1)
    return _constrain(tuple(stacked[i] for i in range(ids.shape[0])), sharding)


@functools.partial(jax.jit, static_argnames=("sharding",), donate_argnums=(0,))
def _scatter_rows(kv_caches: tuple, rows: tuple, ids, sharding=None) -> tuple:
    """This group's pool entries with row r written at page ids[r] (ids past the pool are
    dropped); the entries are donated."""
    stacked = jnp.stack(rows)                     # [rows, entries, page_size, heads, head_dim]
    out = tuple(kv.at[ids].set(stacked[:, j], mode="drop") for j, kv in enumerate(kv_caches))
    return _constrain(out, sharding)


class HostKVTier:
    """The rows in host memory and the programs that move them (see the module docstring)."""

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
        self._groups = [slice(i, min(i + GROUP, len(pool))) for i in range(0, len(pool), GROUP)]
        # a row is sharded like a page of its group's entries
        self._device = [pool[g.start].sharding for g in self._groups]
        self._host = [s.with_memory_kind(self.memory_kind) for s in self._device]
        self._constraint = [s if isinstance(s, jax.sharding.NamedSharding) else None
                            for s in self._device]
        self.page_bytes = sum(kv.nbytes // kv.shape[0] for kv in pool)
        self._rows: dict[int, list[Any]] = {}   # row id -> its arrays in host memory, per group
        self._ids = itertools.count()
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    # ------------------------------------------------------------------ room
    @property
    def used_rows(self) -> int:
        return len(self._rows)

    def free_rows(self) -> int:
        return self.capacity - len(self._rows)

    def live_refs(self) -> set[HostRef]:
        return {HostRef(r) for r in self._rows}

    # ------------------------------------------------------------------ copies
    def save(self, pages: Sequence[int]) -> list[HostRef]:
        """Dispatch host copies of device `pages`; the caller may free them right away."""
        pages = [int(p) for p in pages]
        if len(pages) > self.free_rows():
            raise RuntimeError(f"host KV tier full: {len(pages)} rows wanted, "
                               f"{self.free_rows()} free of {self.capacity}")
        refs: list[HostRef] = []
        for chunk in _chunks(pages, ROWS_PER_CALL):
            n = len(chunk)
            ids = np.zeros(_bucket(n), np.int32)    # padding rows gather page 0, then go
            ids[:n] = chunk
            for arrays in jax.device_put(self._device_rows(ids, n), [self._host] * n):
                row = next(self._ids)
                self._rows[row] = arrays
                refs.append(HostRef(row))
            self.bytes_to_host += n * self.page_bytes
        return refs

    def _device_rows(self, ids: np.ndarray, n: int) -> list[list[Any]]:
        """The first `n` of the pages `ids` (a ROW_BUCKETS size) cut into rows on the device:
        per row, one array per group of pool entries."""
        per_group = [_gather_rows(tuple(self.runner.kv_caches[g]), ids,
                                  sharding=self._constraint[i])
                     for i, g in enumerate(self._groups)]
        return [[per_group[i][r] for i in range(len(self._groups))] for r in range(n)]

    def load(self, refs: Sequence[HostRef], pages: Sequence[int]) -> None:
        """Dispatch writes of the rows `refs` into device `pages` (only those rows move)."""
        pairs = list(zip(refs, (int(p) for p in pages), strict=True))
        num_pages = self.runner.kv_caches[0].shape[0]
        for chunk in _chunks(pairs, ROWS_PER_CALL):
            n = len(chunk)
            rows = jax.device_put([self._rows[ref.row] for ref, _ in chunk], [self._device] * n)
            rows += [rows[0]] * (_bucket(n) - n)   # padding rows: written past the pool, dropped
            ids = np.full(_bucket(n), num_pages, np.int32)
            ids[:n] = [page for _, page in chunk]
            self._scatter(rows, ids)
            self.bytes_to_device += n * self.page_bytes

    def _scatter(self, rows: list[list[Any]], ids: np.ndarray) -> None:
        pool = list(self.runner.kv_caches)
        for i, g in enumerate(self._groups):
            pool[g] = _scatter_rows(tuple(pool[g]), tuple(r[i] for r in rows), ids,
                                    sharding=self._constraint[i])
        self.runner.kv_caches = pool

    def drop(self, ref: HostRef) -> None:
        del self._rows[ref.row]   # its host arrays go with the last reference

    # ------------------------------------------------------------------ warmup
    def warmup(self) -> int:
        """Compile every program a save or a load can run (the gathers and scatters of each
        of ROW_BUCKETS rows) while the pool is idle, so that serving never compiles:
        page 1 is read into rows, sent to host memory and back, and written with its own
        bytes. Returns the most rows one call moves."""
        t0 = time.perf_counter()
        num_pages = self.runner.kv_caches[0].shape[0]
        for n in ROW_BUCKETS:
            rows = self._device_rows(np.ones(n, np.int32), n)
            rows = jax.device_put(jax.device_put(rows, [self._host] * n), [self._device] * n)
            targets = np.full(n, num_pages, np.int32)
            targets[0] = 1          # page 1 gets its own bytes back: nothing changes
            self._scatter(rows, targets)
        jax.block_until_ready(self.runner.kv_caches)
        log.info("warmed the host KV tier's copies (1..%d rows, %s) in %.2fs", ROWS_PER_CALL,
                 self.memory_kind, time.perf_counter() - t0)
        return ROWS_PER_CALL
