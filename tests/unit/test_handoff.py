"""Passing a TCP connection between processes (pdtopo/runtime/api/handoff.py) and the checks of
the migration routes' input: a connection handed over arrives open and usable on the other
side; a handoff nobody waits for, or a malformed message, is refused with the reason and the
descriptor closed; a target list that is not [{"url": "http://host:port"}] is a 400 naming it."""

from __future__ import annotations

import os
import socket

import pytest

from pdtopo.runtime.api.handoff import (
    HandoffError,
    HandoffListener,
    handoff_address,
    send_connection,
)
from pdtopo.runtime.api.migration_routes import _targets


@pytest.fixture
def listener():
    taken: dict[str, tuple[int, bool]] = {}

    def adopt(rid: str, fd: int, streamed: bool) -> str | None:
        if rid != "wanted":
            return f"no moved request {rid!r} here"
        taken[rid] = (fd, streamed)
        return None

    address = handoff_address(40000 + os.getpid() % 20000)
    lst = HandoffListener(address, adopt)
    yield address, taken
    lst.close()


def _pair() -> tuple[socket.socket, socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    server.close()
    return client, conn


def test_a_handed_connection_stays_open_and_writes_to_the_same_peer(listener):
    address, taken = listener
    client, conn = _pair()
    conn.sendall(b"from the source;")
    send_connection(address, "wanted", conn.fileno(), streamed=True)
    conn.close()  # the source's copy: the connection lives on in the target's
    fd, streamed = taken["wanted"]
    assert streamed is True
    moved = socket.socket(fileno=fd)
    moved.sendall(b"from the target")
    moved.close()
    data = b""
    while chunk := client.recv(100):
        data += chunk
    assert data == b"from the source;from the target"
    client.close()


def test_a_connection_nobody_waits_for_is_refused_and_closed(listener):
    address, taken = listener
    client, conn = _pair()
    with pytest.raises(HandoffError, match="no moved request 'other' here"):
        send_connection(address, "other", conn.fileno(), streamed=False)
    conn.close()  # the listener closed its copy: the client sees the end
    client.settimeout(5)
    assert client.recv(10) == b""
    assert not taken
    client.close()


def test_a_malformed_message_is_refused(listener):
    address, _ = listener
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(address)
        s.sendall(b"not json")
        assert s.recv(200).startswith(b"bad handoff message")
    # the listener still serves
    client, conn = _pair()
    send_connection(address, "wanted", conn.fileno(), streamed=False)
    conn.close()
    client.close()


def test_an_unreachable_target_is_an_error():
    with pytest.raises(HandoffError, match="cannot reach"):
        r, w = os.pipe()
        try:
            send_connection(handoff_address(1), "x", r, streamed=False, timeout=1)
        finally:
            os.close(r)
            os.close(w)


@pytest.mark.parametrize("body,msg", [
    (None, "targets: expected a non-empty list"),
    ({"targets": []}, "targets: expected a non-empty list"),
    ({"targets": [{"url": "127.0.0.1:3000"}]}, "targets[0]"),
    ({"targets": [{"url": "http://127.0.0.1"}]}, "targets[0]"),
    ({"targets": ["http://127.0.0.1:3000"]}, "targets[0]"),
])
def test_bad_target_lists_name_the_entry(body, msg):
    with pytest.raises(ValueError) as err:
        _targets(body)
    assert msg in str(err.value)


def test_targets_parse():
    assert _targets({"targets": [{"url": "http://127.0.0.1:3000/"}]}) == [
        {"url": "http://127.0.0.1:3000", "port": 3000}]

