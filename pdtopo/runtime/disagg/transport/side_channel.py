"""ZMQ side channel: P binds a ROUTER, D talks to each P through a cached DEALER.

D's DEALERs are bounded (the endpoint comes from a request, docs/protocol.md#bootstrap-fields):
at most `max_peers` open, each closed after `peer_idle_s` with no room in flight, the least
recently used idle one closed to make room, and a room for one more P while every DEALER has a
room in flight fails at once (503). A DEALER connects to an IPv4 address: a host name is first
resolved by the `HostResolver`'s own threads while its messages wait here (`_parked`).

One I/O thread owns every ZMQ socket of the channel (ZMQ sockets are not thread-safe). Other
threads never touch a socket:

    owner thread --send()/forget()--> outbox (queue) --wake--> I/O thread --zmq--> peer
    peer --zmq--> I/O thread: decode + validate + ownership check --> events (queue.Queue)
                                                                       drained by the owner

A received message becomes a `SideChannelEvent(peer, msg)`; reply with `send(event.peer, msg)`.
Malformed, oversized, wrong-version, unknown-type, wrong-direction messages and messages about
rooms the peer does not own are logged and dropped (counted in `stats()`); the listener keeps
running. Room ownership:
  - ROUTER (P side): a `want(room)` from identity X makes X the room's owner (a different
    identity claiming it later is rejected); `done`/`failed` for a room are accepted only from
    its owner; sending `ready`/`failed` to X also makes X the owner.
  - DEALER (D side): sending `want(room)` to endpoint E expects the room from E; `ready`/`failed`
    for a room are accepted only from the endpoint that was asked.
`forget(room)` drops those records once a room is finished.

A peer that dies is noticed at once: socket monitors turn its closed connection into local
`failed` events for its rooms (peer_watch.py).

With `curve` keys (`disaggregation.side_channel_curve`, on beyond loopback by default) the ROUTER
is a CURVE server that admits only peers holding the deployment's key pair, and every DEALER is
a CURVE client with it (pdtopo/runtime/disagg/transport/curve.py): a peer without the token cannot
complete a handshake, so nothing it sends reaches the I/O thread (`curve_denied` counts the
refused handshakes); all side-channel traffic is encrypted.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter

import zmq

from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.curve import (
    CurveKeys,
    admit_only,
    release,
    secure_dealer,
    secure_router,
)
from pdtopo.runtime.disagg.transport.peer_watch import MONITORED, Peer, PeerWatch, SideChannelEvent
from pdtopo.runtime.disagg.transport.resolve import HostResolver
from pdtopo.runtime.disagg.transport.zmq_source import source_fd
from pdtopo.runtime.worker_threads import (
    NO_FAULT,
    CrashHandler,
    FaultInjector,
    WorkerThread,
    crash_process,
)

log = logging.getLogger(__name__)

_TO_P = ("want", "done", "failed")   # types a ROUTER accepts
_TO_D = ("ready", "failed")          # types a DEALER accepts
# a DEALER used this recently is never closed to make room for another (what it was last given
# has long been flushed when it is closed, with LINGER 0), so at most max_peers are closed a second
_EVICT_GRACE_S = 1.0


class SideChannel(PeerWatch):
    """A side-channel endpoint; `bind` ("host:port", port 0 = any) makes it a P (ROUTER)."""

    def __init__(self, *, bind: str | None = None, max_bytes: int = 65536,
                 name: str = "side-channel", curve: CurveKeys | None = None,
                 max_peers: int = 64, peer_idle_s: float = 60.0, resolve_threads: int = 2,
                 resolver: HostResolver | None = None,
                 on_crash: CrashHandler = crash_process, fault: FaultInjector = NO_FAULT) -> None:
        """`on_crash(name, exc)`: the I/O thread died (default: end the process; see
        pdtopo.runtime.worker_threads); `fault` kills it on purpose (testing).
        `curve`: the deployment's CURVE keys (pdtopo.runtime.disagg.transport.curve): the ROUTER
        admits only peers that hold them and every DEALER presents them; None: plain TCP.
        `max_peers` DEALERs at most, each closed after `peer_idle_s` without a room in flight;
        host names are resolved by `resolver` (one of `resolve_threads` threads by default)."""
        if max_bytes < 256:
            raise ValueError(f"side_channel_max_bytes must be >= 256, got {max_bytes}")
        if max_peers < 1 or not peer_idle_s > 0:
            raise ValueError(f"side_channel_max_peers must be >= 1 and side_channel_peer_idle_s "
                             f"> 0, got {max_peers} and {peer_idle_s}")
        self.max_bytes = int(max_bytes)
        self.max_peers = int(max_peers)
        self.peer_idle_s = float(peer_idle_s)
        self._owns_resolver = resolver is None
        self.resolver = resolver or HostResolver(resolve_threads, max_pending=self.max_peers,
                                                 max_entries=4 * self.max_peers)
        self.name = name
        self.curve = curve
        self._curve_users = 0  # 1 while this ROUTER holds the context's authenticator
        self.events: queue.Queue[SideChannelEvent] = queue.Queue()
        self._outbox: queue.Queue[tuple] = queue.Queue()
        self._ctx = zmq.Context.instance()
        self._identity = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}   # DEALER monitor -> P endpoint
        self._down: set[str] = set()                 # DEALER endpoints known unreachable
        self._last_used: dict[str, float] = {}       # DEALER endpoint -> last send/receive
        # DEALER endpoints whose host name is being resolved -> (msg, data) to send then
        self._parked: dict[str, list[tuple[m.Message, bytes]]] = {}
        self._dealer_ids = itertools.count()         # each DEALER has its own identity
        self._next_sweep = 0.0
        self._router_monitor: zmq.Socket | None = None
        self._peer_fds: dict[bytes, int] = {}        # ROUTER: D identity -> its connection fd
        self._owners: dict[int, bytes] = {}      # ROUTER: room -> D identity
        self._expected: dict[int, str] = {}      # DEALER: room -> P endpoint asked
        self._forgotten: queue.SimpleQueue[int] = queue.SimpleQueue()  # owner -> I/O thread
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self.port: int | None = None
        self.address: str | None = None
        if bind is not None:
            host, _, port = bind.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"side channel bind address must be host:port, got {bind!r}")
            self._router = self._ctx.socket(zmq.ROUTER)
            try:
                if curve is not None:
                    self._curve_users = 1
                    secure_router(self._router, curve, admit_only(
                        self._ctx, curve, lambda: self._count("curve_denied")))
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._router.setsockopt(zmq.MAXMSGSIZE, 16 * self.max_bytes)
                self._router_monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                if int(port) == 0:
                    self.port = self._router.bind_to_random_port(f"tcp://{host}")
                else:
                    self._router.bind(f"tcp://{host}:{port}")
                    self.port = int(port)
            except Exception:  # e.g. the port is taken: leave nothing open behind
                self._abandon()
                raise
            self.address = f"{host}:{self.port}"
        self._fault = fault
        self._thread = WorkerThread(f"{name}-io", self._run, on_crash)
        self._thread.start()

    # ------------------------------------------------------------------ owner-thread API
    def send(self, peer: Peer, msg: m.Message) -> None:
        """Queue `msg` for `peer` (thread-safe; the I/O thread does the actual send)."""
        self._put(("send", peer, msg))

    def send_to(self, endpoint: str, msg: m.Message) -> Peer:
        """Send to the P side channel at "host:port" through a cached DEALER."""
        peer = Peer("dealer", endpoint)
        self.send(peer, msg)
        return peer

    def forget(self, room: int) -> None:
        """Stop accepting messages for `room`. Applied before the I/O thread accepts its next
        message, so a message that arrives after this call returns is always dropped."""
        if self._stop.is_set():
            raise RuntimeError(f"{self.name}: side channel is closed")
        self._forgotten.put(room)  # at once, before the next message is accepted ...
        self._put(("forget", room))  # ... and again after the sends queued before this call

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        self._wake_r.close()
        self._wake_w.close()
        if self._owns_resolver:
            self.resolver.close()
        if self._curve_users:
            self._curve_users = 0
            release(self._ctx)

    def _abandon(self) -> None:
        """Undo a constructor that failed before its I/O thread started."""
        if self._router_monitor is not None:
            self._router.disable_monitor()
            self._router_monitor.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()
        if self._owns_resolver:
            self.resolver.close()
        if self._curve_users:
            self._curve_users = 0
            release(self._ctx)

    # ------------------------------------------------------------------ I/O thread
    def _put(self, item: tuple) -> None:
        if self._stop.is_set():
            raise RuntimeError(f"{self.name}: side channel is closed")
        self._outbox.put(item)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (buffer full) or we are closing

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self._stats[key] += 1

    def _drop(self, peer: Peer, why: str) -> None:
        self._count("dropped")
        log.warning("%s: dropped message from %s %r: %s", self.name, peer.kind, peer.key, why)

    # DEALERs (D side): opened on first use, at most max_peers, closed when idle
    def _send_dealer(self, endpoint: str, msg: m.Message, data: bytes) -> bool:
        """Send through `endpoint`'s DEALER, opening it first (to the host's IPv4 address:
        ZMQ never resolves a name itself). False when not sent now: parked until the host name
        resolves, or refused (no peer slot, a name that does not resolve)."""
        sock = self._dealers.get(endpoint)
        if sock is None:
            if endpoint in self._parked:
                self._parked[endpoint].append((msg, data))
                return False
            if not self._peer_slot():
                self._refuse(endpoint, msg, f"cannot be reached: this decode server has "
                             f"side_channel_max_peers={self.max_peers} prefill connections, "
                             f"all with rooms in flight")
                return False
            host, _, port = endpoint.rpartition(":")
            status, ip = self.resolver.lookup(host, lambda: self._resolved(endpoint))
            if status == "pending":
                self._parked[endpoint] = [(msg, data)]
                return False
            if status == "error":
                self._refuse(endpoint, msg, f"cannot be reached: {ip}")
                return False
            try:
                sock = self._open_dealer(endpoint, f"{ip}:{port}")
            except zmq.ZMQError as e:
                self._refuse(endpoint, msg, f"cannot be reached: {e}")
                return False
        self._last_used[endpoint] = time.monotonic()
        sock.send(data, flags=zmq.NOBLOCK)
        return True

    def _resolved(self, endpoint: str) -> None:
        """Resolver thread: `endpoint`'s host name is resolved (or failed); wake the I/O thread."""
        try:
            self._put(("resolved", endpoint))
        except RuntimeError:
            pass  # closed meanwhile

    def _flush_parked(self, endpoint: str) -> None:
        for msg, data in self._parked.pop(endpoint, []):
            try:
                if self._send_dealer(endpoint, msg, data):
                    self._count(f"sent_{msg.type}")
            except zmq.ZMQError as e:
                self._count("send_errors")
                log.error("%s: send of %s for room %s to %s failed: %s", self.name, msg.type,
                          msg.room, endpoint, e)

    def _refuse(self, endpoint: str, msg: m.Message, what: str) -> None:
        """Not sent: a `want` still expected from `endpoint` fails its room at once (503)."""
        self._count("peer_refused")
        log.warning("%s: not sending %s for room %s: %s %s", self.name, msg.type, msg.room,
                    endpoint, what)
        if msg.type == "want" and self._expected.get(msg.room) == endpoint:
            self._fail_expected(endpoint, what, [msg.room])

    def _peer_slot(self) -> bool:
        """Room for one more DEALER: under max_peers, or after closing the least recently used
        one with no room in flight."""
        if len(self._dealers) + len(self._parked) < self.max_peers:
            return True
        busy = set(self._expected.values())
        now = time.monotonic()
        idle = [e for e in self._dealers
                if e not in busy and now - self._last_used.get(e, 0.0) >= _EVICT_GRACE_S]
        if not idle:
            return False
        self._close_dealer(min(idle, key=lambda e: self._last_used.get(e, 0.0)))
        return True

    def _open_dealer(self, endpoint: str, target: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        monitor = None
        try:
            if self.curve is not None:
                secure_dealer(sock, self.curve)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"%s-%d" % (self._identity, next(self._dealer_ids)))
            sock.setsockopt(zmq.MAXMSGSIZE, 16 * self.max_bytes)
            monitor = sock.get_monitor_socket(MONITORED)
            sock.connect(f"tcp://{target}")
        except Exception:  # leave nothing open behind
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        self._dealers[endpoint] = sock
        self._monitors[monitor] = endpoint
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self._gauge("peers_open", len(self._dealers))
        return sock

    def _close_dealer(self, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint)
        for monitor in [mon for mon, e in self._monitors.items() if e == endpoint]:
            del self._monitors[monitor]
            self._poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close(linger=0)
        self._poller.unregister(sock)
        sock.close(linger=0)
        self._down.discard(endpoint)
        self._last_used.pop(endpoint, None)
        self._count("peers_closed")
        self._gauge("peers_open", len(self._dealers))

    def _close_idle(self) -> None:
        """At most once a second: close every DEALER idle for peer_idle_s with no room."""
        now = time.monotonic()
        if now < self._next_sweep or not self._dealers:
            return
        self._next_sweep = now + 1.0
        self._apply_forgets()
        busy = set(self._expected.values())
        for endpoint in [e for e in self._dealers if e not in busy
                         and now - self._last_used.get(e, now) >= self.peer_idle_s]:
            self._close_dealer(endpoint)

    def _gauge(self, key: str, value: int) -> None:
        with self._stats_lock:
            self._stats[key] = value

    def _do_send(self, peer: Peer, msg: m.Message) -> None:
        data = m.encode(msg)
        if len(data) > self.max_bytes:
            # logged before counted: whoever sees the count can read why
            log.error("%s: not sending %s for room %s: %d bytes > side_channel_max_bytes=%d",
                      self.name, msg.type, msg.room, len(data), self.max_bytes)
            self._count("send_errors")
            return
        try:
            if peer.kind == "router":
                if self._router is None:
                    raise RuntimeError("this side channel has no ROUTER (bind=None)")
                self._owners.setdefault(msg.room, peer.key)
                self._router.send_multipart([peer.key, data], flags=zmq.NOBLOCK)
            else:
                if msg.type == "want":
                    self._expected[msg.room] = peer.key
                    if peer.key in self._down:  # P is known to be down: do not wait for it
                        self._fail_expected(peer.key, "is unreachable", [msg.room])
                        return
                if not self._send_dealer(peer.key, msg, data):
                    return  # parked (counted once sent) or refused
            self._count(f"sent_{msg.type}")
        except (zmq.ZMQError, RuntimeError) as e:
            self._count("send_errors")
            log.error("%s: send of %s for room %s to %s %r failed: %s", self.name, msg.type,
                      msg.room, peer.kind, peer.key, e)

    def _accept(self, peer: Peer, raw: bytes) -> None:
        self._apply_forgets()
        try:
            msg = m.decode(raw, self.max_bytes)
        except m.MessageError as e:
            self._drop(peer, str(e))
            return
        except Exception as e:  # validation must never kill the listener
            self._drop(peer, f"unparseable message ({e!r})")
            return
        if peer.kind == "router":
            if msg.type not in _TO_P:
                self._drop(peer, f"{msg.type} is not a message a P accepts")
                return
            owner = self._owners.get(msg.room)
            if msg.type == "want":
                if owner is not None and owner != peer.key:
                    self._drop(peer, f"room {msg.room} is already claimed by another peer")
                    return
                self._owners[msg.room] = peer.key
            elif owner != peer.key:
                self._drop(peer, f"unknown room {msg.room} for this peer")
                return
        else:
            if msg.type not in _TO_D:
                self._drop(peer, f"{msg.type} is not a message a D accepts")
                return
            if self._expected.get(msg.room) != peer.key:
                self._drop(peer, f"unknown room {msg.room} for this peer")
                return
        self._count(f"recv_{msg.type}")
        self.events.put(SideChannelEvent(peer, msg))

    def _recv_router(self) -> None:
        assert self._router is not None
        while True:
            try:
                parts = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [p.bytes for p in parts]
            fd = source_fd(parts[-1])
            if fd is not None:
                self._peer_fds[frames[0]] = fd
            peer = Peer("router", frames[0])
            body = [f for f in frames[1:] if f]
            if len(body) != 1:
                self._drop(peer, f"expected one payload frame, got {len(frames) - 1} frames")
                continue
            self._accept(peer, body[0])

    def _recv_dealer(self, endpoint: str, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = Peer("dealer", endpoint)
            self._last_used[endpoint] = time.monotonic()
            body = [f for f in frames if f]
            if len(body) != 1:
                self._drop(peer, f"expected one payload frame, got {len(frames)} frames")
                continue
            self._accept(peer, body[0])

    def _drain_outbox(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "send":
                self._do_send(item[1], item[2])
            elif item[0] == "resolved":
                self._flush_parked(item[1])
            elif item[0] == "forget":  # a send queued before forget() may have re-added it
                self._owners.pop(item[1], None)
                self._expected.pop(item[1], None)

    def _apply_forgets(self) -> None:
        while True:
            try:
                room = self._forgotten.get_nowait()
            except queue.Empty:
                return
            self._owners.pop(room, None)
            self._expected.pop(room, None)

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
            self._poller.register(self._router_monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(self._poller.poll(200))
                self._close_idle()
                if not ready:
                    continue
                self._fault.tick()  # testing: server.fault_inject_thread=side_channel
                self._apply_forgets()
                self._drain_outbox()
                if self._router is not None and self._router in ready:
                    self._recv_router()
                if self._router_monitor is not None and self._router_monitor in ready:
                    self._recv_router_monitor()
                for endpoint, sock in list(self._dealers.items()):
                    if sock in ready:
                        self._recv_dealer(endpoint, sock)
                for monitor, endpoint in list(self._monitors.items()):
                    if monitor in ready:
                        self._recv_monitor(monitor, endpoint)
        except Exception:  # a bug here must be loud, not a silent dead listener
            log.exception("%s: side-channel I/O thread crashed", self.name)
            self._count("crashed")
            raise
        finally:
            self._drain_outbox_on_close()

    def _drain_outbox_on_close(self) -> None:
        for sock in self._dealers.values():
            sock.disable_monitor()
            sock.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._monitors.clear()
        self._dealers.clear()
        self._parked.clear()
        if self._router is not None:
            self._router.disable_monitor()
            self._router_monitor.close(linger=0)
            self._router.close(linger=0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
