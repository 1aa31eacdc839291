"""Passing a client's TCP connection from one server process to another on the same host.

A D that migrates a running request away (issue 50) also gives away the connection its
response is streaming on, so that it can stop while the response goes on from the other D:

    D1  send_connection(address, rid, fd, streamed)  one Unix-socket message: the request id
                                              (and whether its response is begun) as JSON,
                                              the connection's file descriptor as
                                              SCM_RIGHTS; blocks for D2's one-line answer
    D2  HandoffListener(address, adopt)       a thread accepting those messages: adopt(rid,
                                              fd, streamed) -> None (taken) or the reason;
                                              the answer goes back to D1

The address is in Linux's abstract socket namespace, named after the server's HTTP port
(`handoff_address`): nothing on disk to clean up, reachable only from this host (a connection
cannot cross hosts anyway). The kernel keeps the TCP connection open while either process
holds a descriptor of it, so D1 closing its copy after D2 took it does not end it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("pdtopo.handoff")

MAX_MESSAGE = 4096


def handoff_address(http_port: int) -> str:
    """The abstract Unix socket of the server on `http_port` of this host."""
    return f"\0pdtopo-handoff-{int(http_port)}"


class HandoffError(RuntimeError):
    pass


def send_connection(address: str, rid: str, fd: int, streamed: bool,
                    timeout: float = 10.0) -> None:
    """Give the connection `fd` (the response of request `rid`; `streamed`: its headers and
    part of its chunked body are sent) to the server at `address`; HandoffError when it could
    not be reached or did not take it."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(address)
            socket.send_fds(s, [json.dumps({"rid": rid, "streamed": streamed}).encode()], [fd])
            answer = s.recv(MAX_MESSAGE).decode(errors="replace").strip()
    except OSError as exc:
        raise HandoffError(f"cannot reach {address.lstrip(chr(0))}: {exc}") from None
    if answer != "ok":
        raise HandoffError(answer or "the target closed without an answer")


class HandoffListener:
    """Accepts connections handed over to this server; `adopt(rid, fd, streamed)` (called on
    the listener's thread) takes ownership of fd and returns None, or returns why not (then
    the fd is closed here)."""

    def __init__(self, address: str, adopt: Callable[[str, int, bool], str | None]) -> None:
        self.address = address
        self.adopt = adopt
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(64)
        self.thread = threading.Thread(target=self._run, name="handoff", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5.0)
                self._one(conn)

    def _one(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
            d = json.loads(msg.decode())
            rid, streamed = str(d["rid"]), bool(d["streamed"])
            if len(fds) != 1:
                raise ValueError(f"expected one descriptor, got {len(fds)}")
            why = self.adopt(rid, fds[0], streamed)
        except Exception as exc:  # a malformed message: refused, nothing else changes
            why = f"bad handoff message: {exc}"
        if why is not None:
            for fd in fds:
                socket.close(fd)
            log.warning("refused a handed-over connection: %s", why)
        try:
            conn.sendall(b"ok\n" if why is None else why.encode() + b"\n")
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        # the accept in flight holds the socket until it returns: the address is free after
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)
