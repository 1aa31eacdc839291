"""JaxTransferKVEngine: the process's jax.experimental.transfer server, P and D halves.

One engine per process. It owns the transfer server (started on the process's transfer
address with `transfer_sockets` transport sockets, a small staging `transfer_size` and, where
`raw_buffers` resolves true, sends straight from the arrays' own buffers instead of staging
copies), a cache of connections to peers, and the bookkeeping of what P has registered.

P (scheduler thread):  uuid, deadline = engine.register(room, packed_arrays, expire_s)
                       ... engine.release(room) on done / failure
                       the housekeeping thread frees rooms past their deadline (their room ids
                       are put on `engine.expired`) and issues a tiny await_pull with an
                       immediate timeout every `sweep_interval_s`: that is what makes the
                       transfer server process its own expiries (it only does so on activity).
D (any thread):        fut = engine.pull(peer_transfer_addr, uuid, specs, timeout_s, room=room)
                       -> concurrent.futures.Future of the pulled (ready) arrays.
                       A `pull_executor` thread runs conn.pull and waits until every array
                       is ready; the engine's own deadline (a watchdog on the housekeeping
                       thread, 50 ms resolution) wraps it (the library can hang
                       forever on a dead peer or an unknown uuid). On timeout the connection is
                       poisoned and dropped from the cache and the future fails with
                       `KVTransferTimeout` naming room and peer. Any error drops the connection
                       so the next pull reconnects; a cached connection found closed (its P
                       restarted at the same address) is replaced and the pull retried once.

Specs must equal what P announced (shape, dtype, sharding): the transfer matches raw shard
buffers by index and size only. The caller checks that (base.check_packed_meta) before pulling.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import itertools
import logging
import math
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdtopo.config.settings import check_value
from pdtopo.runtime.disagg.transport.base import KVTransferError
from pdtopo.runtime.disagg.transport.faults import FaultInjector
from pdtopo.runtime.worker_threads import (
    NO_FAULT,
    CrashHandler,
    WorkerThread,
    crash_process,
    server_fault,
)
from pdtopo.runtime.worker_threads import FaultInjector as ThreadFault

log = logging.getLogger(__name__)


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A pull did not complete before its deadline."""


def _stale(exc: BaseException) -> bool:
    """The error of a pull over a connection whose socket the peer had closed."""
    return "connection closed" in str(exc).lower()


def _listening(peer: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at "host:port" now. The transfer library's
    own connect() succeeds even when nothing listens (its pull then hangs), so a plain socket
    tells a P that is down from one that restarted."""
    host, _, port = peer.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _poison_connection(conn: Any) -> None:
    """Cancel everything in flight on `conn` (the one use of a private transfer API)."""
    poison = getattr(conn, "_poison_connection", None)
    if poison is None:
        log.error("this jax version has no TransferConnection._poison_connection; a stuck pull "
                  "cannot be cancelled and its thread stays blocked")
        return
    try:
        poison()
    except Exception as e:  # poisoning a dead connection must not fail the caller
        log.warning("poisoning a transfer connection failed: %r", e)


def resolve_raw_buffers(value: str | bool, platform: str) -> bool:
    """disaggregation.transfer_raw_buffers: auto = on for the CPU backend, where sending from
    the arrays' own host buffers skips a staging copy per byte (measured on loopback, configurations
    interleaved: +17-27% pull throughput at 16-64 MB); off elsewhere (not measured on an
    accelerator)."""
    check_value("disaggregation.transfer_raw_buffers", value)
    return value if isinstance(value, bool) else platform == "cpu"


def staged_on_host(arrays: list[Any], kind: str) -> list[Any]:
    """Copies of device arrays in host memory of `kind`, sharded alike; the device buffers go
    as soon as the copies are made (JAX keeps them alive until then)."""
    import jax  # deferred: the disaggregation modules stay importable without JAX

    return jax.device_put(arrays, [a.sharding.with_memory_kind(kind) for a in arrays])


def _deadline_datetime(seconds_from_now: float) -> dt.datetime:
    """The transfer library's timeouts are absolute datetimes in whole seconds."""
    return dt.datetime.now() + dt.timedelta(seconds=max(0, math.ceil(seconds_from_now)))


@dataclass
class _Registration:
    uuid: int
    arrays: list[Any]
    deadline: float
    nbytes: int
    on_host: bool = False   # staged in host memory (d2h_staging), not holding device memory


@dataclass
class _Pull:
    room: int
    peer: str
    uuid: int
    deadline: float
    timeout_s: float
    future: cf.Future
    conn: Any = None
    settled: threading.Event = field(default_factory=threading.Event)


class JaxTransferKVEngine:
    """See the module docstring. Thread-safe; `close()` stops everything it started."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, transfer_sockets: int = 4,
                 transfer_size_mb: float = 1, raw_buffers: str | bool = "auto",
                 pull_workers: int = 4,
                 fault_injection_prob: float = 0.0, seed: int = 0,
                 sweep_interval_s: float = 0.5, client: Any = None, d2h_staging: bool = False,
                 on_crash: CrashHandler = crash_process, fault: ThreadFault = NO_FAULT) -> None:
        """`on_crash(name, exc)`: the housekeeping thread died (default: end the process, as
        without it pulls never time out and P's registrations never expire); `fault` kills it
        on purpose (testing: server.fault_inject_thread=kv_sweep). `d2h_staging`: registered
        arrays are copied to host memory at once and pulled from there (mode B)."""
        # deferred: the disaggregation modules stay importable without JAX
        import jax
        from jax.experimental import transfer

        check_value("disaggregation.transfer_sockets", transfer_sockets)
        check_value("disaggregation.pull_workers", pull_workers)
        check_value("disaggregation.transfer_size_mb", transfer_size_mb)
        # local_devices: in a multi-process instance jax.devices()[0] may belong to another process
        self._client = client if client is not None else jax.local_devices()[0].client
        self.raw_buffers = resolve_raw_buffers(raw_buffers, self._client.platform)
        self._server = transfer.start_transfer_server(
            self._client, f"{host}:{int(port)}", [f"{host}:0"] * int(transfer_sockets),
            transfer_size=int(transfer_size_mb * (1 << 20)), use_raw_buffers=self.raw_buffers)
        self.address: str = self._server.address()
        self.d2h_staging = bool(d2h_staging)
        # where staged copies go (d2h_staging): found at start, so a backend without host
        # memory fails here, naming the setting, not at the first request
        self.staging_memory_kind: str | None = None
        if self.d2h_staging:
            from pdtopo.runtime.engine.host_kv import host_memory_kind  # deferred: JAX

            self.staging_memory_kind = host_memory_kind(jax.local_devices()[0],
                                                        "disaggregation.d2h_staging")
        self._staging_lock = threading.Lock()  # mode B: one copy to host started at a time
        self._last_staged: list[Any] | None = None
        self.faults = FaultInjector(fault_injection_prob, seed)
        self.expired: queue.Queue[int] = queue.Queue()
        self.sweep_interval_s = float(sweep_interval_s)
        self._lock = threading.Lock()
        self._rooms: dict[tuple[int, int], _Registration] = {}  # (room, part) ->
        self._conns: dict[str, Any] = {}
        self._pulls: dict[int, _Pull] = {}
        self._pull_ids = itertools.count()
        self._tiny = jax.device_put(np.zeros((1,), np.uint8), jax.local_devices()[0])
        self.pull_executor = cf.ThreadPoolExecutor(max_workers=int(pull_workers),
                                                   thread_name_prefix="kv-pull")
        self._stop = threading.Event()
        self._sweep_fault = fault
        self._housekeeper = WorkerThread("kv-engine-sweep", self._housekeeping, on_crash)
        self._housekeeper.start()

    @classmethod
    def from_context(cls, ctx: Any) -> JaxTransferKVEngine:
        """Build from a ProcessContext: its address, ports.transfer and `disaggregation:`."""
        d = ctx.settings.disaggregation
        return cls(ctx.address, int(ctx.ports.get("transfer", 0)),
                   transfer_sockets=d.transfer_sockets, transfer_size_mb=d.transfer_size_mb,
                   raw_buffers=d.transfer_raw_buffers, pull_workers=d.pull_workers,
                   fault_injection_prob=d.fault_injection_prob,
                   seed=ctx.settings.engine.seed, d2h_staging=d.d2h_staging,
                   fault=server_fault(ctx.settings, "kv_sweep"))

    # ------------------------------------------------------------------ P side
    def new_uuid(self) -> int:
        """A fresh transfer uuid: 63 random bits from `secrets` (whoever reaches the transfer
        port and knows a registered uuid can pull that KV, so it must not be guessable; never
        logged). Never one that is registered now (a reused uuid hangs pulls); a repeat of an
        earlier one is a 2**-63 event per pair."""
        with self._lock:
            return self._fresh_uuid_locked()

    def _fresh_uuid_locked(self) -> int:
        live = {r.uuid for r in self._rooms.values()}
        while True:
            uid = secrets.randbits(63)
            if uid and uid not in live:
                return uid

    def register(self, room: int, arrays: Sequence[Any], expire_s: float,
                 uuid: int | None = None, part: int = 0) -> tuple[int, float]:
        """await_pull `arrays` under `uuid` (default: a fresh one) for room; returns (uuid,
        deadline unix s). Every process of a multi-process instance registers its own shards
        of the same packed arrays under the leader's uuid. A reshard registers one `part` per
        decode process that pulls from this one (each under its own uuid)."""
        arrays = list(arrays)
        if not arrays:
            raise ValueError(f"room {room}: nothing to register (empty array list)")
        check_value("disaggregation.sender_expiry_s", expire_s)
        if self.staging_memory_kind is not None:
            arrays = self._stage(arrays)
        deadline = time.time() + float(expire_s)
        with self._lock:
            uid = self._fresh_uuid_locked() if uuid is None else int(uuid)
            if (room, part) in self._rooms:
                raise KVTransferError(f"room {room} is already registered for a pull"
                                      + (f" (part {part})" if part else ""))
            self._server.await_pull(uid, arrays, timeout=_deadline_datetime(expire_s))
            self._rooms[(room, part)] = _Registration(uid, arrays, deadline,
                                                      sum(int(a.nbytes) for a in arrays),
                                                      on_host=self.d2h_staging)
        return uid, deadline

    def _stage(self, arrays: list[Any]) -> list[Any]:
        """Mode B: host copies of `arrays`. The previous copy is waited for first, so at most
        two registrations' device arrays await their copy to host at once: the device memory
        a pool sized with d2h_staging keeps for them (`pdtopo.config.pool_reserve`)."""
        import jax  # deferred: the disaggregation modules stay importable without JAX

        with self._staging_lock:
            if self._last_staged is not None:
                jax.block_until_ready(self._last_staged)
            staged = staged_on_host(arrays, self.staging_memory_kind)
            self._last_staged = staged
        return staged

    def release(self, room: int) -> bool:
        """Drop P's reference to a room's arrays, every part (after done / failure). True if
        it held any."""
        with self._lock:
            keys = [k for k in self._rooms if k[0] == room]
            for k in keys:
                del self._rooms[k]
            return bool(keys)

    def registered_arrays(self, room: int, part: int = 0) -> list[Any] | None:
        """The arrays registered for `room` (None when it holds none)."""
        with self._lock:
            reg = self._rooms.get((room, part))
            return None if reg is None else list(reg.arrays)

    def num_registered(self) -> int:
        """Rooms with KV registered (whatever their number of parts)."""
        with self._lock:
            return len({room for room, _part in self._rooms})

    def registered_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._rooms.values())

    def registered_device_bytes(self) -> int:
        """Of `registered_bytes`, those in device memory (0 with d2h_staging)."""
        with self._lock:
            return sum(r.nbytes for r in self._rooms.values() if not r.on_host)

    def sweep(self, now: float | None = None) -> list[int]:
        """Free rooms past their deadline (also put on `expired`) and kick server expiry."""
        now = time.time() if now is None else now
        with self._lock:
            late = [key for key, r in self._rooms.items() if r.deadline <= now]
            for key in late:
                del self._rooms[key]
            gone = sorted({room for room, _part in late})
            try:  # tiny registration that expires at once: makes the server process expiries
                self._server.await_pull(self._fresh_uuid_locked(), [self._tiny],
                                        timeout=_deadline_datetime(0))
            except Exception as e:
                log.warning("transfer server expiry kick failed: %r", e)
        for room in gone:
            log.warning("room %s: KV registered for a pull expired unpulled; released", room)
            self.expired.put(room)
        return gone

    # ------------------------------------------------------------------ D side
    def _connection(self, peer: str) -> tuple[Any, bool]:
        """(connection to peer, whether it was made just now rather than taken from the
        cache)."""
        with self._lock:
            conn = self._conns.get(peer)
            if conn is not None:
                return conn, False
            conn = self._server.connect(peer)
            self._conns[peer] = conn
            return conn, True

    def _drop_connection(self, peer: str, conn: Any, *, poison: bool) -> None:
        with self._lock:
            if conn is not None and self._conns.get(peer) is conn:
                del self._conns[peer]
        if poison and conn is not None:
            _poison_connection(conn)

    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def pull(self, peer: str, uuid: int, specs: Sequence[Any], timeout_s: float, *,
             room: int) -> cf.Future:
        """Pull `specs` (ShapeDtypeStructs with sharding) registered as `uuid` at `peer`."""
        if timeout_s <= 0:
            raise ValueError(f"pull timeout must be > 0 s, got {timeout_s}")
        fut: cf.Future = cf.Future()
        p = _Pull(room=room, peer=peer, uuid=uuid, deadline=time.monotonic() + timeout_s,
                  timeout_s=timeout_s, future=fut)
        pid = next(self._pull_ids)
        with self._lock:
            self._pulls[pid] = p
        fut.add_done_callback(lambda _f: self._forget_pull(pid))
        self.pull_executor.submit(self._pull_job, p, list(specs))
        return fut

    def _forget_pull(self, pid: int) -> None:
        with self._lock:
            self._pulls.pop(pid, None)

    @staticmethod
    def _settle(p: _Pull, result: Any = None, exc: BaseException | None = None) -> bool:
        with _SETTLE_LOCK:
            if p.future.done():
                return False
            if exc is not None:
                p.future.set_exception(exc)
            else:
                p.future.set_result(result)
            return True

    def _time_out(self, p: _Pull) -> None:
        exc = KVTransferTimeout(
            f"room {p.room}: pull of KV from peer {p.peer} did not complete "
            f"within {p.timeout_s:g} s", status=504)
        with _SETTLE_LOCK:
            if p.future.done():
                return
            conn = p.conn
            # Out of the cache before the waiter learns of the failure: its next pull to this
            # peer must reconnect, never reuse the connection about to be poisoned.
            self._drop_connection(p.peer, conn, poison=False)
            p.future.set_exception(exc)
        log.warning("%s; poisoning the connection", exc)
        if conn is not None:
            _poison_connection(conn)

    def _pull_job(self, p: _Pull, specs: list[Any]) -> None:
        import jax  # deferred: the disaggregation modules stay importable without JAX

        try:
            if p.future.done():
                return
            self.faults.check(f"pull of room {p.room} from {p.peer}")
            for attempt in range(2):
                conn, fresh = self._connection(p.peer)
                if fresh and not _listening(p.peer):
                    # a new connection (first pull, or the retry below) to an address nobody
                    # listens on: the library's connect "succeeds" and its pull would hang
                    # until the deadline, holding a pull worker
                    self._drop_connection(p.peer, conn, poison=False)
                    raise KVTransferError(
                        f"room {p.room}: the prefill transfer server at {p.peer} is gone: "
                        "nothing listens there now; its KV for this request will not come",
                        status=503)
                with _SETTLE_LOCK:  # the watchdog poisons p.conn iff set before timing out
                    if p.future.done():
                        return
                    p.conn = conn
                try:
                    arrays = conn.pull(p.uuid, specs)
                    # Blocks until the data is in (or the pull failed). A pull that never
                    # completes (dead peer, unknown uuid) is ended by the watchdog: at the
                    # deadline it poisons the connection, which makes this call raise.
                    jax.block_until_ready(arrays)
                    break
                except Exception as e:
                    # A cached connection to a P that restarted since (same address, new
                    # process) fails with "Connection closed" before anything is read: that
                    # P never saw the pull, so one retry on a new connection is safe. A P that
                    # just died gives the same error: the new connection's check above then
                    # finds nothing listening and fails the room.
                    if fresh or attempt or p.future.done() or not _stale(e):
                        raise
                    self._drop_connection(p.peer, conn, poison=False)
                    log.info("room %s: cached transfer connection to %s was closed (%s); "
                             "pulling again on a new one", p.room, p.peer, e)
            self._settle(p, result=arrays)
        except KVTransferError as e:
            self._settle(p, exc=e)
        except Exception as e:
            if p.conn is not None:
                self._drop_connection(p.peer, p.conn, poison=False)
            self._settle(p, exc=KVTransferError(
                f"room {p.room}: pull of KV from peer {p.peer} failed: {e}",
                status=502))

    # ------------------------------------------------------------------ housekeeping
    def _housekeeping(self) -> None:
        next_sweep = time.monotonic() + self.sweep_interval_s
        while not self._stop.wait(_WATCHDOG_TICK_S):
            try:
                now = time.monotonic()
                with self._lock:
                    late = [p for p in self._pulls.values() if now >= p.deadline]
                    busy = bool(self._rooms or self._pulls)
                for p in late:  # pull watchdog: the library itself never gives up
                    self._time_out(p)
                if now >= next_sweep:
                    next_sweep = now + self.sweep_interval_s
                    if busy:  # a sweep with KV registered or pulled (testing: kv_sweep)
                        self._sweep_fault.tick()
                    self.sweep()
            except Exception:
                log.exception("kv engine housekeeping failed")

    def close(self) -> None:
        """Stop housekeeping, fail pending pulls, shut the pull executor down."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._housekeeper.join(timeout=5)
        with self._lock:
            pending = list(self._pulls.values())
            conns = list(self._conns.values())
            self._conns.clear()
            self._rooms.clear()
        for p in pending:
            self._settle(p, exc=KVTransferError(f"room {p.room}: KV engine closed"))
        for conn in conns:
            _poison_connection(conn)
        self.pull_executor.shutdown(wait=True, cancel_futures=True)


_SETTLE_LOCK = threading.Lock()
_WATCHDOG_TICK_S = 0.05
