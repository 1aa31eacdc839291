"""The manager's reshard paths: moving KV between a P and a D laid out differently (another
tp, process count or chips per process; the plan is pdtopo.runtime.disagg.reshard.layout).

    P: the manager's _register cuts D's pieces when D's want named its layout first; `_recut` cuts them from
       a registration made for P's own layout when the want came later
    D: _check_reshard_meta (P's announcement, where only the heads may differ)
       -> _pull_reshard (this process's pieces, from every P process holding some)
       -> _scatter_reshard -> scatter_pieces (straight into head ranges of the pool, or joined
          into packed arrays first for the ordinary scatter)

`ReshardPaths` is a part of `JaxTransferKVManager` (manager.py); `scatter_pieces` is also what a
multi-process instance's followers run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, plan_pieces, same_layout
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.base import (
    KVTransferError,
    PackedMeta,
    PoolTransferSpec,
    SpecMismatchError,
    wire_rows,
)

log = logging.getLogger(__name__)

# scatter(kv_caches, packed, page_ids, first_row) -> the pool with rows first_row.. written
ScatterFn = Callable[[list[Any], list[Any], Sequence[int], int], list[Any]]


def scatter_pieces(kv_caches: list[Any], pulled: list[Any], mine: list[Any],
                   pieces: tuple[Any, ...], layout: KVShardLayout, pool: PoolTransferSpec,
                   page_ids: list[int], skip: int, scatter_fn: ScatterFn) -> list[Any]:
    """The pool with a reshard's pulled pieces (`mine`, this process's) written at `page_ids`.
    When every D shard takes the same pieces (decided on the whole plan, so that every process
    of a multi-process D runs the same program) they go straight into head ranges of the pool
    (`insert_kv_pieces`); otherwise they are joined into packed arrays first (`assemble`) and
    go through `scatter_fn`."""
    from pdtopo.kernels import insert_kv_pieces  # deferred: JAX
    from pdtopo.runtime.disagg.reshard.arrays import assemble, piece_slots, slot_offsets

    offsets = slot_offsets(pieces, layout)
    if offsets is None:
        packed = assemble(pulled, mine, layout, pool.sharding, pool.num_entries)
        return scatter_fn(kv_caches, packed, page_ids, skip)
    slots = piece_slots(pulled, mine, layout, pool.sharding, pool.num_entries)
    return insert_kv_pieces(kv_caches, slots, page_ids, offsets, first_row=skip)


class ReshardPaths:
    """The reshard half of `JaxTransferKVManager`: reads its `args`, `layout`, `engine`,
    `mirror`, `runner`, `scatter_fn`, `process_index` and `sender_expiry_s`."""

    def _recut(self, room: int, ready: m.Ready, sent_for: KVShardLayout,
               target: KVShardLayout) -> m.Ready:
        """P: the room's KV was registered for `sent_for` before D's want said D is laid out
        `target`: register `target`'s pieces of it under a new uuid. The first registration
        stays in the transfer server until it expires (sender_expiry_s): P waits for D's
        layout when its plan has decode instances laid out otherwise, so this is rare."""
        from pdtopo.runtime.disagg.reshard.arrays import register_parts  # deferred: JAX

        if not same_layout(sent_for, self.layout):
            raise KVTransferError(f"room {room}: D is laid out {target.to_dict()}; P "
                                  "registered the KV for another layout before D said so and "
                                  "cannot cut it again", status=500)
        packed = self.engine.registered_arrays(room)
        if packed is None:
            raise KVTransferError(f"room {room}: P's registration of this KV is gone "
                                  "(expired)", status=504)
        pieces = plan_pieces(self.layout, target)
        self.engine.release(room)
        uuid = self.engine.new_uuid()
        if self.mirror is not None:  # the other processes cut their registrations too
            self.mirror.recut(room, uuid, self.sender_expiry_s, target.to_dict())
        deadline = register_parts(self.engine, room, packed, self.layout, pieces,
                                  self.process_index, uuid, self.sender_expiry_s)
        if deadline is None:
            raise KVTransferError(f"room {room}: this P process holds none of the pieces "
                                  f"D ({target.to_dict()}) needs", status=500)
        log.warning("room %s: D's want came after P registered the KV; registered D's layout "
                    "%s again (the first registration waits for its expiry)", room,
                    target.to_dict())
        return replace(ready, transfer_uuid=uuid, expires_at=deadline)

    def _check_reshard_meta(self, announced: PackedMeta, p_layout: KVShardLayout,
                            count: int) -> None:
        """D: P's announcement against this pool, where only the heads may differ."""
        main = self.args.main
        expected = main.packed_meta(count)
        shape, want = announced.shape, expected.shape
        problems = [f"{f}={getattr(announced, f)!r} (this D: {getattr(expected, f)!r})"
                    for f in ("name", "pool_type", "dtype", "num_entries")
                    if getattr(announced, f) != getattr(expected, f)]
        if len(shape) != 4 or (shape[0], shape[1], shape[3]) != (want[0], want[1], want[3]):
            problems.append(f"shape={shape} (this D: {want}; heads may differ)")
        elif shape[2] != p_layout.pool_heads:
            problems.append(f"{shape[2]} heads for a layout of {p_layout.pool_heads}")
        if int(announced.sharding.get("num_devices", 1)) != p_layout.shards:
            problems.append(f"sharding over {announced.sharding.get('num_devices')} devices "
                            f"for a layout of {p_layout.shards} shards")
        if problems:
            raise SpecMismatchError(f"pool {main.name!r}: P announced " + ", ".join(problems)
                                    + "; refusing to pull (would be wrong data)", status=500)

    def _pull_reshard(self, msg: m.Ready, p_layout: KVShardLayout, count: int,
                      timeout_s: float, *, room: int) -> tuple[Any, list[Any], tuple[Any, ...]]:
        """D: pull this process's pieces of `msg`'s KV from every P process holding some
        (and have the instance's other processes pull theirs); (Future of the pulled pieces,
        this process's pieces, every piece of the plan)."""
        from pdtopo.runtime.disagg.reshard.arrays import (  # deferred: JAX
            piece_specs,
            pieces_of_d_process,
            pull_parts,
        )

        main = self.args.main
        try:
            pieces = plan_pieces(p_layout, self.layout)
        except Exception as exc:  # noqa: BLE001 - a layout P announced: report, never crash
            raise KVTransferError(f"room {room}: no reshard from P's layout "
                                  f"{p_layout.to_dict()}: {exc}", status=500) from None
        mine = pieces_of_d_process(pieces, self.process_index)
        p_addrs = list(msg.transfer_addrs or [msg.transfer_addr])

        def specs_of(group: list[Any]) -> list[Any]:
            return piece_specs(wire_rows(count), main.page_size, main.shape[3], main.dtype,
                               main.num_entries, group, main.sharding, self.layout)

        try:
            fut = pull_parts(self.engine, room, p_addrs, msg.transfer_uuid, mine,
                             self.process_index, main.num_entries, specs_of, timeout_s)
        except Exception as exc:  # noqa: BLE001 - what P announced: report, never crash
            raise KVTransferError(f"room {room}: {exc}", status=500) from None
        if self.mirror is not None:  # complete only when every process has its pieces
            fut = self.mirror.pull(room, msg.transfer_addr, msg.transfer_uuid, count,
                                   timeout_s, fut, reshard={"p_layout": p_layout.to_dict(),
                                                            "p_addrs": p_addrs})
        return fut, mine, pieces

    def _scatter_reshard(self, pulled: list[Any], mine: list[Any], pieces: tuple[Any, ...],
                         page_ids: list[int] | None, room: int | None = None,
                         skip: int = 0) -> None:
        """D: insert a reshard's pulled pieces into `page_ids` (after dropping `skip` leading
        pages): see `scatter_pieces`."""
        if self.runner is None:
            raise KVTransferError("no runner registered (call register_runner)")
        assert page_ids is not None
        if self.mirror is not None:
            self.mirror.scatter(room, page_ids, skip)
        self.runner.kv_caches = scatter_pieces(self.runner.kv_caches, pulled, mine, pieces,
                                               self.layout, self.args.main, page_ids, skip,
                                               self.scatter_fn)
