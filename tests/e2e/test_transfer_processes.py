"""Process-level tests of the KV data plane: a real P and a real D process on 127.0.0.1.

Each peer is `tests/support/kv_peer.py` (JAX on the CPU, 1 or 2 emulated devices) driven over
stdin/stdout. The pull, expiry and P-killed cases run with P's copies in device memory (mode A)
and staged in host memory (`--d2h-staging`, mode B). P's pool holds distinct exact values; D pulls scattered pages into other page ids
of its own pool; the test compares D's whole pool with the expected array.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdtopo.ports import free_port
from tests.support.kv_peer import PeerProcess, fill_values

pytestmark = pytest.mark.slow

SHAPE = (32, 4, 2, 8)  # num_pages, page_size, heads, head_dim (kv_peer defaults)
ENTRIES = 4            # 2 layers


def expected_pool(mapping: dict[int, int]) -> np.ndarray:
    """D's pool after pulling P page src into D page dst for every (dst: src)."""
    out = np.zeros((ENTRIES, *SHAPE), np.float32)
    for e in range(ENTRIES):
        p = fill_values(SHAPE, e)
        for dst, src in mapping.items():
            out[e, dst] = p[src]
    return out


@pytest.fixture
def peers(tmp_path):
    started: list[PeerProcess] = []

    def start(role: str, *extra: str, devices: int = 1) -> PeerProcess:
        if role == "prefill" and "--zmq-port" not in extra:
            extra = ("--zmq-port", str(free_port()), *extra)
        p = PeerProcess(role, *extra, devices=devices,
                        log_path=tmp_path / f"{role}-{len(started)}.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def _transfer(P: PeerProcess, D: PeerProcess, room: int, src: list[int], dst: list[int],
              first_token: int = 7) -> None:
    P.call("sender", room=room)
    D.call("receiver", room=room, p=P.info["zmq_addr"], pages=dst)
    P.call("send", room=room, pages=src, first_token=first_token, prompt_len=4 * len(src))


@pytest.mark.parametrize("mode", [(), ("--d2h-staging",)], ids=["mode_a", "mode_b"])
def test_scattered_pages_pull_release_and_expiry(peers, mode):
    P = peers("prefill", "--expiry", "3", *mode)
    D = peers("decode")
    src, dst = [3, 17, 5, 9, 30], [20, 2, 11, 31, 1]
    # ready before want: P sends first, D asks afterwards
    P.call("sender", room=11)
    P.call("send", room=11, pages=src, first_token=42, prompt_len=19)
    D.call("receiver", room=11, p=P.info["zmq_addr"], pages=dst)
    r = D.wait(11, 60)
    assert r["state"] == "Success", r
    st = D.call("state", room=11)
    assert st["first_token"] == 42 and st["prompt_len"] == 19
    got = D.dump(range(SHAPE[0]))
    np.testing.assert_array_equal(got, expected_pool(dict(zip(dst, src, strict=True))))
    assert P.wait(11, 30)["state"] == "Success"
    assert P.call("stats")["registered"] == 0  # done released P's packed arrays

    # an unpulled room expires (sender_expiry_s=3) and is released
    P.call("sender", room=12)
    P.call("send", room=12, pages=[1, 2])
    st = P.call("stats")
    assert st["registered"] == 1 and st["held_bytes"] > 0
    assert st["held_device_bytes"] == (0 if mode else st["held_bytes"])
    w = P.wait(12, 30)
    assert w["state"] == "Failed" and "sender_expiry_s" in w["error"], w
    assert 2.0 < w["elapsed"] < 10, w
    assert P.call("stats")["registered"] == 0


def test_sharded_two_devices_concurrent_rooms(peers):
    P = peers("prefill", "--tp", "2", devices=2)
    D = peers("decode", "--tp", "2", devices=2)
    plans = {101: ([4, 8, 15], [16, 23, 9]), 102: ([1, 2, 3, 4, 5, 6], [30, 29, 28, 3, 2, 1]),
             103: ([31, 0], [12, 13])}
    for room, (src, dst) in plans.items():
        _transfer(P, D, room, src, dst)
    for room in plans:
        assert D.wait(room, 60)["state"] == "Success", room
    mapping = {d: s for src, dst in plans.values() for s, d in zip(src, dst, strict=True)}
    np.testing.assert_array_equal(D.dump(range(SHAPE[0])), expected_pool(mapping))
    for room in plans:
        assert P.wait(room, 30)["state"] == "Success", room
    assert P.call("stats")["registered"] == 0


@pytest.mark.parametrize("mode", [(), ("--d2h-staging",)], ids=["mode_a", "mode_b"])
def test_killed_prefill_fails_within_timeout(peers, mode):
    P = peers("prefill", *mode)
    D = peers("decode", "--kv-timeout", "4")
    # room 1: P announces ready, D has not given its pages yet; room 2: P never sends
    P.call("sender", room=1)
    P.call("send", room=1, pages=[1, 2, 3])
    D.call("receiver", room=1, p=P.info["zmq_addr"])
    D.call("receiver", room=2, p=P.info["zmq_addr"], pages=[5])
    t0 = time.monotonic()
    while D.call("stats")["channel"].get("recv_ready", 0) < 1:
        assert time.monotonic() - t0 < 30, "D never got P's ready"
        time.sleep(0.05)
    P.kill9()
    D.call("init", room=1, pages=[7, 8, 9])  # now the pull goes to a dead transfer server
    w1 = D.wait(1, 30)
    w2 = D.wait(2, 30)
    for w in (w1, w2):
        assert w["state"] == "Failed", w
        assert w["elapsed"] < 4 + 3, w  # kv_timeout_s=4 plus scheduling slack, no hang
        # P's side-channel disconnect (503, at once), a failed pull, or the KV timeout (504)
        assert (w["status"] == 503 and "disconnected" in w["error"]) or w["status"] == 504 \
            or "Connection" in (w["error"] or ""), w
    assert "room 1" in w1["error"] and "room 2" in w2["error"]
    # D keeps working: nothing was scattered, pool untouched
    assert not D.dump(range(SHAPE[0])).any()


def test_pull_on_a_cached_connection_to_a_dead_prefill_fails_at_once(peers):
    """A pull on D's cached connection to a P that has just died (no replacement listening)
    fails with a retryable 503 in about a second, far inside kv_timeout_s: D does not take the
    closed connection for a P restarted at the same address and retry on a new connection
    (the library's connect succeeds with nobody listening and that pull would hang until the
    deadline, holding one of D's pull workers)."""
    P = peers("prefill")
    D = peers("decode", "--kv-timeout", "30")
    _transfer(P, D, 1, [3, 4], [5, 6])  # D now holds a cached transfer connection to P
    assert D.wait(1, 60)["state"] == "Success"
    P.call("sender", room=2)
    P.call("send", room=2, pages=[1, 2])
    D.call("receiver", room=2, p=P.info["zmq_addr"])
    t0 = time.monotonic()
    while D.call("stats")["channel"].get("recv_ready", 0) < 2:
        assert time.monotonic() - t0 < 30, "D never got P's ready for room 2"
        time.sleep(0.05)
    P.kill9()
    D.call("init", room=2, pages=[7, 8])
    w = D.wait(2, 40)
    assert w["state"] == "Failed" and w["status"] == 503, w
    assert w["elapsed"] < 10, w  # not the 30 s KV timeout
    assert "nothing listens there now" in w["error"] or "disconnected" in w["error"], w


def test_listening_probe():
    import socket

    from pdtopo.runtime.disagg.transport.transfer_engine import _listening
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        addr = f"127.0.0.1:{srv.getsockname()[1]}"
        assert _listening(addr)
    assert not _listening(addr)  # closed: refused at once
    assert not _listening("not-an-address")


def test_pull_after_the_prefill_restarted_at_the_same_address(peers):
    """D's cached transfer connection to a P that was replaced by a new process at the same
    address (what a restart under supervisord does) is found closed, replaced, and the pull
    retried once: the first room after the restart succeeds instead of failing with
    "Connection closed"."""
    ports = ("--zmq-port", str(free_port()), "--transfer-port", str(free_port()))
    P = peers("prefill", *ports)
    D = peers("decode")
    _transfer(P, D, 1, [3, 4], [5, 6])
    assert D.wait(1, 60)["state"] == "Success"
    P.kill9()
    P2 = peers("prefill", *ports)
    t0 = time.monotonic()
    for room in range(2, 40):  # until D's side channel has reconnected to the new P
        _transfer(P2, D, room, [7, 8], [9, 10])
        r = D.wait(room, 60)
        error = r.get("error") or ""
        if r["state"] == "Success" or not ("unreachable" in error or "disconnected" in error):
            break
        assert time.monotonic() - t0 < 20, r
        time.sleep(0.5)
    assert r["state"] == "Success", r
    np.testing.assert_array_equal(D.dump([9, 10]), expected_pool({9: 7, 10: 8})[:, [9, 10]])
