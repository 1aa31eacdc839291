"""Side channel: message round trips, validation, ownership; bad input never kills the listener."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import time

import pytest
import zmq

from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.curve import deployment_keys, side_channel_curve
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from tests.support.side_channel_messages import META, READY


@pytest.mark.parametrize("msg", [m.Want(room=1), READY,
                                 m.Ready(room=3, transfer_addr="h:1", transfer_uuid=0,
                                         expires_at=0, pools=(META,), prompt_len=0),
                                 m.Done(room=4, ok=True), m.Done(room=4, ok=False, reason="x"),
                                 m.Failed(room=5, reason="oom", status=503),
                                 m.Failed(room=5, reason="no status")])
def test_encode_decode_round_trip(msg):
    assert m.decode(m.encode(msg), 65536) == msg


@pytest.mark.parametrize("raw,why", [
    (os.urandom(64) + b"\xff", "UTF-8 JSON"),
    (b'{"v": 1, "type": "want", "ro', "UTF-8 JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"v": 2, "type": "want", "room": 1}).encode(), "version"),
    (json.dumps({"type": "want", "room": 1}).encode(), "version"),
    (json.dumps({"v": 1, "type": "hello", "room": 1}).encode(), "unknown message type"),
    (json.dumps({"v": 1, "type": "want"}).encode(), "missing field 'room'"),
    (json.dumps({"v": 1, "type": "want", "room": -1}).encode(), "outside"),
    (json.dumps({"v": 1, "type": "want", "room": "7"}).encode(), "'room' must be int"),
    (json.dumps({"v": 1, "type": "done", "room": 1, "ok": 1}).encode(), "'ok' must be bool"),
    (json.dumps({**m.to_dict(READY), "pools": []}).encode(), "pools is empty"),
    (json.dumps({**m.to_dict(READY), "pools": [{"name": "x"}]}).encode(), "malformed"),
    (b" " * 70000, "exceeds side_channel_max_bytes"),
])
def test_decode_rejects(raw, why):
    with pytest.raises(m.MessageError, match=why):
        m.decode(raw, 65536)


def _get(q: queue.Queue, timeout: float = 10):
    return q.get(timeout=timeout)


def _until(cond, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def pair():
    p = SideChannel(bind="127.0.0.1:0", max_bytes=4096, name="P")
    d = SideChannel(max_bytes=4096, name="D")
    yield p, d
    d.close()
    p.close()


def test_round_trip_over_zmq(pair):
    p, d = pair
    d.send_to(p.address, m.Want(room=7))
    ev = _get(p.events)
    assert ev.msg == m.Want(room=7) and ev.peer.kind == "router"
    p.send(ev.peer, m.Ready(room=7, transfer_addr="a:1", transfer_uuid=3, expires_at=1.0, pools=(META,),
                   prompt_len=2, first_token=1))
    back = _get(d.events)
    assert back.msg.type == "ready" and back.msg.room == 7 and back.msg.pools == (META,)
    assert back.peer.key == p.address
    d.send(back.peer, m.Done(room=7, ok=True))
    assert _get(p.events).msg == m.Done(room=7, ok=True)
    p.send(ev.peer, m.Failed(room=7, reason="late", status=500))
    assert _get(d.events).msg == m.Failed(room=7, reason="late", status=500)


def test_bad_messages_dropped_listener_survives(pair, caplog):
    p, d = pair
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{p.address}")
    bad = [os.urandom(100), b'{"v":1,"type":"want","room":', b"x" * 5000,
           json.dumps({"v": 9, "type": "want", "room": 1}).encode(),
           json.dumps({"v": 1, "type": "bogus", "room": 1}).encode(),
           m.encode(m.Done(room=555, ok=True)),            # unknown room for this peer
           m.encode(READY)]                                # a D-bound type sent to P
    with caplog.at_level(logging.WARNING, logger="pdtopo.runtime.disagg.transport.side_channel"):
        for b in bad:
            raw.send(b)
        raw.send_multipart([b"a", b"b"])                   # two payload frames
        deadline = time.monotonic() + 10
        while p.stats().get("dropped", 0) < len(bad) + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert p.stats()["dropped"] == len(bad) + 1
    assert p.events.empty()
    text = caplog.text
    for why in ("UTF-8 JSON", "exceeds side_channel_max_bytes", "version", "unknown message type",
                "unknown room 555", "not a message a P accepts", "payload frame"):
        assert why in text, why
    # the listener still works
    raw.send(m.encode(m.Want(room=8)))
    assert _get(p.events).msg == m.Want(room=8)
    raw.close()
    assert p.alive


def test_room_ownership(pair):
    p, d = pair
    other = SideChannel(max_bytes=4096, name="D2")
    try:
        d.send_to(p.address, m.Want(room=1))
        owner = _get(p.events).peer
        other.send_to(p.address, m.Want(room=1))         # a second D claims the same room
        other.send_to(p.address, m.Want(room=2))
        assert _get(p.events).msg == m.Want(room=2)       # room 1's claim was dropped
        other.send_to(p.address, m.Done(room=1, ok=True))  # not its room
        d.send_to(p.address, m.Done(room=1, ok=True))      # the owner may
        ev = _get(p.events)
        assert ev.msg == m.Done(room=1, ok=True) and ev.peer == owner
        _until(lambda: p.stats().get("dropped", 0) >= 2)
        assert p.stats()["dropped"] == 2 and p.events.empty()
        # D accepts ready only for rooms it asked this P for
        p.send(owner, m.Ready(room=99, transfer_addr="a:1", transfer_uuid=1, expires_at=0,
                              pools=(META,), prompt_len=0))
        p.send(owner, m.Failed(room=1, reason="x"))
        assert _get(d.events).msg == m.Failed(room=1, reason="x")
        _until(lambda: d.stats().get("dropped", 0) >= 1)
        assert d.stats()["dropped"] == 1 and d.events.empty()
        d.forget(1)
        p.send(owner, m.Failed(room=1, reason="after forget"))
        _until(lambda: d.stats().get("dropped", 0) >= 2)
        assert d.stats()["dropped"] == 2 and d.events.empty()
    finally:
        other.close()


def test_forget_applies_before_the_next_message(pair):
    """A message sent after forget() returned is dropped, even while the I/O thread is in the
    middle of reading a burst for that room (forget used to wait behind the read loop)."""
    p, d = pair
    burst = 200
    for room in range(100, 105):
        before = d.stats().get("dropped", 0)
        d.send_to(p.address, m.Want(room=room))
        owner = _get(p.events).peer
        for i in range(burst):
            p.send(owner, m.Failed(room=room, reason=f"known {i}"))
        assert _get(d.events).msg.reason == "known 0"
        d.forget(room)
        p.send(owner, m.Failed(room=room, reason="after forget"))
        seen = ["known 0"]
        deadline = time.monotonic() + 10
        while (len(seen) + d.stats().get("dropped", 0) - before < burst + 1
               and time.monotonic() < deadline):
            seen.extend(e.msg.reason for e in _drain(d.events))
            time.sleep(0.01)
        seen.extend(e.msg.reason for e in _drain(d.events))
        assert len(seen) + d.stats()["dropped"] - before == burst + 1
        assert "after forget" not in seen


def test_forget_right_after_a_queued_want_still_forgets(pair):
    """forget() straight after send_to(want): the want goes out first (the I/O thread sends it
    after the early forget), yet the room stays forgotten: P's answer is dropped."""
    p, d = pair
    before = d.stats().get("dropped", 0)
    d.send_to(p.address, m.Want(room=77))
    d.forget(77)
    ev = _get(p.events)
    assert ev.msg == m.Want(room=77)
    p.send(ev.peer, m.Failed(room=77, reason="late"))
    _until(lambda: d.stats().get("dropped", 0) > before)
    assert d.stats()["dropped"] == before + 1 and d.events.empty()


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_oversized_send_refused(pair, caplog):
    p, d = pair
    big = m.Failed(room=1, reason="x" * 5000)
    with caplog.at_level(logging.ERROR, logger="pdtopo.runtime.disagg.transport.side_channel"):
        d.send_to(p.address, big)
        deadline = time.monotonic() + 5
        while d.stats().get("send_errors", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert d.stats()["send_errors"] == 1 and "side_channel_max_bytes" in caplog.text


def test_bad_config_errors():
    with pytest.raises(ValueError, match="side_channel_max_bytes"):
        SideChannel(max_bytes=10)
    with pytest.raises(ValueError, match="host:port"):
        SideChannel(bind="nonsense")


def test_dead_prefill_fails_the_rooms_expected_from_it_at_once():
    """P's process dies (its sockets close): D gets a local `failed` (status 503) for every
    room it still expects from that P, without waiting for the KV timeout; rooms already
    finished (forgotten) and rooms of another P are not touched."""
    p1 = SideChannel(bind="127.0.0.1:0", name="P1")
    p2 = SideChannel(bind="127.0.0.1:0", name="P2")
    d = SideChannel(name="D")
    try:
        for room in (1, 2, 3):
            d.send_to(p1.address, m.Want(room=room))
        d.send_to(p2.address, m.Want(room=9))
        for _ in range(3):
            _get(p1.events)
        assert _get(p2.events).msg == m.Want(room=9)
        d.forget(3)  # finished before P died
        _until(lambda: d.stats().get("sent_want", 0) == 4)
        p1.close()  # what kill -9 does to P's sockets
        got = sorted((_get(d.events, timeout=5) for _ in range(2)), key=lambda e: e.msg.room)
        assert [(e.msg.room, e.msg.status) for e in got] == [(1, 503), (2, 503)]
        assert all(e.peer.key == p1.address and "disconnected" in e.msg.reason for e in got)
        assert d.stats()["peer_disconnects"] == 1
        assert d.stats()["rooms_failed_on_disconnect"] == 2
        time.sleep(0.3)
        assert d.events.empty()  # room 3 (forgotten) and room 9 (other P): nothing
        p2.send(_get_owner(p2, d), m.Failed(room=9, reason="still here"))
        assert _get(d.events).msg.reason == "still here"  # the other P's channel still works
    finally:
        for ch in (p2, d):
            ch.close()


def test_rooms_for_a_prefill_that_is_down_fail_at_once():
    """A `want` to a P nobody listens at (never up, or dead since) fails in well under a
    second with a retryable 503, not at the KV timeout; once P is back, rooms work again."""
    from pdtopo.ports import free_port

    port = free_port()
    d = SideChannel(name="D")
    try:
        t0 = time.monotonic()
        d.send_to(f"127.0.0.1:{port}", m.Want(room=1))  # nothing listens there
        ev = _get(d.events, timeout=5)
        assert (ev.msg.room, ev.msg.status) == (1, 503) and "refuses connections" in ev.msg.reason
        d.send_to(f"127.0.0.1:{port}", m.Want(room=2))  # still down: at once
        ev = _get(d.events, timeout=5)
        assert (ev.msg.room, ev.msg.status) == (2, 503) and "unreachable" in ev.msg.reason
        assert time.monotonic() - t0 < 3
        p = SideChannel(bind=f"127.0.0.1:{port}", name="P")  # P comes (back) up
        try:
            # the DEALER reconnects on its own; wants it had queued for rooms D already
            # failed may reach P too (P drops those when they expire): wait for room 3's
            _until(lambda: f"127.0.0.1:{port}" not in d._down)
            d.send_to(p.address, m.Want(room=3))
            rooms = set()
            deadline = time.monotonic() + 10
            while 3 not in rooms and time.monotonic() < deadline:
                rooms.add(_get(p.events, timeout=5).msg.room)
            assert 3 in rooms and d.events.empty()
        finally:
            p.close()
    finally:
        d.close()


def test_dead_decode_fails_the_rooms_it_owns_at_p_at_once():
    """D's process dies (its sockets close): P gets a local `failed` (status 503) for every
    room that D owns, so it frees their KV now rather than at sender_expiry_s; rooms P already
    forgot and rooms of another D are not touched."""
    p = SideChannel(bind="127.0.0.1:0", name="P")
    d1, d2 = SideChannel(name="D1"), SideChannel(name="D2")
    try:
        for room in (1, 2, 3):
            d1.send_to(p.address, m.Want(room=room))
        d2.send_to(p.address, m.Want(room=9))
        wants = [_get(p.events) for _ in range(4)]
        owner2 = next(e.peer for e in wants if e.msg.room == 9)
        p.forget(3)
        _until(lambda: p.stats().get("recv_want", 0) == 4)
        d1.close()  # what kill -9 does to D's sockets
        got = sorted((_get(p.events, timeout=5) for _ in range(2)), key=lambda e: e.msg.room)
        assert [(e.msg.room, e.msg.status) for e in got] == [(1, 503), (2, 503)]
        assert all(isinstance(e.msg, m.Failed) and "decode server" in e.msg.reason
                   for e in got)
        assert p.stats()["decode_disconnects"] == 1
        assert p.stats()["rooms_failed_on_decode_disconnect"] == 2
        time.sleep(0.3)
        assert p.events.empty()  # room 3 (forgotten) and room 9 (other D): nothing
        p.send(owner2, m.Failed(room=9, reason="still here"))
        assert _get(d2.events).msg.reason == "still here"  # the other D's channel works
    finally:
        for ch in (p, d2):
            ch.close()


def _get_owner(p: SideChannel, d: SideChannel):
    """The router peer of D as P sees it (P learned it from D's want)."""
    d.send_to(p.address, m.Want(room=10))
    return _get(p.events).peer


# ---------------------------------------------------------------- CURVE (beyond loopback)
def test_curve_keys_and_when_they_are_on():
    a, b = deployment_keys("token-a"), deployment_keys("token-b")
    assert a == deployment_keys("token-a") and a.public != b.public and a.domain != b.domain
    assert len(a.public) == len(a.secret) == 40
    with pytest.raises(ValueError, match="deployment token"):
        deployment_keys("")
    assert side_channel_curve("auto", ["127.0.0.1", "127.0.0.1"]) is False
    assert side_channel_curve("auto", ["localhost", "::1"]) is False
    assert side_channel_curve("auto", ["127.0.0.1", "10.0.0.2"]) is True  # any P/D beyond
    assert side_channel_curve("auto", [None]) is True and side_channel_curve("auto", ["p0"])
    assert side_channel_curve(True, ["127.0.0.1"]) and not side_channel_curve(False, ["10.1.1.1"])


@pytest.fixture
def curve_pair():
    keys = deployment_keys("the-deployment-token")
    p = SideChannel(bind="127.0.0.1:0", max_bytes=4096, name="P", curve=keys)
    d = SideChannel(max_bytes=4096, name="D", curve=keys)
    yield p, d, keys
    d.close()
    p.close()


def test_curve_round_trip_and_outsiders_never_reach_p(curve_pair):
    p, d, _keys = curve_pair
    d.send_to(p.address, m.Want(room=7))
    ev = _get(p.events)
    assert ev.msg == m.Want(room=7)
    p.send(ev.peer, m.Failed(room=7, reason="x"))
    assert _get(d.events).msg == m.Failed(room=7, reason="x")
    plain = SideChannel(max_bytes=4096, name="plain")             # no CURVE at all
    stranger = SideChannel(max_bytes=4096, name="stranger",       # another deployment's keys
                           curve=deployment_keys("someone-else"))
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)                                  # raw bytes, no handshake
    raw.setsockopt(zmq.LINGER, 0)
    # P refuses the handshake and drops the connection; a DEALER with no connection left
    # would block in send() forever, so the outsiders' sends give up after a second
    raw.setsockopt(zmq.SNDTIMEO, 1000)
    raw.connect(f"tcp://{p.address}")
    # knows P's public key (it is no secret) but holds its own key pair, not the deployment's
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.setsockopt(zmq.SNDTIMEO, 1000)
    forger.curve_serverkey = _keys.public
    forger.curve_publickey, forger.curve_secretkey = zmq.curve_keypair()
    forger.connect(f"tcp://{p.address}")
    try:
        before = p.stats()
        for ch in (plain, stranger):
            ch.send_to(p.address, m.Want(room=8))
            ch.send_to(p.address, m.Done(room=7, ok=True))
        for sock, room in ((raw, 9), (forger, 11)):
            with contextlib.suppress(zmq.Again):  # refused before the send: nothing to send to
                sock.send(m.encode(m.Want(room=room)))
        _until(lambda: p.stats().get("curve_denied", 0) >= 1)
        time.sleep(1.0)
        assert p.events.empty()  # nothing reached P's scheduler ...
        after = p.stats()
        assert after.get("dropped", 0) == before.get("dropped", 0)  # ... not even as a drop
        assert after.get("recv_want", 0) == before.get("recv_want", 0)
        assert after.get("curve_denied", 0) >= 1  # the forger's handshake was refused
        # the deployment's own peer still works
        d.send_to(p.address, m.Want(room=10))
        assert _get(p.events).msg == m.Want(room=10)
    finally:
        raw.close()
        forger.close()
        plain.close()
        stranger.close()


def test_a_failed_bind_leaves_nothing_open(curve_pair):
    from pdtopo.runtime.disagg.transport import curve as curve_mod
    p, _d, keys = curve_pair
    ctx = zmq.Context.instance()
    users = curve_mod._authenticators[id(ctx)][1]
    with pytest.raises(zmq.ZMQError):
        SideChannel(bind=p.address, max_bytes=4096, name="P2", curve=keys)  # port taken
    assert curve_mod._authenticators[id(ctx)][1] == users  # its authenticator share released
    d2 = SideChannel(max_bytes=4096, name="D2", curve=keys)  # and the channel still serves
    try:
        d2.send_to(p.address, m.Want(room=5))
        assert _get(p.events).msg == m.Want(room=5)
    finally:
        d2.close()
