"""JaxTransferKVManager / Sender / Receiver: the abstract roles (docs/protocol.md#abstract-roles) on the transfer engine + side channel.

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
from dataclasses import replace
from typing import Any

import numpy as np

from pdtopo.config.settings import check_value
from pdtopo.runtime.disagg import messages as m
from pdtopo.runtime.disagg.base import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVRunner,
    KVTransferError,
    PackedMeta,
    PoolTransferSpec,
    SpecMismatchError,
    check_packed_meta,
    wire_rows,
)
from pdtopo.runtime.disagg.curve import deployment_keys, side_channel_curve
from pdtopo.runtime.disagg.kvpoll import KVPoll, KVPollState
from pdtopo.runtime.disagg.reshard import KVShardLayout, plan_pieces, same_layout
from pdtopo.runtime.disagg.side_channel import Peer, SideChannel, SideChannelEvent
from pdtopo.runtime.disagg.transfer_engine import JaxTransferKVEngine
from pdtopo.runtime.engine.request import bootstrap_host_problem
from pdtopo.runtime.engine.step_errors import device_state_lost, is_device_error
from pdtopo.runtime.worker_threads import server_fault

log = logging.getLogger(__name__)

# gather(kv_caches, page_ids) -> packed arrays of wire_rows(len(page_ids)) rows, pages first
GatherFn = Callable[[list[Any], Sequence[int]], list[Any]]
# scatter(kv_caches, packed, page_ids, first_row) -> the pool with rows first_row.. written
ScatterFn = Callable[[list[Any], list[Any], Sequence[int], int], list[Any]]


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


def scatter_pieces(kv_caches: list[Any], pulled: list[Any], mine: list[Any],
                   pieces: tuple[Any, ...], layout: KVShardLayout, pool: PoolTransferSpec,
                   page_ids: list[int], skip: int, scatter_fn: ScatterFn) -> list[Any]:
    """The pool with a reshard's pulled pieces (`mine`, this process's) written at `page_ids`.
    When every D shard takes the same pieces (decided on the whole plan, so that every process
    of a multi-process D runs the same program) they go straight into head ranges of the pool
    (`insert_kv_pieces`); otherwise they are joined into packed arrays first (`assemble`) and
    go through `scatter_fn`."""
    from pdtopo.kernels import insert_kv_pieces  # deferred: JAX
    from pdtopo.runtime.disagg.reshard_arrays import assemble, piece_slots, slot_offsets

    offsets = slot_offsets(pieces, layout)
    if offsets is None:
        packed = assemble(pulled, mine, layout, pool.sharding, pool.num_entries)
        return scatter_fn(kv_caches, packed, page_ids, skip)
    slots = piece_slots(pulled, mine, layout, pool.sharding, pool.num_entries)
    return insert_kv_pieces(kv_caches, slots, page_ids, offsets, first_row=skip)


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


def _check_endpoint(addr: str, what: str) -> str:
    host, _, port = str(addr).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port, got {addr!r}")
    why = bootstrap_host_problem(host)  # checked before any socket is opened for it
    if why is not None:
        raise ValueError(f"{what}: the host {why}, got {addr!r}")
    return f"{host}:{int(port)}"


class _RoomEndpoint:
    """What a sender and a receiver share: the room's KVPoll state, driven by the manager.
    `abort` gives up on the room and tells the peer (which then frees what it holds)."""

    mgr: JaxTransferKVManager
    room: int
    _state: KVPollState

    def poll(self) -> KVPoll:
        self.mgr.progress()
        return self._state.state

    @property
    def last_state(self) -> KVPoll:
        """The state as of the manager's last `progress()` (no side-channel work: for loops
        over many rooms right after one `mgr.progress()`)."""
        return self._state.state

    def failure_exception(self) -> BaseException | None:
        return self._state.error

    def abort(self, reason: str, status: int | None = 500) -> None:
        self._fail(KVTransferError(f"room {self.room}: {reason}", status=status), notify=True)

    def _fail(self, exc: KVTransferError, *, notify: bool) -> None:
        raise NotImplementedError


class JaxTransferKVSender(_RoomEndpoint, BaseKVSender):
    """P side of one room (create with `JaxTransferKVManager.create_sender`)."""

    def __init__(self, mgr: JaxTransferKVManager, room: int) -> None:
        self.mgr = mgr
        self.room = room
        self._state = KVPollState(KVPoll.Bootstrapping, label=f"sender room {room}")
        self.peer: Peer | None = None
        self.ready_msg: m.Ready | None = None
        self.failure_msg: m.Failed | None = None
        self.peer_cached_pages = 0             # D's prefix-cache claim (from its `want`)
        self.peer_prefix_hash: str | None = None
        self.peer_layout: KVShardLayout | None = None  # D's KV shard layout (its `want`)
        self.sent_for: KVShardLayout | None = None     # the layout the registration is cut for
        self.times: dict[str, float] = {}      # stage -> time.monotonic() (pd_metrics)

    def send(self, kv_indices: Sequence[int], *, prompt_len: int | None = None,
             first_token: int | None = None, first_logprob: float | None = None,
             first_top_logprobs: list[list[Any]] | None = None,
             cached_tokens: int = 0, skip_pages: int = 0,
             p_stages: dict[str, float] | None = None) -> None:
        """Register `kv_indices` (the prompt's pages after the first `skip_pages`, which D
        holds) for D's pull and announce them in `ready`."""
        if self._state.state.terminal:
            raise KVTransferError(f"room {self.room}: send() on a {self._state.state.name} sender")
        if self.ready_msg is not None:
            raise KVTransferError(f"room {self.room}: send() called twice")
        try:
            self.sent_for = self.peer_layout or self.mgr.layout
            self.ready_msg = self.mgr._register(self.room, list(kv_indices), prompt_len,
                                                first_token, first_logprob, cached_tokens,
                                                skip_pages, p_stages or {}, self.sent_for,
                                                first_top_logprobs=first_top_logprobs)
        except Exception as e:
            err = e if isinstance(e, KVTransferError) else KVTransferError(
                f"room {self.room}: preparing KV for transfer failed: {e}", status=500)
            self._fail(err, notify=True)
            return
        self._state.advance(KVPoll.Transferring)
        if self.peer is not None:
            self.mgr.channel.send(self.peer, self._ready_to_send())
            self.times["ready_sent"] = time.monotonic()

    def _ready_to_send(self) -> m.Ready:
        """`ready` with P's last stage (prefill done -> now) added to its p_stages."""
        msg, done = self.ready_msg, self.times.get("prefill_done")
        assert msg is not None
        if done is None:
            return msg
        return replace(msg, p_stages={**msg.p_stages, "send": max(0.0, time.monotonic() - done)})


    # --------------------------------------------------------------- manager callbacks
    def _on_want(self, peer: Peer, want: m.Want | None = None) -> None:
        self.peer = peer
        if want is not None and self.ready_msg is None:
            self.peer_cached_pages, self.peer_prefix_hash = want.cached_pages, want.prefix_hash
            if want.layout is not None:
                self.peer_layout = KVShardLayout.from_dict(want.layout)
        elif want is not None and want.layout is not None and self.sent_for is not None and \
                not self._state.state.terminal and \
                not same_layout(self.sent_for, KVShardLayout.from_dict(want.layout)):
            # registered (for P's own layout) before D said it is laid out otherwise: cut
            # D's pieces from that registration and register them instead
            layout = KVShardLayout.from_dict(want.layout)
            try:
                self.ready_msg = self.mgr._recut(self.room, self.ready_msg, self.sent_for,
                                                 layout)
                self.sent_for = layout
            except Exception as e:
                err = e if isinstance(e, KVTransferError) else KVTransferError(
                    f"room {self.room}: cutting KV for D's layout failed: {e}", status=500)
                self._fail(err, notify=False)
                self.mgr.channel.send(peer, self.failure_msg)
                return
        st = self._state.state
        if st == KVPoll.Bootstrapping:
            self._state.advance(KVPoll.WaitingForInput)
        if self.ready_msg is not None and not st.terminal:
            self.mgr.channel.send(peer, self._ready_to_send())
            self.times.setdefault("ready_sent", time.monotonic())
        elif self.failure_msg is not None:
            self.mgr.channel.send(peer, self.failure_msg)

    def _on_done(self, msg: m.Done) -> None:
        if msg.ok and self.ready_msg is not None:
            self.times["done"] = time.monotonic()
            self.mgr.engine.release(self.room)
            self._state.advance(KVPoll.Success)
            self.mgr._finish_sender(self)
        else:
            reason = msg.reason or "D reported the transfer failed"
            self._fail(KVTransferError(f"room {self.room}: {reason}", status=502), notify=False)

    def _on_failed(self, msg: m.Failed) -> None:
        self._fail(KVTransferError(f"room {self.room}: D failed: {msg.reason}",
                                   status=msg.status), notify=False)

    def _fail(self, exc: KVTransferError, *, notify: bool) -> None:
        if not self._state.fail(exc):
            return
        self.mgr.engine.release(self.room)
        self.failure_msg = m.Failed(room=self.room, reason=str(exc), status=exc.status)
        if notify and self.peer is not None:
            self.mgr.channel.send(self.peer, self.failure_msg)
        self.mgr._finish_sender(self)


class JaxTransferKVReceiver(_RoomEndpoint, BaseKVReceiver):
    """D side of one room (create with `JaxTransferKVManager.create_receiver`)."""

    def __init__(self, mgr: JaxTransferKVManager, room: int, bootstrap_addr: str,
                 cached_pages: int = 0, prefix_hash: str | None = None) -> None:
        self.mgr = mgr
        self.room = room
        self.bootstrap_addr = _check_endpoint(bootstrap_addr, "bootstrap_host:bootstrap_port")
        self._state = KVPollState(KVPoll.Bootstrapping, label=f"receiver room {room}")
        # The KV timeout runs from the request's arrival; init() extends it when pages only
        # came later (time spent waiting for free pages is queueing, not a lost transfer).
        self.deadline = time.monotonic() + mgr.kv_timeout_s
        self.page_ids: list[int] | None = None
        self.ready_info: m.Ready | None = None
        self._future = None
        self.cached_pages = int(cached_pages)   # leading prompt pages D holds (prefix cache)
        self.pulled_pages = 0
        self.pulled_bytes = 0
        self._drop = 0                           # leading pulled pages D already holds
        self.times: dict[str, float] = {}        # stage -> time.monotonic() (pd_metrics)
        # a reshard: (this process's pieces, every D process's pieces)
        self._reshard: tuple[list[Any], tuple[Any, ...]] | None = None
        self.peer = mgr.channel.send_to(self.bootstrap_addr, m.Want(
            room=room, cached_pages=self.cached_pages,
            prefix_hash=prefix_hash if self.cached_pages else None,
            layout=mgr.layout.to_dict()))

    def init(self, kv_indices: Sequence[int]) -> None:
        """Give the pages preallocated for this room's KV (in the order P sends them): every
        prompt page after the `cached_pages` D holds."""
        if self.page_ids is not None:
            raise KVTransferError(f"room {self.room}: init() called twice")
        self.page_ids = [int(i) for i in kv_indices]
        self.times["pages"] = time.monotonic()
        self.deadline = max(self.deadline, time.monotonic() + self.mgr.kv_timeout_s)
        if self._state.state.terminal:
            return
        self._state.advance(KVPoll.WaitingForInput)
        if self.ready_info is not None:
            self._start_pull()


    # --------------------------------------------------------------- manager callbacks
    def _on_ready(self, msg: m.Ready) -> None:
        if self.ready_info is not None or self._state.state.terminal:
            return  # P re-sent ready (answering a repeated want): never pull a uuid twice
        self.ready_info = msg
        self.times["ready"] = time.monotonic()
        if self.page_ids is not None:
            self._start_pull()

    def _on_failed(self, msg: m.Failed) -> None:
        self._fail(KVTransferError(f"room {self.room}: P failed: {msg.reason}",
                                   status=msg.status or 502), notify=False)

    def _start_pull(self) -> None:
        msg, pages = self.ready_info, self.page_ids
        assert msg is not None and pages is not None
        try:
            main = self.mgr.args.main
            announced = [p for p in msg.pools if p.pool_type == main.pool_type]
            if len(msg.pools) != 1 or len(announced) != 1:
                raise KVTransferError(
                    f"room {self.room}: P announced pools {[p.name for p in msg.pools]}; this D "
                    f"transfers exactly one {main.pool_type} pool", status=500)
            if not 0 <= msg.skip_pages <= self.cached_pages:
                raise KVTransferError(
                    f"room {self.room}: P skipped {msg.skip_pages} leading pages, D holds "
                    f"{self.cached_pages}", status=500)
            # P sent `extra` pages D already holds (D's want reached P after P's send): they
            # are pulled and dropped before the scatter, never written over D's cached pages
            extra = self.cached_pages - msg.skip_pages
            count = len(pages) + extra
            if announced[0].page_count != count:
                raise KVTransferError(
                    f"room {self.room}: P sends {announced[0].page_count} pages, D preallocated "
                    f"{len(pages)} (after the {self.cached_pages} it holds; P skipped "
                    f"{msg.skip_pages})", status=500)
            p_layout = self.mgr.layout if msg.layout is None else \
                KVShardLayout.from_dict(msg.layout)
            reshard = not same_layout(p_layout, self.mgr.layout)
            if reshard:
                self.mgr._check_reshard_meta(announced[0], p_layout, count)
            else:
                check_packed_meta(announced[0], main.packed_meta(count))
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise KVTransferError(f"room {self.room}: KV deadline passed before the pull",
                                      status=504)
            self._drop = extra
            self.pulled_pages = count
            self.times["pull_start"] = time.monotonic()
            if reshard:
                self._future, mine, pieces = self.mgr._pull_reshard(
                    msg, p_layout, count, remaining, room=self.room)
                self._reshard = (mine, pieces)
            else:
                self._future = self.mgr._pull(msg, count, remaining, room=self.room)
            if hasattr(self._future, "add_done_callback"):  # the pull thread's own end time
                self._future.add_done_callback(self._pulled)
        except Exception as e:  # whatever P announced, the scheduler thread goes on
            err = e if isinstance(e, KVTransferError) else KVTransferError(
                f"room {self.room}: cannot pull what P announced: {e!r}", status=500)
            self._fail(err, notify=True)
            return
        self._state.advance(KVPoll.Transferring)

    def _progress(self, now: float) -> None:
        st = self._state.state
        if st.terminal:
            return
        if self._future is not None:
            if not self._future.done():
                return
            exc = self._future.exception()
            if exc is not None:
                err = exc if isinstance(exc, KVTransferError) else KVTransferError(
                    f"room {self.room}: {exc}", status=502)
                self._fail(err, notify=True)
                return
            self.times.setdefault("pull_end", now)
            try:
                packed = self._future.result()
                self.pulled_bytes = sum(int(a.nbytes) for a in packed)
                if self._reshard is not None:
                    self.mgr._scatter_reshard(packed, *self._reshard, self.page_ids,
                                              room=self.room, skip=self._drop)
                else:
                    self.mgr._scatter(packed, self.page_ids, room=self.room, skip=self._drop)
            except Exception as e:
                if is_device_error(e) or device_state_lost(
                        getattr(self.mgr.runner, "kv_caches", None) or ()):
                    raise  # the pool went with it: the scheduler ends the process
                self._fail(KVTransferError(f"room {self.room}: inserting the pulled KV into "
                                           f"the pool failed: {e}", status=500), notify=True)
                return
            self._future = None
            self.times["scattered"] = time.monotonic()
            self.mgr.channel.send(self.peer, m.Done(room=self.room, ok=True))
            self._state.advance(KVPoll.Success)
            self.mgr._finish_receiver(self)
        elif now >= self.deadline:
            what = "no ready from P" if self.ready_info is None else "no free pages at D"
            self._fail(KVTransferError(
                f"room {self.room}: KV from P at {self.bootstrap_addr} did not arrive within "
                f"kv_timeout_s={self.mgr.kv_timeout_s:g} ({what})", status=504), notify=True)

    def _pulled(self, _future: Any) -> None:
        self.times.setdefault("pull_end", time.monotonic())  # a float store: thread-safe

    def _fail(self, exc: KVTransferError, *, notify: bool) -> None:
        if not self._state.fail(exc):
            return
        log.warning("%s", exc)
        if notify:
            self.mgr.channel.send(self.peer, m.Failed(room=self.room, reason=str(exc),
                                                      status=exc.status))
        self.mgr._finish_receiver(self)


class JaxTransferKVManager(BaseKVManager):
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
        if ctx.role == "prefill":
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
        from pdtopo.runtime.disagg.reshard_arrays import warm_cuts, zero_pieces  # deferred: JAX

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
        peer = self.channel.send_to(_check_endpoint(bootstrap_addr, "bootstrap_host:"
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
            from pdtopo.runtime.disagg.reshard_arrays import register_parts  # deferred: JAX

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

    def _recut(self, room: int, ready: m.Ready, sent_for: KVShardLayout,
               target: KVShardLayout) -> m.Ready:
        """P: the room's KV was registered for `sent_for` before D's want said D is laid out
        `target`: register `target`'s pieces of it under a new uuid. The first registration
        stays in the transfer server until it expires (sender_expiry_s): P waits for D's
        layout when its plan has decode instances laid out otherwise, so this is rare."""
        from pdtopo.runtime.disagg.reshard_arrays import register_parts  # deferred: JAX

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
        from pdtopo.runtime.disagg.reshard_arrays import (  # deferred: JAX
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
