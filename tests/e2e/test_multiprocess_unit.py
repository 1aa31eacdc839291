"""Multi-process instance pieces, in one process (fast): plan `distributed` validation, the
lockstep control channel, the leader's pull group, the KV manager's mirror hooks, and P's
handling of a D failure that arrives before P's request."""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest
import zmq

from pdtopo.ports import free_port
from pdtopo.runtime.disagg.transport.base import KVTransferError
from pdtopo.runtime.disagg.transport.curve import deployment_keys
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll
from pdtopo.runtime.distributed.cluster import ClusterConfigError, ClusterSpec
from pdtopo.runtime.distributed.control import ControlClient, ControlServer, lockstep_curve
from pdtopo.runtime.distributed.leader import LeaderMirror, LeaderRunner, _PullGroup
from tests.support.transfer import done, drive, make_mgr, pool


class Ctx:
    def __init__(self, process, plan):
        self.process, self.plan = process, plan

    @property
    def name(self):
        return self.process["name"]


def _plan(n=2, control=True):
    procs = []
    for i in range(n):
        ports = {"http": 100 + i, "transfer": 200 + i, "zmq": 300 + i}
        if i == 0 and control:
            ports.update(coordinator=400, control=401)
        procs.append({"name": "prefill_0" + (f"_p{i}" if i else ""), "role": "prefill",
                      "instance_id": "prefill_0", "address": "127.0.0.1", "leader": i == 0,
                      "ports": ports, "distributed": {
                          "coordinator": "127.0.0.1:400", "num_processes": n, "process_id": i,
                          "local_device_ids": [0]}})
    return {"processes": procs}


def test_cluster_spec_from_plan():
    plan = _plan()
    assert ClusterSpec.from_context(Ctx({"name": "x", "distributed": None}, plan)) is None
    lead = ClusterSpec.from_context(Ctx(plan["processes"][0], plan))
    fol = ClusterSpec.from_context(Ctx(plan["processes"][1], plan))
    assert lead.leader and not fol.leader
    assert fol.control_addr == lead.control_addr == "127.0.0.1:401"
    assert fol.process_id == 1 and fol.num_processes == 2 and fol.local_device_ids == (0,)


@pytest.mark.parametrize("patch,match", [
    ({"process_id": 2}, r"process_id must be in \[0, 2\), got 2"),
    ({"num_processes": 0}, "num_processes must be an integer >= 1, got 0"),
    ({"coordinator": "nohost"}, "coordinator must be 'host:port', got 'nohost'"),
    ({"local_device_ids": "0"}, "local_device_ids must be a list"),
])
def test_cluster_spec_errors_name_the_key(patch, match):
    plan = _plan()
    entry = plan["processes"][1]
    entry["distributed"].update(patch)
    with pytest.raises(ClusterConfigError, match=match):
        ClusterSpec.from_context(Ctx(entry, plan))


def test_cluster_spec_needs_leader_control_port():
    plan = _plan(control=False)
    with pytest.raises(ClusterConfigError, match="has no ports.control"):
        ClusterSpec.from_context(Ctx(plan["processes"][1], plan))
    plan = _plan()
    plan["processes"][1]["leader"] = True
    with pytest.raises(ClusterConfigError, match="leader=True but process_id=1"):
        ClusterSpec.from_context(Ctx(plan["processes"][1], plan))


def test_control_channel_order_acks_and_stop():
    addr = f"127.0.0.1:{free_port()}"
    got = []
    server = ControlServer(addr, 2, lambda pid, msg: got.append((pid, msg["op"], msg["n"])),
                           ping_interval_s=0.05)
    clients = [ControlClient(addr, 1), ControlClient(addr, 2)]
    try:
        assert server.wait_followers(10)
        for i in range(200):
            server.broadcast({"op": "forward", "n": i})
        for c in clients:
            seen = [c.recv(5) for _ in range(200)]
            assert [m["n"] for m in seen] == list(range(200))  # order kept, pings consumed
            c.send({"op": "pulled", "n": c.process_id})
            assert c.leader_alive()
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(got) == [(1, "pulled", 1), (2, "pulled", 2)]
    finally:
        for c in clients:
            c.close()
        server.close()


def test_control_channel_beyond_loopback_admits_only_the_deployment_key():
    """With CURVE (lockstep_curve) a follower holding the token joins and is served; a plain
    peer, another deployment's key pair and a forged one never join or reach on_message."""
    assert lockstep_curve("auto", "127.0.0.1", None) is None  # loopback: plain
    assert lockstep_curve(False, "10.0.0.1", "tok") is None
    with pytest.raises(RuntimeError, match="side_channel_curve='auto'.*10.0.0.1"):
        lockstep_curve("auto", "10.0.0.1", None)
    keys = lockstep_curve("auto", "10.0.0.1", "the-token")
    assert keys == deployment_keys("the-token")
    addr = f"127.0.0.1:{free_port()}"
    got = []
    server = ControlServer(addr, 1, lambda pid, msg: got.append((pid, msg["op"])), curve=keys)
    strangers = [ControlClient(addr, 7), ControlClient(addr, 8,
                                                       curve=deployment_keys("other-token"))]
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.curve_serverkey = keys.public
    forger.curve_publickey, forger.curve_secretkey = zmq.curve_keypair()
    forger.connect(f"tcp://{addr}")
    try:
        for s in strangers:
            s.send({"op": "pulled", "n": 0})
        forger.send(b'{"op": "hello", "process_id": 9}')
        assert not server.wait_followers(1.5)  # nobody without the key joined
        deadline = time.monotonic() + 5
        while server.curve_denied < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        # the forger reached the authenticator and was refused; the others, holding the wrong
        # server key or none, fail the handshake before it (not counted, like the side channel)
        assert server.curve_denied >= 1 and got == []
        member = ControlClient(addr, 1, curve=keys)
        try:
            assert server.wait_followers(10)
            server.broadcast({"op": "forward", "n": 1})
            assert member.recv(5) == {"op": "forward", "n": 1}
            member.send({"op": "pulled"})
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert got == [(1, "pulled")]
        finally:
            member.close()
    finally:
        forger.close()
        for s in strangers:
            s.close()
        server.close()


def test_leader_waits_for_every_follower():
    addr = f"127.0.0.1:{free_port()}"
    server = ControlServer(addr, 2, None)
    client = ControlClient(addr, 1)
    try:
        assert not server.wait_followers(0.5)
    finally:
        client.close()
        server.close()


def test_pull_group_completes_only_with_every_process():
    local: cf.Future = cf.Future()
    g = _PullGroup(7, {1, 2}, local, time.monotonic() + 60)
    local.set_result(["arrays"])
    g.ack(1, True, None)
    assert not g.future.done()
    g.ack(2, True, None)
    assert g.future.result(0) == ["arrays"]

    local2: cf.Future = cf.Future()
    g2 = _PullGroup(8, {1}, local2, time.monotonic() + 60)
    g2.ack(1, False, "prefill rank 1 not registered")
    with pytest.raises(KVTransferError, match="process 1 of this decode instance could not "
                                              "pull its KV shards: prefill rank 1"):
        g2.future.result(0)

    g3 = _PullGroup(9, {1}, cf.Future(), time.monotonic() - 1)
    g3.check(time.monotonic())
    with pytest.raises(KVTransferError, match=r"processes \[1\] .* did not report"):
        g3.future.result(0)


class Recorder(LeaderMirror):
    """The real mirror with the broadcast captured instead of sent."""

    def __init__(self, followers=(1,)):
        super().__init__(None, set(followers))
        self.sent: list[dict] = []

    def broadcast(self, msg):
        self.sent.append(msg)


def test_leader_runner_broadcasts_forward_before_running():
    calls = []

    class Inner:
        kv_caches = ["pool"]
        page_size = 4

        def forward(self, chunks, padded=False):
            calls.append(("forward", len(mirror.sent)))
            return "logits"

    class Chunk:
        def __init__(self, t, s, p):
            self.token_ids, self.start_pos, self.page_ids = t, s, p

    mirror = Recorder()
    runner = LeaderRunner(Inner(), mirror)
    assert runner.forward([Chunk([1, 2], 0, [3]), Chunk([5], 7, [4, 6])]) == "logits"
    assert mirror.sent == [{"op": "forward", "chunks": [[[1, 2], 0, [3]], [[5], 7, [4, 6]]]}]
    assert calls == [("forward", 1)]            # broadcast first, then run here
    assert runner.page_size == 4 and runner.kv_caches == ["pool"]
    runner.kv_caches = ["new"]
    assert runner._runner.kv_caches == ["new"]


class MirroredRunner:
    def __init__(self, kv, mirror):
        self.kv_caches, self.kv_mirror = kv, mirror


def test_manager_replays_pool_operations_on_the_mirror():
    pm, dm = Recorder(), Recorder()
    P = make_mgr("prefill", pool(2, True))
    D = make_mgr("decode", pool(2, False))
    try:
        P.register_runner(MirroredRunner(P.runner.kv_caches, pm))
        D.register_runner(MirroredRunner(D.runner.kv_caches, dm))
        sender = P.create_sender(42)
        recv = D.create_receiver(42, P.channel.address)
        recv.init([5, 6])
        sender.send([1, 2], prompt_len=7, first_token=3)
        # D's pull completes only when the (simulated) follower acks
        deadline = time.monotonic() + 10
        while not dm.sent and time.monotonic() < deadline:
            recv.poll()
            sender.poll()
            time.sleep(0.005)
        time.sleep(0.3)
        assert recv.poll() == KVPoll.Transferring
        dm.on_message(1, {"op": "pulled", "room": 42, "ok": True})
        drive(sender, recv, until=done)
        assert sender.poll() == recv.poll() == KVPoll.Success
        uuid = recv.ready_info.transfer_uuid
        assert [m["op"] for m in pm.sent] == ["p_register", "p_release"]
        assert pm.sent[0] == {"op": "p_register", "room": 42, "page_ids": [1, 2], "uuid": uuid,
                              "expire_s": P.sender_expiry_s, "target": None}
        assert [m["op"] for m in dm.sent] == ["d_pull", "d_scatter"]
        assert dm.sent[0]["peer"] == P.engine.address and dm.sent[0]["uuid"] == uuid
        assert dm.sent[0]["num_pages"] == 2
        assert dm.sent[1] == {"op": "d_scatter", "room": 42, "page_ids": [5, 6], "skip": 0}
    finally:
        P.close()
        D.close()


def test_reshard_replays_on_the_mirror_with_the_layouts():
    """P (tp=2) and D (tp=1) laid out differently, both with a mirror: P's followers are told
    D's layout (they cut their pieces), D's followers P's layout and P's process addresses."""
    pm, dm = Recorder(), Recorder()
    P = make_mgr("prefill", pool(2, True))
    D = make_mgr("decode", pool(1, False))
    try:
        P.register_runner(MirroredRunner(P.runner.kv_caches, pm))
        D.register_runner(MirroredRunner(D.runner.kv_caches, dm))
        sender = P.create_sender(43)
        recv = D.create_receiver(43, P.channel.address)
        recv.init([5, 6])
        drive(sender, until=lambda s: s[0] == KVPoll.WaitingForInput)  # D's layout is known
        sender.send([1, 2], prompt_len=7, first_token=3)
        deadline = time.monotonic() + 10
        while not dm.sent and time.monotonic() < deadline:
            recv.poll()
            sender.poll()
            time.sleep(0.005)
        dm.on_message(1, {"op": "pulled", "room": 43, "ok": True})
        drive(sender, recv, until=done)
        assert sender.poll() == recv.poll() == KVPoll.Success, recv.failure_exception()
        assert pm.sent[0]["target"] == D.layout.to_dict()
        assert dm.sent[0]["reshard"] == {"p_layout": P.layout.to_dict(),
                                         "p_addrs": [P.engine.address]}
        np.testing.assert_array_equal(np.asarray(D.runner.kv_caches[0])[[5, 6]],
                                      np.asarray(P.runner.kv_caches[0])[[1, 2]])
    finally:
        P.close()
        D.close()


def test_follower_register_failure_fails_the_room_at_once():
    """A P follower that cannot register its part (its command raised) reports it; the room
    fails on both sides with that reason instead of D's pull waiting for kv_timeout_s."""
    pm = Recorder()
    P = make_mgr("prefill", pool(1, True))
    D = make_mgr("decode", pool(1, False))
    try:
        P.register_runner(MirroredRunner(P.runner.kv_caches, pm))
        sender = P.create_sender(44)
        recv = D.create_receiver(44, P.channel.address)
        recv.init([3])
        drive(sender, until=lambda s: s[0] == KVPoll.WaitingForInput)
        sender.send([1], prompt_len=2, first_token=1)
        pm.on_message(1, {"op": "error", "command": "p_register", "room": 44,
                          "message": "p_register: no such pages"})
        drive(sender, recv, until=done)
        assert sender.poll() == recv.poll() == KVPoll.Failed
        assert "process 1 of this prefill instance could not register" in \
            str(recv.failure_exception())
        assert P.num_registered() == 0
    finally:
        P.close()
        D.close()


def test_follower_pull_failure_fails_the_room_and_drops_it():
    dm = Recorder()
    P = make_mgr("prefill", pool(1, True))
    D = make_mgr("decode", pool(1, False))
    try:
        D.register_runner(MirroredRunner(D.runner.kv_caches, dm))
        sender = P.create_sender(5)
        recv = D.create_receiver(5, P.channel.address)
        recv.init([3])
        sender.send([1], prompt_len=2, first_token=1)
        deadline = time.monotonic() + 10
        while not dm.sent and time.monotonic() < deadline:
            recv.poll()
            sender.poll()
            time.sleep(0.005)
        dm.on_message(1, {"op": "pulled", "room": 5, "ok": False, "error": "boom"})
        drive(sender, recv, until=done)
        assert recv.poll() == KVPoll.Failed and "boom" in str(recv.failure_exception())
        assert [m["op"] for m in dm.sent] == ["d_pull", "d_drop"]
        assert sender.poll() == KVPoll.Failed and P.num_registered() == 0
    finally:
        P.close()
        D.close()


def test_failure_before_p_request_refuses_the_room():
    """The router posts to P and D at once: D may give up (e.g. incompatible peer) before P's
    request arrives. P must not prefill and hold KV for that room until the expiry."""
    P = make_mgr("prefill", pool(1, True))
    D = make_mgr("decode", pool(1, False))
    try:
        recv = D.create_receiver(11, P.channel.address)
        recv.abort("prefill instance is incompatible", status=500)
        deadline = time.monotonic() + 10
        while 11 not in P._early_failures and time.monotonic() < deadline:
            P.progress()
            time.sleep(0.005)
        with pytest.raises(KVTransferError, match="decode server already failed this request: "
                                                  ".*incompatible") as err:
            P.create_sender(11)
        assert err.value.status == 500
        assert P.num_active() == (0, 0) and P.num_registered() == 0
        P.create_sender(12)  # other rooms are unaffected
    finally:
        P.close()
        D.close()
