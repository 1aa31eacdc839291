"""Client-supplied bootstrap fields (issue 30 item 6): D dials whatever `bootstrap_host:
bootstrap_port` a request names, so

- malformed fields (host not an IPv4 address or host name, port out of range, room not an
  integer in [0, 2**64), wrong JSON types) are a 400 naming the field, at the HTTP layer and
  again where D creates a receiver, before any socket is opened;
- D's side channel keeps at most `side_channel_max_peers` DEALERs (a new P while all are busy
  fails the room at once, 503) and closes each one idle for `side_channel_peer_idle_s`;
- host names are resolved on the resolver's own bounded pool, never on the side channel's I/O
  thread, ZMQ's I/O thread or the peer-lookup thread; ZMQ is given the IPv4 address;
- `PeerDirectory`'s cache is bounded and its entries expire.

Real ZMQ sockets throughout; open sockets are counted as this process's file descriptors (each
ZMQ socket holds at least one)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from pydantic import ValidationError

from pdtopo.runtime.api.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport import side_channel as sc
from pdtopo.runtime.disagg.transport.peers import PeerDirectory
from pdtopo.runtime.disagg.transport.resolve import HostResolver
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from pdtopo.runtime.engine.request import InvalidRequest, check_bootstrap_fields

BAD = [
    ("bootstrap_host", "bad host"), ("bootstrap_host", "a_b.example"), ("bootstrap_host", ""),
    ("bootstrap_host", "-lead.example"), ("bootstrap_host", "x" * 64 + ".example"),
    ("bootstrap_host", "1.2.3.999"), ("bootstrap_host", "::1"), ("bootstrap_host", "h:1"),
    ("bootstrap_host", "tcp://h"), ("bootstrap_host", "h\n"), ("bootstrap_host", 7),
    ("bootstrap_host", {"h": 1}), ("bootstrap_port", 0), ("bootstrap_port", 65536),
    ("bootstrap_port", -1), ("bootstrap_port", True), ("bootstrap_port", "8000"),
    ("bootstrap_port", 80.0), ("bootstrap_room", -1), ("bootstrap_room", 2**64),
    ("bootstrap_room", False), ("bootstrap_room", "5"), ("bootstrap_room", 1.5),
]
GOOD = {"bootstrap_host": "prefill-0.lws.ns.svc.cluster.local", "bootstrap_port": 65535,
        "bootstrap_room": 2**64 - 1}


@pytest.mark.parametrize("field,value", BAD)
def test_bad_fields_are_refused_naming_the_field(field, value):
    for model, base in ((GenerateRequest, {"text": "x"}), (CompletionRequest, {"prompt": "x"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(ValidationError) as err:
            model.model_validate({**base, **GOOD, field: value})
        assert all(e["loc"][0] == field for e in err.value.errors()), err.value
        with pytest.raises(ValidationError):  # in a batch's list too
            model.model_validate({**base, field: [None, value]})
    args = {**GOOD, field: value}
    with pytest.raises(InvalidRequest) as bad:  # where D creates a receiver
        check_bootstrap_fields(args["bootstrap_host"], args["bootstrap_port"],
                               args["bootstrap_room"])
    assert bad.value.field == field and field in bad.value.message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "p-0", "a.b-c.example.",
                                  "x" * 63 + ".example"])
def test_good_fields_pass(host):
    body = GenerateRequest.model_validate({"text": "x", **GOOD, "bootstrap_host": host})
    assert (body.bootstrap_host, body.bootstrap_room) == (host, 2**64 - 1)
    check_bootstrap_fields(host, 1, 0)
    check_bootstrap_fields(None, None, None)  # not given: nothing to check


# ---------------------------------------------------------------- D's DEALERs
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait(pred, timeout: float = 10.0, what: str = "condition"):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def _events(d: SideChannel, n: int, timeout: float = 10.0) -> list[sc.SideChannelEvent]:
    return [d.events.get(timeout=timeout) for _ in range(n)]


@pytest.fixture
def p_channel():
    p = SideChannel(bind="127.0.0.1:0", name="p")
    yield p
    p.close()


def test_open_dealers_stay_under_the_cap_and_busy_ones_refuse_a_new_peer(p_channel):
    d = SideChannel(name="d", max_peers=4, peer_idle_s=30)
    try:
        base = _fds()
        # four Ps with a room in flight each (only one listens; the others are dead ports)
        d.send_to(p_channel.address, m.Want(room=1))
        for room in (2, 3, 4):
            d.send_to(f"127.0.0.1:{9 + room}", m.Want(room=room))
        _wait(lambda: d.stats().get("peers_open") == 4, what="4 DEALERs")
        assert p_channel.events.get(timeout=10).msg == m.Want(room=1)
        d.send_to("127.0.0.1:20", m.Want(room=5))  # a fifth P while all four are busy
        ev = next(e for e in _events(d, 4) if e.msg.room == 5)
        assert ev.msg.status == 503 and "side_channel_max_peers=4" in ev.msg.reason
        assert d.stats()["peers_open"] == 4 and d.stats()["peer_refused"] == 1
        assert _fds() - base <= 4 * 4  # each DEALER: its socket and its monitor
    finally:
        d.close()


def test_many_distinct_peers_reuse_idle_slots_and_idle_dealers_close(p_channel, monkeypatch):
    monkeypatch.setattr(sc, "_EVICT_GRACE_S", 0.0)
    d = SideChannel(name="d", max_peers=3, peer_idle_s=0.5)
    try:
        base = _fds()
        seen = 0
        for room in range(40):  # 40 distinct endpoints, each room finished (forgotten) at once
            d.send_to(f"127.0.0.1:{30000 + room}", m.Want(room=room))
            d.forget(room)
            _wait(lambda r=room: d.stats().get("sent_want", 0) == r + 1, what="want sent")
            seen = max(seen, d.stats()["peers_open"])
        assert seen <= 3 and d.stats()["peers_closed"] >= 37
        assert _fds() - base <= 3 * 4
        _wait(lambda: d.stats()["peers_open"] == 0, timeout=5, what="idle DEALERs closed")
        _wait(lambda: _fds() <= base, timeout=5, what="their file descriptors released")
        # a P talked to again after its DEALER closed: a new one, and the room still works
        d.send_to(p_channel.address, m.Want(room=77))
        ev = p_channel.events.get(timeout=10)
        p_channel.send(ev.peer, m.Failed(room=77, reason="test", status=409))
        assert d.events.get(timeout=10).msg.status == 409
    finally:
        d.close()


def test_a_room_in_flight_keeps_its_dealer_open(p_channel):
    d = SideChannel(name="d", max_peers=2, peer_idle_s=0.3)
    try:
        d.send_to(p_channel.address, m.Want(room=5))
        ev = p_channel.events.get(timeout=10)
        time.sleep(1.5)  # several idle periods with the room still expected
        assert d.stats()["peers_open"] == 1 and not d.stats().get("peers_closed")
        p_channel.send(ev.peer, m.Failed(room=5, reason="late", status=410))
        assert d.events.get(timeout=10).msg.status == 410
        d.forget(5)
        _wait(lambda: d.stats()["peers_open"] == 0, timeout=5, what="closed once idle")
    finally:
        d.close()


def test_an_unresolvable_host_fails_the_room_and_leaks_nothing():
    d = SideChannel(name="d", max_peers=4)
    try:
        d.send_to("127.0.0.1:1", m.Want(room=0))  # warm up: the I/O thread's own sockets
        _events(d, 1)
        d.forget(0)
        base = _fds()
        for room in range(1, 30):
            d.send_to("no-such-host.invalid:5000", m.Want(room=room))
        evs = _events(d, 29)
        assert all(e.msg.status == 503 and "cannot resolve host name" in e.msg.reason
                   for e in evs), evs[0]
        assert d.stats().get("peers_open", 0) <= 1 and _fds() <= base
    finally:
        d.close()


def test_name_lookups_never_block_the_io_thread(p_channel):
    release = threading.Event()
    asked: list[str] = []

    def slow(host: str) -> str:  # DNS that takes as long as the test says
        asked.append(host)
        release.wait(20)
        return "127.0.0.1"

    resolver = HostResolver(1, resolve=slow)
    d = SideChannel(name="d", resolver=resolver)
    try:
        port = p_channel.address.rpartition(":")[2]
        d.send_to(f"p-by-name:{port}", m.Want(room=1))
        _wait(lambda: asked == ["p-by-name"], what="the name asked")
        t0 = time.monotonic()
        d.send_to(p_channel.address, m.Want(room=2))  # while the name is still resolving
        assert p_channel.events.get(timeout=5).msg.room == 2
        assert time.monotonic() - t0 < 2
        release.set()  # the name resolves: the parked want goes out to the IP
        ev = p_channel.events.get(timeout=10)
        assert ev.msg.room == 1
        p_channel.send(ev.peer, m.Failed(room=1, reason="x", status=418))
        got = d.events.get(timeout=10)
        assert got.peer.key == f"p-by-name:{port}" and got.msg.status == 418
    finally:
        release.set()
        d.close()
        resolver.close()


def test_resolver_bounds_pending_names_and_its_cache():
    release = threading.Event()
    r = HostResolver(1, max_pending=2, max_entries=3, ttl_s=0.2,
                     resolve=lambda h: release.wait(20) and "10.0.0.1")
    try:
        assert r.lookup("10.1.2.3") == ("ok", "10.1.2.3")  # a literal: no lookup at all
        assert r.lookup("a")[0] == r.lookup("b")[0] == "pending"
        status, why = r.lookup("c")
        assert status == "error" and "being resolved already" in why
        release.set()
        _wait(lambda: r.lookup("a") == ("ok", "10.0.0.1"), what="a resolved")
        for name in "cdefgh":
            _wait(lambda n=name: r.lookup(n)[0] == "ok", what=f"{name} resolved")
            assert r.cached() <= 3
    finally:
        release.set()
        r.close()


# ---------------------------------------------------------------- PeerDirectory
ENTRY = {"instance_id": "p", "page_size": 16}


def _checked(peers: PeerDirectory, addr: str) -> bool:
    """The directory has an answer for `addr` (these entries lack a KV layout: "error")."""
    return peers.status(addr)[0] != "pending"


def test_peer_directory_cache_is_bounded_and_expires():
    seen: list[str] = []

    def lookup(host: str, port: int) -> dict:
        seen.append(host)
        return ENTRY

    resolver = HostResolver(1, resolve=lambda h: "127.0.0.9")
    peers = PeerDirectory(lookup, {"page_size": 16}, ttl_s=0.3, error_ttl_s=0.3,
                          max_entries=8, resolver=resolver)
    try:
        for port in range(1000, 1100):
            _wait(lambda a=f"127.0.0.1:{port}": _checked(peers, a), what="checked")
            assert peers.cached() <= 8
        _wait(lambda: _checked(peers, "p-by-name:7"), what="name checked")
        assert seen[-1] == "127.0.0.9"  # the lookup thread got the address, not the name
        assert all(h[0].isdigit() for h in seen)
        time.sleep(0.35)
        before = len(seen)
        _wait(lambda: _checked(peers, "127.0.0.1:1000"), what="checked again")
        assert len(seen) == before + 1  # the expired entry was looked up again
    finally:
        peers.close()
        resolver.close()


def test_peer_directory_bounds_lookups_in_flight():
    gate = threading.Event()
    peers = PeerDirectory(lambda h, p: gate.wait(20) and ENTRY, {"page_size": 16},
                          max_pending=3)
    try:
        for port in range(2000, 2010):
            assert peers.status(f"10.0.0.1:{port}") == ("pending", None)
        assert len(peers._pending) == 3  # the rest wait for a slot, queued nowhere
        gate.set()
        for port in range(2000, 2010):
            _wait(lambda a=f"10.0.0.1:{port}": _checked(peers, a), what="checked")
    finally:
        gate.set()
        peers.close()


def test_peer_directory_reports_an_unresolvable_name():
    peers = PeerDirectory(lambda h, p: ENTRY, {"page_size": 16})
    try:
        _wait(lambda: peers.status("no-such-host.invalid:5")[0] != "pending", what="answer")
        status, why = peers.status("no-such-host.invalid:5")
        assert status == "error" and "cannot resolve" in why
    finally:
        peers.close()
