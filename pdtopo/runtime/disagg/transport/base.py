"""The JaxTransfer 4-tuple ABC (docs/protocol.md#abstract-roles), KVArgs and the pool transfer descriptors (docs/protocol.md#pool-descriptors).

- `PoolTransferSpec`: one KV pool a request's transfer carries (name, pool_type, dtype, per-entry
  pool shape, sharding, number of entries, metadata). Only ``pool_type="main_kv"`` is
  implemented; other types are rejected with a clear error when `KVArgs` is built.
- `KVArgs.pools: list[PoolTransferSpec]` (the list shape is accepted; exactly one main_kv).
- `PackedMeta`: the wire description of the packed arrays of one pool for one request (shape of
  each packed array, dtype, sharding as mesh axes + partition spec, and how many of its rows
  are KV pages). The arrays have `wire_rows(pages)` rows, a power of two: the pages first,
  then padding, so both sides compile one gather and one scatter per bucket of page counts,
  never one per count (the price: up to twice the pages' bytes, or 8 pages for fewer). P
  announces it in `ready`;
  D builds its own from its pool and refuses to pull unless both are equal
  (`check_packed_meta`), because jax.experimental.transfer matches buffers only by shard
  index and byte size (a mismatch is silently wrong data).
- ABCs: `BaseKVManager` (register_runner / create_sender / create_receiver),
  `BaseKVSender` (send / poll / failure_exception), `BaseKVReceiver` (init / poll /
  failure_exception), `BaseKVBootstrapServer` (start / stop / poll).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pdtopo.runtime.disagg.transport.kvpoll import KVPoll

MAIN_KV = "main_kv"


def wire_rows(num_pages: int) -> int:
    """Rows of the packed arrays that carry `num_pages` KV pages: the power-of-two bucket the
    gather and scatter programs are compiled for (pdtopo.kernels.bucket_size)."""
    from pdtopo.kernels.runs import bucket_size  # deferred: pdtopo.kernels imports JAX

    return bucket_size(int(num_pages))
SUPPORTED_POOL_TYPES = (MAIN_KV,)
KNOWN_POOL_TYPES = (MAIN_KV, "recurrent_state", "draft_kv")


class KVTransferError(RuntimeError):
    """A KV transfer failed (peer failure, timeout, mismatch, injected fault)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SpecMismatchError(KVTransferError):
    """P announced packed arrays that do not match what D's pool expects."""


# ----------------------------------------------------------------------------- sharding meta

def sharding_meta(sharding: Any) -> dict[str, Any]:
    """A JSON description of a sharding: mesh axes (name -> size), partition spec, devices."""
    import jax  # deferred: the disaggregation modules stay importable without JAX

    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = [list(s) if isinstance(s, tuple) else s for s in sharding.spec]
        return {"kind": "named", "mesh": [[str(n), int(mesh.shape[n])] for n in mesh.axis_names],
                "spec": spec, "num_devices": int(mesh.size)}
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return {"kind": "single", "mesh": [], "spec": [], "num_devices": 1}
    raise ValueError(f"unsupported KV pool sharding {type(sharding).__name__}: use NamedSharding "
                     "or SingleDeviceSharding")


def _norm_spec(spec: Sequence[Any], ndim: int) -> list[Any]:
    out = [list(s) if isinstance(s, (tuple, list)) else s for s in spec]
    return out + [None] * (ndim - len(out))


def sharding_meta_equal(a: dict[str, Any], b: dict[str, Any], ndim: int) -> bool:
    if a.get("num_devices") != b.get("num_devices"):
        return False
    if int(a.get("num_devices", 1)) == 1:
        return True  # one shard: every 1-device layout moves the same single buffer
    return (a.get("mesh") == b.get("mesh")
            and _norm_spec(a.get("spec", []), ndim) == _norm_spec(b.get("spec", []), ndim))


# ----------------------------------------------------------------------------- pool specs

@dataclass(frozen=True)
class PoolTransferSpec:
    """One pool a request transfer carries. `shape` is one entry's pool shape
    ([num_pages, page_size, heads, head_dim] for main_kv); `num_entries` arrays of it
    (2 * num_layers for main_kv)."""

    name: str
    pool_type: str
    dtype: str
    shape: tuple[int, ...]
    sharding: Any = None
    num_entries: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("PoolTransferSpec.name must be a non-empty string")
        if self.pool_type not in KNOWN_POOL_TYPES:
            raise ValueError(f"PoolTransferSpec {self.name!r}: unknown pool_type "
                             f"{self.pool_type!r} (known: {', '.join(KNOWN_POOL_TYPES)})")
        if self.pool_type == MAIN_KV and len(self.shape) != 4:
            raise ValueError(f"PoolTransferSpec {self.name!r}: main_kv shape must be "
                             f"[num_pages, page_size, heads, head_dim], got {self.shape}")
        if self.num_entries < 1:
            raise ValueError(f"PoolTransferSpec {self.name!r}: num_entries must be >= 1, "
                             f"got {self.num_entries}")

    @property
    def page_size(self) -> int:
        return int(self.shape[1])

    @classmethod
    def from_kv_caches(cls, kv_caches: Sequence[Any], name: str = MAIN_KV) -> PoolTransferSpec:
        """The main_kv spec of a pool in the documented format (list of 4-D arrays)."""
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        first = kv_caches[0]
        return cls(name=name, pool_type=MAIN_KV, dtype=str(first.dtype),
                   shape=tuple(int(d) for d in first.shape), sharding=first.sharding,
                   num_entries=len(kv_caches))

    def packed_meta(self, num_pages: int) -> PackedMeta:
        """What the packed arrays of `num_pages` pages of this pool look like."""
        return PackedMeta(name=self.name, pool_type=self.pool_type, dtype=self.dtype,
                          shape=(wire_rows(num_pages), *self.shape[1:]),
                          num_entries=self.num_entries,
                          sharding=sharding_meta(self.sharding) if self.sharding is not None
                          else {"kind": "single", "mesh": [], "spec": [], "num_devices": 1},
                          pages=int(num_pages))

    def packed_specs(self, num_pages: int) -> list[Any]:
        """ShapeDtypeStructs (with this pool's sharding) to pull `num_pages` packed pages
        (`wire_rows(num_pages)` rows each)."""
        import jax  # deferred: the disaggregation modules stay importable without JAX

        shape = (wire_rows(num_pages), *self.shape[1:])
        return [jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.sharding)
                for _ in range(self.num_entries)]


@dataclass(frozen=True)
class PackedMeta:
    """Wire description of one pool's packed arrays for one request (part of `ready`)."""

    name: str
    pool_type: str
    dtype: str
    shape: tuple[int, ...]
    num_entries: int
    sharding: dict[str, Any]
    pages: int | None = None  # KV pages in the leading rows (None: every row is one)

    def __post_init__(self) -> None:
        if self.pages is None and self.shape:  # one spelling per meaning: equal metas compare equal
            object.__setattr__(self, "pages", int(self.shape[0]))

    @property
    def page_count(self) -> int:
        return int(self.pages if self.pages is not None else 0)

    @property
    def rows(self) -> int:
        """Rows of each packed array (what is moved and held: pages and padding)."""
        return int(self.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.shape[1])

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * np.dtype(self.dtype).itemsize * self.num_entries

    @classmethod
    def from_arrays(cls, arrays: Sequence[Any], name: str = MAIN_KV,
                    pool_type: str = MAIN_KV, pages: int | None = None) -> PackedMeta:
        if not arrays:
            raise ValueError("cannot describe an empty list of packed arrays")
        first = arrays[0]
        for i, a in enumerate(arrays):
            if a.shape != first.shape or a.dtype != first.dtype:
                raise ValueError(f"packed[{i}] is {a.shape} {a.dtype}; packed[0] is "
                                 f"{first.shape} {first.dtype}")
        return cls(name=name, pool_type=pool_type, dtype=str(first.dtype),
                   shape=tuple(int(d) for d in first.shape), num_entries=len(arrays),
                   sharding=sharding_meta(first.sharding), pages=pages)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "pool_type": self.pool_type, "dtype": self.dtype,
                "shape": list(self.shape), "page_count": self.page_count,
                "page_size": self.page_size, "num_entries": self.num_entries,
                "sharding": self.sharding}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PackedMeta:
        return cls(name=d["name"], pool_type=d["pool_type"], dtype=d["dtype"],
                   shape=tuple(int(x) for x in d["shape"]), num_entries=int(d["num_entries"]),
                   sharding=dict(d["sharding"]),
                   pages=int(d["page_count"]) if d.get("page_count") is not None else None)


def check_packed_meta(announced: PackedMeta, expected: PackedMeta) -> None:
    """Raise SpecMismatchError naming the first field where P's announcement differs."""
    for fld in ("name", "pool_type", "dtype", "shape", "page_count", "num_entries"):
        a, e = getattr(announced, fld), getattr(expected, fld)
        if a != e:
            raise SpecMismatchError(
                f"pool {expected.name!r}: P announced {fld}={a!r}, this D expects {e!r}; "
                "refusing to pull (would be wrong data)", status=500)
    if not sharding_meta_equal(announced.sharding, expected.sharding, len(expected.shape)):
        raise SpecMismatchError(
            f"pool {expected.name!r}: P announced sharding {announced.sharding}, this D's pool "
            f"is sharded {expected.sharding}; refusing to pull (P and D announced equal layouts, so the shardings must match)",
            status=500)


@dataclass(frozen=True)
class KVArgs:
    """What a KV manager transfers: the list of pools (only one main_kv is implemented)."""

    pools: list[PoolTransferSpec]
    engine_rank: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.pools, (list, tuple)) or not self.pools:
            raise ValueError("KVArgs.pools must be a non-empty list of PoolTransferSpec")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"KVArgs.pools: duplicate pool names {names}")
        for p in self.pools:
            if p.pool_type not in SUPPORTED_POOL_TYPES:
                raise NotImplementedError(
                    f"KVArgs.pools: pool {p.name!r} has pool_type {p.pool_type!r}; only "
                    f"{', '.join(SUPPORTED_POOL_TYPES)} is implemented (multi-pool transfer "
                    "is future work, docs/protocol.md#pool-descriptors)")
        if sum(p.pool_type == MAIN_KV for p in self.pools) != 1:
            raise ValueError("KVArgs.pools must hold exactly one main_kv pool")

    @property
    def main(self) -> PoolTransferSpec:
        return next(p for p in self.pools if p.pool_type == MAIN_KV)


# ----------------------------------------------------------------------------- ABCs

class KVRunner(Protocol):
    """What `register_runner` needs: the pool owned by the scheduler thread."""

    kv_caches: list[Any]


class BaseKVSender(abc.ABC):
    """P side of one request (room)."""

    @abc.abstractmethod
    def send(self, kv_indices: Sequence[int], **ready_fields: Any) -> None: ...

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @property
    def last_state(self) -> KVPoll:
        """The state without driving the transport (a backend may answer from its last
        progress; this default simply polls)."""
        return self.poll()

    @abc.abstractmethod
    def failure_exception(self) -> BaseException | None: ...


class BaseKVReceiver(abc.ABC):
    """D side of one request (room)."""

    @abc.abstractmethod
    def init(self, kv_indices: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @abc.abstractmethod
    def failure_exception(self) -> BaseException | None: ...


class BaseKVManager(abc.ABC):
    """One per process; creates senders (P) and receivers (D)."""

    def __init__(self, args: KVArgs, bootstrap_addr: str | None = None) -> None:
        self.args = args
        self.bootstrap_addr = bootstrap_addr

    @abc.abstractmethod
    def register_runner(self, runner: KVRunner) -> None: ...

    @abc.abstractmethod
    def create_sender(self, room: int) -> BaseKVSender: ...

    @abc.abstractmethod
    def create_receiver(self, room: int, bootstrap_addr: str, cached_pages: int = 0,
                        prefix_hash: str | None = None) -> BaseKVReceiver: ...


class BaseKVBootstrapServer(abc.ABC):
    """The registry of P/D instances (implemented by the bootstrap server module)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...
