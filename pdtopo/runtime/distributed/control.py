"""The lockstep control channel of a multi-process instance (ZMQ ROUTER/DEALER, JSON messages).

    leader   ControlServer  binds ROUTER on the leader's `ports.control`
    follower ControlClient  DEALER (identity "p<process_id>") connects to it and says `hello`

Leader -> followers: `broadcast(msg)` sends one command to every follower; each follower gets
the commands in the order they were broadcast (one ROUTER->DEALER pipe per follower, no drops:
high-water marks are unlimited). Followers -> leader: `send(msg)` (acks such as `pulled`);
the leader's `on_message(process_id, msg)` callback runs on its I/O thread, and so does
`on_tick()` (at least every 50 ms).
Liveness: the leader sends `ping` every `ping_interval_s`; a follower whose leader is silent
for `leader_timeout_s`, or whose connection to the leader closed (socket monitor), treats the
leader as gone (`ControlClient.leader_alive()`). The leader's socket monitor reports a
follower whose connection closed (matched to its `hello` by the connection's descriptor):
`on_follower_lost(process_id)` runs on the leader's I/O thread.

Beyond loopback the channel speaks ZMQ CURVE with the deployment's key pair (`lockstep_curve`:
the side channel's rule, `disaggregation.side_channel_curve`, judged by where the leader
listens): the leader's ROUTER admits only that key, so a peer without the deployment token can
neither join as a follower nor send acks (refused handshakes: `ControlServer.curve_denied`).

Each endpoint has one I/O thread (a `WorkerThread`: its death ends the process, see
pdtopo.runtime.worker_threads) that owns its ZMQ sockets; other threads hand it outgoing
messages through an inproc PUSH socket (guarded by a lock), so no socket is shared.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdtopo.runtime.disagg.transport.curve import (
    CurveKeys,
    admit_only,
    deployment_keys,
    release,
    secure_dealer,
    secure_router,
    side_channel_curve,
)
from pdtopo.runtime.disagg.transport.zmq_source import source_fd
from pdtopo.runtime.worker_threads import (
    NO_FAULT,
    CrashHandler,
    FaultInjector,
    WorkerThread,
    crash_process,
)

log = logging.getLogger("pdtopo.distributed.control")

_ids = itertools.count()


def lockstep_curve(setting: str | bool, leader_bind_host: str | None,
                   token: str | None) -> CurveKeys | None:
    """The key pair the control channel uses, or None where it stays plain (the side
    channel's rule; leader and followers judge the same leader address). RuntimeError naming
    the setting when CURVE is due and this process has no deployment token."""
    if not side_channel_curve(setting, [leader_bind_host]):
        return None
    try:
        return deployment_keys(token or "")
    except ValueError as exc:
        raise RuntimeError(f"disaggregation.side_channel_curve={setting!r} (the lockstep "
                           f"control channel listens on {leader_bind_host}): {exc}") from None


def _encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


class _Endpoint:
    """An I/O thread owning `sock` plus an inproc pipe for outgoing messages."""

    def __init__(self, sock_type: int, name: str, on_crash: CrashHandler,
                 fault: FaultInjector) -> None:
        self._ctx = zmq.Context()
        self._curve = False  # this endpoint holds a share of the context's ZAP authenticator
        self.sock = self._ctx.socket(sock_type)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        inproc = f"inproc://pdtopo-control-{next(_ids)}"
        self._pipe_in = self._ctx.socket(zmq.PULL)
        self._pipe_in.bind(inproc)
        self._pipe_out = self._ctx.socket(zmq.PUSH)
        self._pipe_out.setsockopt(zmq.LINGER, 0)
        self._pipe_out.setsockopt(zmq.SNDHWM, 0)
        self._pipe_out.connect(inproc)
        self._pipe_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._fault = fault
        # its death (an error escaping the loop's recovery) ends the process by default
        self._thread = WorkerThread(name, self._run, on_crash)
        # connection closes of `sock`, delivered to `_on_disconnect(fd)` on the I/O thread
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def _queue_out(self, frames: list[bytes]) -> None:
        with self._pipe_lock:
            self._pipe_out.send_multipart(frames)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            self._loop(poller)
        finally:  # also when the thread dies: its sockets go with it
            self.sock.disable_monitor()
            self._monitor.close(0)
            self.sock.close(0)
            self._pipe_in.close(0)

    def _loop(self, poller: zmq.Poller) -> None:
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(50))
                if events:  # testing: server.fault_inject_thread=lockstep_control
                    self._fault.tick()
                if self._pipe_in in events:
                    while True:
                        try:
                            frames = self._pipe_in.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frames == [b"__close__"]:
                            self._stop.set()
                            break
                        self._send_out(frames)
                if self.sock in events:
                    while True:
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._source_fd = source_fd(parts[-1])
                        self._on_frames([f.bytes for f in parts])
                if self._monitor in events:
                    while True:
                        try:
                            event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if event["event"] == zmq.EVENT_DISCONNECTED:
                            self._on_disconnect(int(event["value"]))
                self._tick()
            except zmq.ContextTerminated:
                break  # close() gave up waiting and terminated the context: sockets go now
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.exception("control channel error: %s", exc)
            except Exception:
                log.exception("control channel handler failed")

    _source_fd: int | None = None  # descriptor of the connection the frames being handled came on

    def _on_disconnect(self, fd: int) -> None:
        """A connection of `sock` closed (I/O thread)."""

    def _send_out(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def _on_frames(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        """Called on the I/O thread after every poll (at least every 50 ms)."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue_out([b"__close__"])
            self._thread.join(timeout=5)
        with self._pipe_lock:
            self._pipe_out.close(0)
        self._release_curve()
        self._ctx.term()

    def _release_curve(self) -> None:
        if self._curve:
            self._curve = False
            release(self._ctx)


class ControlServer(_Endpoint):
    """Leader side (see the module docstring)."""

    def __init__(self, bind_addr: str, num_followers: int,
                 on_message: Callable[[int, dict[str, Any]], None] | None = None, *,
                 on_tick: Callable[[], None] | None = None,
                 on_follower_lost: Callable[[int], None] | None = None,
                 ping_interval_s: float = 1.0, curve: CurveKeys | None = None,
                 on_crash: CrashHandler = crash_process, fault: FaultInjector = NO_FAULT) -> None:
        super().__init__(zmq.ROUTER, "lockstep-control", on_crash, fault)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.curve_denied = 0  # CURVE handshakes refused (another key, no token)
        host, _, port = bind_addr.rpartition(":")
        try:
            if curve is not None:
                self._curve = True
                secure_router(self.sock, curve, admit_only(self._ctx, curve, self._denied))
            self.sock.bind(f"tcp://{host}:{int(port)}")
        except zmq.ZMQError as exc:
            self._release_curve()
            self._ctx.destroy(0)
            raise OSError(f"lockstep control port {bind_addr} (ports.control): {exc}") from exc
        self.num_followers = int(num_followers)
        self.on_message = on_message
        self.on_tick = on_tick
        self.on_follower_lost = on_follower_lost
        self.ping_interval_s = ping_interval_s
        self._followers: dict[int, bytes] = {}     # process_id -> ROUTER identity (I/O thread)
        self._follower_fds: dict[int, int] = {}    # process_id -> its connection's descriptor
        self._all_joined = threading.Event()
        if self.num_followers == 0:
            self._all_joined.set()
        self._next_ping = 0.0
        self._thread.start()

    def _denied(self) -> None:  # the authenticator's thread
        self.curve_denied += 1
        log.warning("lockstep: refused a CURVE handshake on the control channel (a peer "
                    "without this deployment's key)")

    def wait_followers(self, timeout_s: float) -> bool:
        """Block until every follower said hello."""
        return self._all_joined.wait(timeout_s)

    def broadcast(self, msg: dict[str, Any]) -> None:
        """Send `msg` to every follower (order-preserving). Thread-safe."""
        self._queue_out([b"*", _encode(msg)])

    def _send_out(self, frames: list[bytes]) -> None:
        _, payload = frames
        for pid, ident in list(self._followers.items()):
            try:
                self.sock.send_multipart([ident, payload])
            except zmq.ZMQError as exc:
                log.error("lockstep: follower process %d unreachable (%s)", pid, exc)

    def _on_frames(self, frames: list[bytes]) -> None:
        ident, payload = frames[0], frames[-1]
        msg = json.loads(payload)
        if msg.get("op") == "hello":
            pid = int(msg["process_id"])
            if pid in self._followers and self._followers[pid] != ident:
                log.warning("lockstep: follower process %d reconnected", pid)
            self._followers[pid] = ident
            if self._source_fd is not None:
                self._follower_fds[pid] = self._source_fd
            log.info("lockstep: follower process %d joined (%d/%d)", pid,
                     len(self._followers), self.num_followers)
            if len(self._followers) >= self.num_followers:
                self._all_joined.set()
            return
        if self.on_message is not None:
            self.on_message(int(msg.get("process_id", -1)), msg)

    def _on_disconnect(self, fd: int) -> None:
        for pid in [p for p, f in self._follower_fds.items() if f == fd]:
            del self._follower_fds[pid]
            self._followers.pop(pid, None)
            self._all_joined.clear()
            log.error("lockstep: follower process %d disconnected (it died or was killed)", pid)
            if self.on_follower_lost is not None:
                self.on_follower_lost(pid)

    def _tick(self) -> None:
        if self.on_tick is not None:
            self.on_tick()
        now = time.monotonic()
        if now >= self._next_ping and self._followers:
            self._next_ping = now + self.ping_interval_s
            self._send_out([b"*", _encode({"op": "ping"})])


class ControlClient(_Endpoint):
    """Follower side (see the module docstring)."""

    def __init__(self, connect_addr: str, process_id: int, *,
                 leader_timeout_s: float = 30.0, curve: CurveKeys | None = None,
                 on_crash: CrashHandler = crash_process, fault: FaultInjector = NO_FAULT) -> None:
        super().__init__(zmq.DEALER, "lockstep-control", on_crash, fault)
        self.process_id = int(process_id)
        self.sock.setsockopt(zmq.IDENTITY, f"p{self.process_id}".encode())
        self.curve = curve is not None
        if curve is not None:
            secure_dealer(self.sock, curve)
        host, _, port = connect_addr.rpartition(":")
        self.sock.connect(f"tcp://{host}:{int(port)}")
        self.leader_timeout_s = leader_timeout_s
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self._last_seen = time.monotonic()
        self._thread.start()
        self.send({"op": "hello"})

    def send(self, msg: dict[str, Any]) -> None:
        """Send `msg` to the leader (adds process_id). Thread-safe."""
        self._queue_out([_encode({**msg, "process_id": self.process_id})])

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        """Next command from the leader (pings are consumed), or None after `timeout_s`."""
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def leader_alive(self) -> bool:
        return (not self._leader_gone
                and time.monotonic() - self._last_seen < self.leader_timeout_s)

    _leader_gone = False

    def _on_disconnect(self, fd: int) -> None:
        log.error("lockstep: the connection to the leader closed (it died or restarted)")
        self._leader_gone = True

    def _send_out(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        self._last_seen = time.monotonic()
        msg = json.loads(frames[-1])
        if msg.get("op") != "ping":
            self.inbox.put(msg)
