"""KV head layouts of P and D instances, and the pieces that move KV between two of them.

Pure data and functions (no JAX): both sides compute the same plan from the two layouts.

A pool is `[num_pages, page_size, pool_heads, head_dim]`, split along heads over `shards`
devices (the instance's tp). `pool_heads` is the model's KV heads times the replication
(`pdtopo.model_config.shapes.kv_replication`: pool head h holds model head h // replication),
and shard s holds pool heads [s * heads_per_shard, (s + 1) * heads_per_shard). Shard s lives
on process `shard_processes[s]` of its instance.

    p, d = KVShardLayout.from_dict(p_layout), KVShardLayout.from_dict(d_layout)
    problems = reshard_problems(p, d)      # [] when KV can move between them
    pieces = plan_pieces(p, d)             # what each D shard takes from which P shard

For every pool head D shard j holds, the plan takes the first copy of that model head on P
(shard and local head index) and merges heads that are adjacent on both sides into one
`Piece` (a head range of one P shard that lands at an offset of one D shard). So each D shard
pulls exactly the heads it holds: bytes moved equal D's pool share of the request's pages,
i.e. the KV size once when D does not replicate heads, and once per replica when it does.
P cuts the pieces from its packed copy at registration time (`arrays.cut_pieces`);
D concatenates the pieces of each of its shards (`arrays.assemble`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdtopo.runtime.engine.pool_format import POOL_FORMAT

# kv_layout keys that must be equal on both sides whatever the sharding (each a reason the KV
# bytes would mean something else); tp, kv_heads and the process split may differ
MAX_SHARDS, MAX_POOL_HEADS = 4096, 65536  # bounds on what a peer's layout may claim
INVARIANT_KEYS = ("num_entries", "page_size", "head_dim", "dtype", "model_kv_heads",
                  "partition_spec")


@dataclass(frozen=True)
class KVShardLayout:
    """How one instance splits its KV pool over devices and processes (module docstring)."""

    model_kv_heads: int
    pool_heads: int
    shards: int
    shard_processes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.model_kv_heads < 1 or self.shards < 1:
            raise ValueError(f"KV layout: model_kv_heads={self.model_kv_heads} and "
                             f"shards={self.shards} must be >= 1")
        if self.pool_heads < max(self.shards, self.model_kv_heads):
            raise ValueError(f"KV layout: pool_heads={self.pool_heads} must be at least the "
                             f"shards ({self.shards}) and the model's KV heads "
                             f"({self.model_kv_heads})")
        if self.pool_heads % self.model_kv_heads or self.pool_heads % self.shards:
            raise ValueError(f"KV layout: pool_heads={self.pool_heads} must be a multiple of "
                             f"model_kv_heads={self.model_kv_heads} and of shards={self.shards}")
        if len(self.shard_processes) != self.shards:
            raise ValueError(f"KV layout: shard_processes has {len(self.shard_processes)} "
                             f"entries for {self.shards} shards")
        if any(not 0 <= p < self.shards for p in self.shard_processes):
            raise ValueError(f"KV layout: shard_processes {list(self.shard_processes)} must "
                             f"be process indices in [0, {self.shards})")

    @property
    def replication(self) -> int:
        return self.pool_heads // self.model_kv_heads

    @property
    def heads_per_shard(self) -> int:
        return self.pool_heads // self.shards

    @property
    def num_processes(self) -> int:
        return len(set(self.shard_processes))

    def model_head(self, pool_head: int) -> int:
        return pool_head // self.replication

    def first_copy(self, model_head: int) -> tuple[int, int]:
        """(shard, local head index) of the first pool copy of `model_head`."""
        return divmod(model_head * self.replication, self.heads_per_shard)

    @classmethod
    def from_dict(cls, layout: Mapping[str, Any]) -> KVShardLayout:
        """From a runner's `kv_layout()` (or the `layout` of a side-channel message)."""
        shards, pool_heads = int(layout["tp"]), int(layout["kv_heads"])
        if not 0 < shards <= MAX_SHARDS or not 0 < pool_heads <= MAX_POOL_HEADS:
            raise ValueError(f"KV layout: tp={shards} must be in [1, {MAX_SHARDS}] and "
                             f"kv_heads={pool_heads} in [1, {MAX_POOL_HEADS}]")
        procs = layout.get("shard_processes")
        if procs is None:  # one process, or evenly split
            n = int(layout.get("num_processes", 1))
            procs = [s * n // shards for s in range(shards)]
        if not isinstance(procs, (list, tuple)) or \
                not all(isinstance(p, int) and not isinstance(p, bool) for p in procs):
            raise ValueError(f"KV layout: shard_processes must be a list of integers, got "
                             f"{procs!r}"[:200])
        return cls(model_kv_heads=int(layout.get("model_kv_heads", pool_heads)),
                   pool_heads=pool_heads, shards=shards, shard_processes=tuple(procs))

    def to_dict(self) -> dict[str, Any]:
        return {"model_kv_heads": self.model_kv_heads, "kv_heads": self.pool_heads,
                "tp": self.shards, "shard_processes": list(self.shard_processes)}


@dataclass(frozen=True)
class Piece:
    """Heads [p_start, p_start + heads) of P shard `p_shard`, landing at heads
    [d_offset, d_offset + heads) of D shard `d_shard`."""

    d_shard: int
    d_offset: int
    p_shard: int
    p_start: int
    heads: int
    p_process: int
    d_process: int

    def whole_p_shard(self, p: KVShardLayout) -> bool:
        return self.p_start == 0 and self.heads == p.heads_per_shard


def same_layout(p: KVShardLayout, d: KVShardLayout) -> bool:
    """Shard i of P is shard i of D, on process i of each: the arrays move as they are."""
    return (p.shards, p.pool_heads, p.shard_processes) == \
        (d.shards, d.pool_heads, d.shard_processes)


def reshard_problems(p: KVShardLayout, d: KVShardLayout) -> list[str]:
    """Why KV cannot move from P's layout to D's ([] when it can)."""
    problems = []
    if p.model_kv_heads != d.model_kv_heads:
        problems.append(f"model KV heads: P has {p.model_kv_heads}, D has {d.model_kv_heads}")
    return problems


def layout_problems(mine: Mapping[str, Any], peer: Mapping[str, Any]) -> list[str]:
    """Differences between two runners' `kv_layout()` dicts that make KV exchange unsafe:
    the invariant keys, then whether a reshard exists between the two shardings."""
    problems = []
    ours, theirs = mine.get("pool_format", POOL_FORMAT), peer.get("pool_format", POOL_FORMAT)
    if ours != theirs:
        problems.append(f"kv_layout.pool_format: this server stores its KV pool as {ours!r}, "
                        f"the peer as {theirs!r}: KV pages cannot move between them (run P "
                        "and D of one pdtopo version)")
    for key in INVARIANT_KEYS:
        a, b = mine.get(key), peer.get(key)
        if a != b:
            problems.append(f"kv_layout.{key}: this server has {a!r}, peer has {b!r}")
    if problems:
        return problems
    try:
        ours, theirs = KVShardLayout.from_dict(mine), KVShardLayout.from_dict(peer)
    except (KeyError, TypeError, ValueError) as exc:
        return [f"kv_layout: cannot read the shard layouts ({exc})"]
    return [f"kv_layout: {p}" for p in reshard_problems(theirs, ours)]


def plan_pieces(p: KVShardLayout, d: KVShardLayout) -> tuple[Piece, ...]:
    """The pieces that fill every D shard from P (ordered by D shard, then head offset)."""
    problems = reshard_problems(p, d)
    if problems:
        raise ValueError("; ".join(problems))
    pieces: list[Piece] = []
    for d_shard in range(d.shards):
        for off in range(d.heads_per_shard):
            model_head = d.model_head(d_shard * d.heads_per_shard + off)
            p_shard, p_local = p.first_copy(model_head)
            last = pieces[-1] if pieces else None
            if (last is not None and last.d_shard == d_shard and last.p_shard == p_shard
                    and last.d_offset + last.heads == off
                    and last.p_start + last.heads == p_local):
                pieces[-1] = Piece(d_shard, last.d_offset, p_shard, last.p_start,
                                   last.heads + 1, last.p_process, last.d_process)
            else:
                pieces.append(Piece(d_shard, off, p_shard, p_local, 1,
                                    p.shard_processes[p_shard], d.shard_processes[d_shard]))
    return tuple(pieces)


def moved_heads(pieces: Iterable[Piece]) -> int:
    """Pool heads (of one page of one entry) the pieces carry."""
    return sum(pc.heads for pc in pieces)


def instance_layouts(plan_processes: Iterable[Mapping[str, Any]], role: str,
                     model_kv_heads: int,
                     pool_heads_for_tp: Any) -> dict[str, KVShardLayout | None]:
    """instance_id -> layout of every `role` instance of a plan (its processes' mesh tp and
    process count); `pool_heads_for_tp(tp)` gives the pool heads an engine of that tp holds,
    or None where the model cannot be split over tp (that instance's layout is None)."""
    out: dict[str, KVShardLayout | None] = {}
    for proc in plan_processes:
        if proc.get("role") != role or proc.get("instance_id") in out:
            continue
        tp = int((proc.get("mesh") or {}).get("tp", 1))
        n = int((proc.get("distributed") or {}).get("num_processes", 1))
        heads = pool_heads_for_tp(tp)
        if heads is None:
            out[str(proc.get("instance_id"))] = None
            continue
        out[str(proc.get("instance_id"))] = KVShardLayout(
            model_kv_heads=int(model_kv_heads), pool_heads=int(heads),
            shards=tp, shard_processes=tuple(s * n // tp for s in range(tp)))
    return out
