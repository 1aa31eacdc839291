"""JaxTransferKVManager: the abstract roles (docs/protocol.md#abstract-roles) on the transfer
engine + side channel; its senders (sender.py) and receivers (receiver.py) are one room each,
its reshard paths are resharding.py.

Everything here is called from ONE thread, the scheduler thread that owns the KV pool; no call
blocks (gathers and scatters are dispatched to the device asynchronously, pulls run on the
engine's pull_executor, ZMQ I/O on the side channel's thread).

P (prefill) scheduler, per request with bootstrap_room R:
    sender = mgr.create_sender(R)              # at request arrival; Bootstrapping
    ... prefill runs; D's `want` may arrive any time (poll() -> WaitingForInput)
    sender.send(page_ids, prompt_len=L, first_token=t0, first_logprob=lp, skip_pages=k)
        # gathers the pages (gather_fn, default pdtopo.kernels.select_from_kv_caches) into
        # packed copies, registers them for a pull (expires after sender_expiry_s) and sends
        # `ready` to D as soon as D is known. The request's pool pages can be freed right after
        # send(): the packed arrays are copies. -> Transferring
        # With a prefix cache on D, D's `want` says how many leading pages it holds
        # (sender.peer_cached_pages, sender.peer_prefix_hash): P checks the hash and passes only
        # the remaining pages, with skip_pages=k.
    each step: sender.poll() -> Success when D reports done (the packed arrays are released),
        Failed on D's failure / expiry (sender.failure_exception() says why).
    sender.abort(reason) if P itself fails the request (D is told).

D (decode) scheduler, per request with bootstrap_host H, bootstrap_port PORT, bootstrap_room R:
    recv = mgr.create_receiver(R, f"{H}:{PORT}", cached_pages=k, prefix_hash=h)
        # sends `want` to P (k: leading prompt pages D already holds); Bootstrapping
    recv.init(page_ids)        # pages preallocated for the rest of the prompt's KV
                               # -> WaitingForInput
    each step: recv.poll()     # on `ready`: checks P's announcement against the local pool and
        # pulls on the pull_executor -> Transferring; when the pull completes, poll() (on this
        # thread, the pool's owner) scatters the packed pages into runner.kv_caches with
        # scatter_fn (default pdtopo.kernels.insert_kv_chunks), tells P `done` -> Success.
        # recv.ready_info has the first token / logprob / prompt length from P.
    Failed: P's failure, pull error or timeout, or no KV within kv_timeout_s; the pages are the
        scheduler's to free; recv.failure_exception().status is an HTTP status for the client.
    recv.abort(reason) if D gives up on the request (P is told).

`mgr.progress()` (also called by every poll()) drains side-channel events and engine expiries.
Call `mgr.close()` at shutdown.

Multi-process instances: a runner with a `kv_mirror` (the leader of a multi-process instance,
`pdtopo.runtime.distributed.leader`) gets every pool operation replayed on the instance's other
processes, each on its own shards: `mirror.register` before the gather (P), `mirror.release`
when a sender ends, `mirror.pull` wraps D's pull future so it completes only when every process
pulled its shards from its P peer, `mirror.scatter` before the scatter, `mirror.drop` when a
receiver ends. Single-process runners have no mirror and none of this happens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdtopo.config.settings import check_value
from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, plan_pieces, same_layout
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.base import (
    BaseKVManager,
    KVArgs,
    KVRunner,
    KVTransferError,
    PackedMeta,
    PoolTransferSpec,
    wire_rows,
)
from pdtopo.runtime.disagg.transport.curve import deployment_keys, side_channel_curve
from pdtopo.runtime.disagg.transport.endpoint import check_endpoint
from pdtopo.runtime.disagg.transport.peer_watch import Peer, SideChannelEvent
from pdtopo.runtime.disagg.transport.receiver import JaxTransferKVReceiver
from pdtopo.runtime.disagg.transport.resharding import ReshardPaths, ScatterFn, scatter_pieces
from pdtopo.runtime.disagg.transport.sender import JaxTransferKVSender
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine
from pdtopo.runtime.worker_threads import server_fault

log = logging.getLogger(__name__)

# gather(kv_caches, page_ids) -> packed arrays of wire_rows(len(page_ids)) rows, pages first
GatherFn = Callable[[list[Any], Sequence[int]], list[Any]]


def _default_gather(kv_caches, page_ids):
    from pdtopo.kernels import select_from_kv_caches  # deferred: the kernels import JAX

    return select_from_kv_caches(kv_caches, page_ids, padded=True)


def _make_default_scatter(impl: str) -> ScatterFn:
    def scatter(kv_caches, packed, page_ids, first_row=0):
        from pdtopo.kernels import insert_kv_chunks  # deferred: the kernels import JAX

        return insert_kv_chunks(kv_caches, packed, page_ids, impl=impl, first_row=first_row)

    return scatter


def _pool_layout(spec: PoolTransferSpec) -> KVShardLayout:
    """The layout of a pool from its spec alone (heads split evenly over its devices, one
    process): what a runner without `kv_layout()` gets."""
    shards = 1
    if spec.sharding is not None:
        shards = int(getattr(spec.sharding, "num_devices", len(spec.sharding.device_set)))
    heads = int(spec.shape[2])
    return KVShardLayout(model_kv_heads=heads, pool_heads=heads, shards=shards,
                         shard_processes=(0,) * shards)


def _drained(q: Any) -> list[Any]:
    """Everything on queue `q` now (none for None), without blocking."""
    out = []
    while q is not None:
        try:
            out.append(q.get_nowait())
        except Exception:
            break
    return out


def instance_transfer_addrs(ctx: Any) -> list[str] | None:
    """The transfer address of every process of this process's instance, by process index
    (from the plan); None for a single-process instance."""
    procs = [p for p in ctx.plan.get("processes", [])
             if p.get("instance_id") == ctx.process.get("instance_id")
             and p.get("role") == ctx.role and p.get("distributed")]
    if len(procs) < 2:
        return None
    procs.sort(key=lambda p: int(p["distributed"]["process_id"]))
    return [f"{p['address']}:{int(p['ports']['transfer'])}" for p in procs]


class JaxTransferKVManager(ReshardPaths, BaseKVManager):
    """One per P or D process. Not thread-safe: call from the scheduler thread only."""

    def __init__(self, args: KVArgs, bootstrap_addr: str | None = None, *,
                 engine: JaxTransferKVEngine, channel: SideChannel, kv_timeout_s: float = 30,
                 sender_expiry_s: float = 60, gather_fn: GatherFn | None = None,
                 scatter_fn: ScatterFn | None = None, kernels_impl: str = "auto",
                 owns_transport: bool = False) -> None:
        super().__init__(args, bootstrap_addr)
        self.engine = engine
        self.channel = channel
        self.kv_timeout_s = check_value("disaggregation.kv_timeout_s", kv_timeout_s)
        self.sender_expiry_s = check_value("disaggregation.sender_expiry_s", sender_expiry_s)
        self.gather_fn = gather_fn or _default_gather
        self.scatter_fn = scatter_fn or _make_default_scatter(kernels_impl)
        self.runner: KVRunner | None = None
        self.layout = _pool_layout(args.main)  # this pool's KV shard layout (register_runner)
        self.process_index = 0  # this process in its instance (the leader, or a lone one)
        # P: the transfer address of each process of a multi-process instance (in `ready`, so
        # that a D laid out otherwise can pull pieces from each); None for one process
        self.process_transfer_addrs: list[str] | None = None
        self.mirror: Any = None  # replays pool operations on the instance's other processes
        self._owns_transport = owns_transport
        self._senders: dict[int, JaxTransferKVSender] = {}
        self._receivers: dict[int, JaxTransferKVReceiver] = {}
        self._early_wants: dict[int, tuple[Peer, float, m.Want]] = {}  # want before create_sender
        # failed before create_sender: D gave up before P's request arrived (the router posts
        # to P and D at once); P's request for that room is refused instead of prefilled
        self._early_failures: dict[int, tuple[m.Failed, float]] = {}
        self._tombstones: dict[int, tuple[m.Failed | None, float]] = {}

    @classmethod
    def from_context(cls, ctx: Any, args: KVArgs, **kw: Any) -> JaxTransferKVManager:
        """Engine + side channel from a ProcessContext (prefill binds ports.zmq)."""
        d = ctx.settings.disaggregation
        engine = JaxTransferKVEngine.from_context(ctx)
        bind = None
        if ctx.role == "prefill" or (ctx.role == "decode" and d.migration):
            # a D that migrates requests away offers their KV like P (disagg/migration.py)
            bind = f"{ctx.bind_host}:{int(ctx.ports['zmq'])}"
        curve = None
        configured = ctx.settings.server.bind_host
        hosts = [configured or p.get("address") for p in ctx.plan.get("processes", [])
                 if p.get("role") in ("prefill", "decode")] or [ctx.bind_host]
        if side_channel_curve(d.side_channel_curve, hosts):
            try:
                curve = deployment_keys(ctx.token or "")
            except ValueError as exc:
                engine.close()
                where = sorted(set(map(str, hosts)))
                raise RuntimeError(f"disaggregation.side_channel_curve="
                                   f"{d.side_channel_curve!r} (P/D listen on {where}): "
                                   f"{exc}") from None
        try:
            channel = SideChannel(bind=bind, max_bytes=d.side_channel_max_bytes,
                                  name=f"{ctx.name}-side", curve=curve,
                                  max_peers=d.side_channel_max_peers,
                                  peer_idle_s=d.side_channel_peer_idle_s,
                                  resolve_threads=d.resolve_threads,
                                  fault=server_fault(ctx.settings, "side_channel"))
        except Exception:
            engine.close()
            raise
        mgr = cls(args, ctx.bootstrap_url, engine=engine, channel=channel,
                  kv_timeout_s=d.kv_timeout_s, sender_expiry_s=d.sender_expiry_s,
                  kernels_impl=ctx.settings.kernels.impl, owns_transport=True, **kw)
        mgr.process_transfer_addrs = instance_transfer_addrs(ctx)
        return mgr

    # --------------------------------------------------------------- ABC
    def register_runner(self, runner: KVRunner) -> None:
        if not hasattr(runner, "kv_caches"):
            raise TypeError("register_runner: the runner must have a kv_caches attribute")
        self.runner = runner
        self.mirror = getattr(runner, "kv_mirror", None)
        kv_layout = getattr(runner, "kv_layout", None)
        if callable(kv_layout):
            self.layout = KVShardLayout.from_dict(kv_layout())
        mesh = getattr(runner, "mesh", None)
        if mesh is not None:
            from pdtopo.runtime.engine.mesh import local_process_index  # deferred: JAX

            self.process_index = local_process_index(mesh)

    def warmup_kernels(self, role: str, max_pages: int,
                       peer_layouts: Sequence[KVShardLayout] = ()) -> int:
        """Compile the pool gather (P) or scatter (D) for every bucket of page counts a
        request can have (`wire_rows`: the packed arrays of every count in a bucket have the
        same shape), so serving never compiles them, and the reshard cuts (P) or joins (D) for
        every peer layout in `peer_layouts` unlike this pool's. Call before serving, while
        every pool page is free: P reads pages 1..b, D writes zeros over the zeros there.
        Skipped on a multi-process instance (its other processes would have to run the same
        programs in lockstep). Returns the buckets warmed."""
        import jax  # deferred: the disaggregation modules stay importable without JAX

        if self.runner is None or self.mirror is not None:
            return 0
        spec = self.args.main
        most = min(int(max_pages), int(spec.shape[0]) - 1)
        # the largest count of each bucket that fits in the pool (pages 1.., page 0 reserved)
        counts = sorted({min(wire_rows(n), most) for n in range(1, most + 1)})
        what = "gather" if role == "prefill" else "scatter"
        for i, n in enumerate(counts, 1):
            t0 = time.perf_counter()
            pages = list(range(1, n + 1))
            if role == "prefill":
                jax.block_until_ready(self.gather_fn(self.runner.kv_caches, pages))
            else:
                zeros = [jax.device_put(np.zeros(s.shape, s.dtype), s.sharding)
                         for s in spec.packed_specs(n)]
                self.runner.kv_caches = self.scatter_fn(self.runner.kv_caches, zeros, pages, 0)
                jax.block_until_ready(self.runner.kv_caches)
            log.info("warmed KV %s %d/%d (%d wire rows) in %.2fs", what, i, len(counts),
                     wire_rows(n), time.perf_counter() - t0)
        from pdtopo.runtime.disagg.reshard.arrays import warm_cuts, zero_pieces  # deferred: JAX

        for peer in dict.fromkeys(peer_layouts):
            if same_layout(peer, self.layout):
                continue
            if role == "prefill":
                warm_cuts([wire_rows(n) for n in counts], spec, self.layout,
                          plan_pieces(self.layout, peer))
                continue
            pieces = plan_pieces(peer, self.layout)
            for n in counts:
                zeros = zero_pieces(wire_rows(n), spec, self.layout, pieces, spec.num_entries)
                self.runner.kv_caches = scatter_pieces(
                    self.runner.kv_caches, zeros, list(pieces), pieces, self.layout, spec,
                    list(range(1, n + 1)), 0, self.scatter_fn)
                jax.block_until_ready(self.runner.kv_caches)
        return len(counts)

    def create_sender(self, room: int) -> JaxTransferKVSender:
        room = self._check_room(room)
        if room in self._senders:
            raise KVTransferError(f"room {room} already has a sender")
        early_failure = self._early_failures.pop(room, None)
        if early_failure is not None:
            self._early_wants.pop(room, None)
            raise KVTransferError(f"room {room}: the decode server already failed this "
                                  f"request: {early_failure[0].reason}",
                                  status=early_failure[0].status or 502)
        s = JaxTransferKVSender(self, room)
        self._senders[room] = s
        early = self._early_wants.pop(room, None)
        if early is not None:
            s._on_want(early[0], early[2])
        return s

    def create_receiver(self, room: int, bootstrap_addr: str, cached_pages: int = 0,
                        prefix_hash: str | None = None) -> JaxTransferKVReceiver:
        room = self._check_room(room)
        if room in self._receivers:
            raise KVTransferError(f"room {room} already has a receiver")
        r = JaxTransferKVReceiver(self, room, bootstrap_addr, cached_pages, prefix_hash)
        self._receivers[room] = r
        return r

    def refuse_room(self, room: int, bootstrap_addr: str, reason: str,
                    status: int | None = 400) -> None:
        """D side, without a receiver: claim the room at P (`want`) and fail it (`failed`), so
        that P ends the room's request instead of prefilling it for nobody."""
        room = self._check_room(room)
        if room in self._receivers:
            raise KVTransferError(f"room {room} has a receiver: abort it instead")
        peer = self.channel.send_to(check_endpoint(bootstrap_addr, "bootstrap_host:"
                                                    "bootstrap_port"), m.Want(room=room))
        self.channel.send(peer, m.Failed(room=room, reason=reason, status=status))
        self.channel.forget(room)

    # --------------------------------------------------------------- driving
    def progress(self) -> None:
        """Drain side-channel events and expiries; advance receivers. Never blocks."""
        while True:
            try:
                ev = self.channel.events.get_nowait()
            except Exception:
                break
            self._dispatch(ev)
        failures = [(room, f"process {pid} of this prefill instance could not register its "
                     f"KV: {why}", 500)
                    for room, pid, why in _drained(getattr(self.mirror, "failed_rooms", None))]
        failures += [(room, f"D did not pull the KV within sender_expiry_s="
                      f"{self.sender_expiry_s:g}", 504) for room in _drained(self.engine.expired)]
        for room, why, status in failures:
            s = self._senders.get(room)
            if s is not None:
                s._fail(KVTransferError(f"room {room}: {why}", status=status), notify=True)
        now_wall, now = time.time(), time.monotonic()
        for r in list(self._receivers.values()):
            r._progress(now)
        for table in (self._early_wants, self._early_failures, self._tombstones):
            for room in [k for k, v in table.items() if v[1] <= now_wall]:
                del table[room]
                if room not in self._senders and room not in self._receivers:
                    self.channel.forget(room)

    def _dispatch(self, ev: SideChannelEvent) -> None:
        msg = ev.msg
        if isinstance(msg, m.Want):
            s = self._senders.get(msg.room)
            if s is not None:
                s._on_want(ev.peer, msg)
            elif msg.room in self._tombstones:
                failed = self._tombstones[msg.room][0] or m.Failed(
                    room=msg.room, reason="P already finished this room", status=500)
                self.channel.send(ev.peer, failed)
            else:
                self._early_wants[msg.room] = (ev.peer, time.time() + self.sender_expiry_s, msg)
        elif isinstance(msg, m.Ready):
            r = self._receivers.get(msg.room)
            if r is not None:
                r._on_ready(msg)
        elif isinstance(msg, m.Done):
            s = self._senders.get(msg.room)
            if s is not None:
                s._on_done(msg)
        elif isinstance(msg, m.Failed):
            target = self._receivers.get(msg.room) or self._senders.get(msg.room)
            if target is not None:
                target._on_failed(msg)
            elif msg.room not in self._tombstones:
                self._early_failures[msg.room] = (msg, time.time() + self.sender_expiry_s)
        else:
            log.warning("unexpected side-channel event %r", ev)

    # --------------------------------------------------------------- internals
    @staticmethod
    def _check_room(room: Any) -> int:
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= m.MAX_ROOM:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**64), got {room!r}")
        return room

    def _register(self, room: int, page_ids: list[int], prompt_len: int | None,
                  first_token: int | None, first_logprob: float | None,
                  cached_tokens: int = 0, skip_pages: int = 0,
                  p_stages: dict[str, float] | None = None,
                  peer_layout: KVShardLayout | None = None,
                  first_top_logprobs: list[list[Any]] | None = None) -> m.Ready:
        if self.runner is None:
            raise KVTransferError(f"room {room}: no runner registered (call register_runner)",
                                  status=500)
        if not page_ids:
            raise KVTransferError(f"room {room}: send() needs at least one page", status=500)
        uuid = self.engine.new_uuid()
        target = peer_layout or self.layout
        reshard = not same_layout(self.layout, target)
        pieces = plan_pieces(self.layout, target) if reshard else None
        if self.mirror is not None:  # the other processes gather + register their shards too
            self.mirror.register(room, page_ids, uuid, self.sender_expiry_s,
                                 target.to_dict() if reshard else None)
        packed = self.gather_fn(self.runner.kv_caches, page_ids)
        meta = PackedMeta.from_arrays(packed, name=self.args.main.name, pages=len(page_ids))
        if reshard:
            from pdtopo.runtime.disagg.reshard.arrays import register_parts  # deferred: JAX

            deadline = register_parts(self.engine, room, packed, self.layout, pieces,
                                      self.process_index, uuid, self.sender_expiry_s)
            if deadline is None:  # nothing registered here: no expiry would ever end the room
                raise KVTransferError(f"room {room}: this P process holds none of the pieces "
                                      f"D ({target.to_dict()}) needs", status=500)
        else:
            uuid, deadline = self.engine.register(room, packed, self.sender_expiry_s, uuid=uuid)
        return m.Ready(room=room, transfer_addr=self.engine.address, transfer_uuid=uuid,
                       expires_at=deadline, pools=(meta,),
                       prompt_len=int(prompt_len if prompt_len is not None else 0),
                       first_token=first_token, first_logprob=first_logprob,
                       first_top_logprobs=first_top_logprobs, cached_tokens=int(cached_tokens), skip_pages=int(skip_pages),
                       p_stages=dict(p_stages or {}), layout=self.layout.to_dict(),
                       transfer_addrs=self._transfer_addrs())

    def _transfer_addrs(self) -> list[str] | None:
        """P's processes' transfer addresses by index (this one as its server says)."""
        if not self.process_transfer_addrs:
            return None
        addrs = list(self.process_transfer_addrs)
        if self.process_index < len(addrs):
            addrs[self.process_index] = self.engine.address
        return addrs

    def _pull(self, msg: m.Ready, count: int, timeout_s: float, *, room: int) -> Any:
        """Start D's pull of `msg`'s KV (`count` pages); a Future of the pulled packed
        arrays."""
        fut = self.engine.pull(msg.transfer_addr, msg.transfer_uuid,
                               self.args.main.packed_specs(count), timeout_s, room=room)
        if self.mirror is not None:  # complete only when every process has its shards
            fut = self.mirror.pull(room, msg.transfer_addr, msg.transfer_uuid, count,
                                   timeout_s, fut)
        return fut

    def _scatter(self, packed: list[Any], page_ids: list[int] | None,
                 room: int | None = None, skip: int = 0) -> None:
        """Insert the pulled pages into `page_ids`, after dropping the first `skip` of them."""
        if self.runner is None:
            raise KVTransferError("no runner registered (call register_runner)")
        assert page_ids is not None
        if self.mirror is not None:
            self.mirror.scatter(room, page_ids, skip)
        self.runner.kv_caches = self.scatter_fn(self.runner.kv_caches, packed, page_ids, skip)

    def _finish_sender(self, s: JaxTransferKVSender) -> None:
        if self._senders.get(s.room) is s:
            del self._senders[s.room]
            self._tombstones[s.room] = (s.failure_msg, time.time() + self.sender_expiry_s)
            if self.mirror is not None:
                self.mirror.release(s.room)

    def _finish_receiver(self, r: JaxTransferKVReceiver) -> None:
        if self._receivers.get(r.room) is r:
            del self._receivers[r.room]
            self.channel.forget(r.room)
            if self.mirror is not None:
                self.mirror.drop(r.room)

    def num_registered(self) -> int:
        """Packed KV registrations P still holds (released on done / failure / expiry)."""
        return self.engine.num_registered()

    def num_active(self) -> tuple[int, int]:
        return len(self._senders), len(self._receivers)

    def close(self) -> None:
        if self._owns_transport:
            self.channel.close()
            self.engine.close()
