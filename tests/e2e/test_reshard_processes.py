"""KV moves between a P and a D process laid out differently (tp, replicated KV heads).

Each peer is `tests/support/kv_peer.py` with its own tp and pool heads. P's pool holds distinct exact
values per model head (copies equal where P repeats heads); D pulls scattered pages of several
rooms at once into other page ids; the test compares D's whole pool with the model's values
laid out D's way, and checks the bytes D pulled: exactly D's share of the pages.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdtopo.ports import free_port
from pdtopo.runtime.disagg.transport.base import wire_rows
from tests.support.kv_peer import PeerProcess, fill_values

pytestmark = pytest.mark.slow

PAGES, PAGE, HEAD_DIM, ENTRIES = 32, 4, 8, 4

# (P tp, P pool heads, D tp, D pool heads, model KV heads)
CASES = {
    "p2_to_d1": (2, 4, 1, 4, 4),
    "p1_to_d2": (1, 4, 2, 4, 4),
    "p4_to_d2": (4, 4, 2, 4, 4),
    "p4_replicated_to_d1": (4, 4, 1, 2, 2),   # P repeats each of 2 heads twice
    "p1_to_d4_replicated": (1, 2, 4, 4, 2),   # D repeats each of 2 heads twice
    "p2_to_d4_replicated": (2, 2, 4, 4, 2),   # two D shards take the same whole P shard
}


def _peer(tmp_path, role: str, tp: int, heads: int, model_heads: int, n: int) -> PeerProcess:
    extra = ["--tp", str(tp), "--heads", str(heads), "--model-kv-heads", str(model_heads),
             "--page-size", str(PAGE), "--head-dim", str(HEAD_DIM), "--num-pages", str(PAGES)]
    if role == "prefill":
        extra += ["--zmq-port", str(free_port())]
    return PeerProcess(role, *extra, devices=tp, log_path=tmp_path / f"{role}-{n}.log")


def _wait_state(peer: PeerProcess, room: int, states: tuple[str, ...], timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = peer.call("state", room=room)
        if st["state"] in states:
            return st
        time.sleep(0.02)
    raise AssertionError(f"room {room} never reached {states}: {st}")


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_between_layouts(tmp_path, case):
    p_tp, p_heads, d_tp, d_heads, model_heads = CASES[case]
    P = _peer(tmp_path, "prefill", p_tp, p_heads, model_heads, 0)
    D = _peer(tmp_path, "decode", d_tp, d_heads, model_heads, 1)
    try:
        rooms = {11: ([3, 17, 5, 30, 8], [2, 9, 25, 4, 27]),  # (P pages, D pages): scattered
                 12: ([1, 2], [30, 31]),
                 13: (list(range(13, 25)), list(range(10, 22)))}  # 12 pages, several rooms
        for room, (_src, dst) in rooms.items():
            P.call("sender", room=room)
            D.call("receiver", room=room, p=P.info["zmq_addr"], pages=dst)
        for room in rooms:  # P cuts for D's layout: it needs D's want first
            _wait_state(P, room, ("WaitingForInput",))
        for room, (src, _dst) in rooms.items():
            P.call("send", room=room, pages=src, first_token=5, prompt_len=PAGE * len(src))
        for room in rooms:
            st = D.wait(room, 60)
            assert st["state"] == "Success", st
        got = D.dump(range(PAGES))
        expect = np.zeros((ENTRIES, PAGES, PAGE, d_heads, HEAD_DIM), np.float32)
        for e in range(ENTRIES):
            model = fill_values((PAGES, PAGE, model_heads, HEAD_DIM), e)
            laid_out = np.repeat(model, d_heads // model_heads, axis=2)
            for src, dst in rooms.values():
                expect[e, dst] = laid_out[src]
        np.testing.assert_array_equal(got, expect)
        for room, (src, _dst) in rooms.items():
            st = D.call("state", room=room)
            # D pulled exactly its pool's share of the wire's rows: every pool head once
            assert st["pulled_bytes"] == \
                wire_rows(len(src)) * PAGE * d_heads * HEAD_DIM * 4 * ENTRIES
            _wait_state(P, room, ("Success",))
        assert P.call("stats")["registered"] == 0
    finally:
        P.close()
        D.close()


def test_reshard_refused_when_models_differ(tmp_path):
    """Different model KV heads on the two sides: D refuses before pulling, both sides fail
    the room with the reason, P releases its registration."""
    P = _peer(tmp_path, "prefill", 2, 4, 4, 0)
    D = _peer(tmp_path, "decode", 1, 2, 2, 1)
    try:
        P.call("sender", room=21)
        D.call("receiver", room=21, p=P.info["zmq_addr"], pages=[1, 2])
        _wait_state(P, 21, ("WaitingForInput",))
        P.call("send", room=21, pages=[3, 4], first_token=5, prompt_len=8)
        st = D.wait(21, 30)
        assert st["state"] == "Failed" and "model KV heads" in st["error"], st
        st = _wait_state(P, 21, ("Failed",))
        assert P.call("stats")["registered"] == 0
    finally:
        P.close()
        D.close()


def test_prefill_killed_with_a_reshard_in_flight(tmp_path):
    """P (tp=2) registered D's (tp=1) pieces and announced them; it dies before D pulls: D
    fails the room within its KV timeout, writes nothing, and serves the next P."""
    P = _peer(tmp_path, "prefill", 2, 4, 4, 0)
    D = PeerProcess("decode", "--tp", "1", "--heads", "4", "--model-kv-heads", "4",
                    "--page-size", str(PAGE), "--head-dim", str(HEAD_DIM), "--num-pages",
                    str(PAGES), "--kv-timeout", "4", devices=1, log_path=tmp_path / "d.log")
    P2 = None
    try:
        P.call("sender", room=31)
        D.call("receiver", room=31, p=P.info["zmq_addr"])  # no pages yet: the pull waits
        _wait_state(P, 31, ("WaitingForInput",))
        P.call("send", room=31, pages=[3, 4, 5], first_token=5, prompt_len=12)
        t0 = time.monotonic()
        while D.call("stats")["channel"].get("recv_ready", 0) < 1:
            assert time.monotonic() - t0 < 30, "D never got P's ready"
            time.sleep(0.05)
        P.kill9()
        D.call("init", room=31, pages=[7, 8, 9])  # the pull goes to a dead transfer server
        w = D.wait(31, 30)
        assert w["state"] == "Failed" and w["elapsed"] < 4 + 3, w
        assert "room 31" in w["error"], w
        assert not D.dump(range(PAGES)).any()  # nothing scattered
        assert D.call("stats")["active"] == [0, 0]
        # D still pulls from a live P of the same layout
        P2 = _peer(tmp_path, "prefill", 2, 4, 4, 2)
        P2.call("sender", room=32)
        D.call("receiver", room=32, p=P2.info["zmq_addr"], pages=[1, 2])
        _wait_state(P2, 32, ("WaitingForInput",))
        P2.call("send", room=32, pages=[6, 7], first_token=5, prompt_len=8)
        assert D.wait(32, 30)["state"] == "Success"
        got = D.dump([1, 2])
        np.testing.assert_array_equal(got[0], fill_values((PAGES, PAGE, 4, HEAD_DIM), 0)[[6, 7]])
    finally:
        for peer in (P, D, P2):
            if peer is not None:
                peer.close()
