"""JaxTransferKVEngine and the JaxTransfer manager/sender/receiver, in one process.

The engines pull from their own or each other's transfer servers over real loopback TCP; the
managers talk over a real ZMQ side channel. Process-level tests: test_transfer_processes.py.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from pdtopo.runtime.disagg.transport.base import (
    KVArgs,
    KVTransferError,
    PackedMeta,
    PoolTransferSpec,
    SpecMismatchError,
    check_packed_meta,
)
from pdtopo.runtime.disagg.transport.faults import InjectedTransferFault
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll
from pdtopo.runtime.disagg.transport.transfer_engine import (
    JaxTransferKVEngine,
    KVTransferTimeout,
    resolve_raw_buffers,
)
from tests.support.transfer import SHAPE, done, drive, make_mgr, pool


@pytest.fixture(params=[("auto", False), (False, False), ("auto", True)],
                ids=["raw-buffers", "staged", "d2h-staging"])
def engine(request):
    """Every engine test in both transfer modes, and with P's copies staged in host memory
    (`disaggregation.d2h_staging`, mode B): pulls (late ones too), expiry, unknown uuids."""
    raw, d2h = request.param
    e = JaxTransferKVEngine(transfer_sockets=2, pull_workers=2, sweep_interval_s=0.2,
                            raw_buffers=raw, d2h_staging=d2h)
    yield e
    e.close()


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_d2h_staging_holds_no_device_memory_and_pulls_the_same_bytes(dtype):
    """Mode B: the registered copies live in host memory (the device bytes held are 0) and D
    pulls exactly the device arrays' bytes, bfloat16 included (the transfer library warns
    about unpinned host buffers for it)."""
    e = JaxTransferKVEngine(transfer_sockets=2, pull_workers=2, d2h_staging=True)
    try:
        packed = [x[np.array([3, 1] + [0] * 6)].astype(dtype) for x in pool(2, True)]
        uuid, _ = e.register(5, packed, expire_s=30)
        held = e.registered_arrays(5)
        assert {a.sharding.memory_kind for a in held} == {e.staging_memory_kind}
        assert e.staging_memory_kind in ("pinned_host", "unpinned_host")
        assert e.registered_device_bytes() == 0
        assert e.registered_bytes() == sum(int(a.nbytes) for a in packed) > 0
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in packed]
        got = e.pull(e.address, uuid, specs, 30, room=5).result(timeout=60)
        for g, want in zip(got, packed, strict=True):
            assert g.dtype == want.dtype and g.sharding.memory_kind == "device"
            np.testing.assert_array_equal(np.asarray(g.astype(np.float32)),
                                          np.asarray(want.astype(np.float32)))
    finally:
        e.close()


def test_pull_after_p_dropped_its_references(engine):
    """P may drop its own references once registered (release before the pull): the transfer
    server keeps the buffers alive, in both modes, even while new arrays reuse memory."""
    import gc

    want = [np.full((1 << 18,), e, np.float32) + np.arange(1 << 18, dtype=np.float32)
            for e in range(6)]
    uuid, _ = engine.register(3, [jax.device_put(w) for w in want], expire_s=30)
    assert engine.release(3)
    gc.collect()
    churn = [jax.device_put(np.full((1 << 18,), -1.0, np.float32)) for _ in range(12)]
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    specs = [jax.ShapeDtypeStruct((1 << 18,), np.float32, sharding=dev)] * 6
    got = engine.pull(engine.address, uuid, specs, 30, room=3).result(timeout=60)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    del churn


def test_raw_buffers_setting():
    assert resolve_raw_buffers("auto", "cpu") is True
    assert resolve_raw_buffers("auto", "tpu") is False
    assert resolve_raw_buffers(False, "cpu") is False and resolve_raw_buffers(True, "tpu")
    with pytest.raises(ValueError, match="transfer_raw_buffers='yes'"):
        resolve_raw_buffers("yes", "cpu")


def test_register_pull_release_sharded(engine):
    packed = [x[np.array([3, 1] + [0] * 6)] for x in pool(2, True)]  # 2 pages in 8 wire rows
    uuid, deadline = engine.register(5, packed, expire_s=30)
    assert engine.num_registered() == 1 and deadline > time.time()
    specs = PoolTransferSpec.from_kv_caches(pool(2, False)).packed_specs(2)
    got = engine.pull(engine.address, uuid, specs, 30, room=5).result(timeout=60)
    for g, want in zip(got, packed, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
        assert g.sharding.is_equivalent_to(want.sharding, 4)
    assert engine.release(5) and not engine.release(5) and engine.num_registered() == 0
    with pytest.raises(ValueError, match="empty"):
        engine.register(6, [], 10)


def test_pull_of_unknown_uuid_times_out_and_reconnects(engine):
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    specs = [jax.ShapeDtypeStruct((4,), np.float32, sharding=one)]
    t0 = time.monotonic()
    fut = engine.pull(engine.address, 123456, specs, 1.0, room=77)
    with pytest.raises(KVTransferTimeout, match=r"room 77.*did not complete within 1 s"):
        fut.result(timeout=30)
    assert time.monotonic() - t0 < 5
    assert engine.num_connections() == 0  # poisoned and dropped
    x = jax.device_put(np.arange(4, dtype=np.float32), one)
    uuid, _ = engine.register(1, [x], 30)
    got = engine.pull(engine.address, uuid, specs, 30, room=1).result(timeout=60)
    np.testing.assert_array_equal(np.asarray(got[0]), np.arange(4))


def test_unpulled_registration_expires(engine):
    engine.register(9, [jax.device_put(np.ones(8, np.float32))], expire_s=0.5)
    assert engine.expired.get(timeout=10) == 9
    assert engine.num_registered() == 0


def test_fault_injection_fails_cleanly():
    e = JaxTransferKVEngine(transfer_sockets=1, pull_workers=1, fault_injection_prob=1.0)
    try:
        x = jax.device_put(np.ones(4, np.float32))
        uuid, _ = e.register(1, [x], 30)
        spec = [jax.ShapeDtypeStruct((4,), np.float32, sharding=x.sharding)]
        with pytest.raises(InjectedTransferFault, match="fault_injection_prob=1.0"):
            e.pull(e.address, uuid, spec, 10, room=1).result(timeout=30)
        assert e.faults.injected == 1
    finally:
        e.close()
    with pytest.raises(ValueError, match="fault_injection_prob"):
        JaxTransferKVEngine(fault_injection_prob=1.5)
    with pytest.raises(ValueError, match="transfer_sockets"):
        JaxTransferKVEngine(transfer_sockets=0)


def test_spec_checks():
    p = PoolTransferSpec.from_kv_caches(pool(2, False))
    check_packed_meta(p.packed_meta(3), p.packed_meta(3))
    assert (p.packed_meta(3).rows, p.packed_meta(3).page_count) == (8, 3)  # the wire's bucket
    assert p.packed_meta(9).rows == 16 and p.packed_meta(9).nbytes == p.packed_meta(16).nbytes
    with pytest.raises(SpecMismatchError, match="shape"):
        check_packed_meta(p.packed_meta(3), p.packed_meta(9))
    with pytest.raises(SpecMismatchError, match="page_count"):
        check_packed_meta(p.packed_meta(3), p.packed_meta(4))
    other = PoolTransferSpec.from_kv_caches(pool(2, False, dtype=np.float16))
    with pytest.raises(SpecMismatchError, match="dtype"):
        check_packed_meta(other.packed_meta(3), p.packed_meta(3))
    one = PoolTransferSpec.from_kv_caches(pool(1, False))
    with pytest.raises(SpecMismatchError, match="sharding"):
        check_packed_meta(one.packed_meta(3), p.packed_meta(3))
    assert PackedMeta.from_dict(p.packed_meta(3).to_dict()) == p.packed_meta(3)


def test_kvargs_validation():
    main = PoolTransferSpec.from_kv_caches(pool(1, False))
    assert KVArgs(pools=[main]).main is main
    draft = PoolTransferSpec(name="draft", pool_type="draft_kv", dtype="float32",
                             shape=SHAPE)
    with pytest.raises(NotImplementedError, match="draft_kv"):
        KVArgs(pools=[main, draft])
    with pytest.raises(ValueError, match="unknown pool_type 'mamba'"):
        PoolTransferSpec(name="s", pool_type="mamba", dtype="float32", shape=(1,))
    with pytest.raises(ValueError, match="non-empty"):
        KVArgs(pools=[])


# ------------------------------------------------------------------ manager level

@pytest.fixture
def managers():
    made = []

    def make(role, kv, **kw):
        m = make_mgr(role, kv, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_manager_flow_want_first(managers):
    P = managers("prefill", pool(2, True))
    D = managers("decode", pool(2, False))
    recv = D.create_receiver(42, P.channel.address)
    assert recv.poll() == KVPoll.Bootstrapping
    sender = P.create_sender(42)
    drive(sender, until=lambda s: s[0] == KVPoll.WaitingForInput)  # D's want arrived
    recv.init([10, 0, 7])
    assert recv.poll() == KVPoll.WaitingForInput
    sender.send([1, 2, 3], prompt_len=11, first_token=9, first_logprob=-0.5)
    drive(sender, recv, until=done)
    assert sender.poll() == recv.poll() == KVPoll.Success
    assert recv.ready_info.first_token == 9 and recv.ready_info.prompt_len == 11
    src = [np.asarray(x) for x in P.runner.kv_caches]
    for e, kv in enumerate(D.runner.kv_caches):
        got = np.asarray(kv)
        np.testing.assert_array_equal(got[[10, 0, 7]], src[e][[1, 2, 3]])
        assert not np.delete(got, [10, 0, 7], axis=0).any()
    assert P.num_registered() == 0 and P.num_active() == (0, 0) and D.num_active() == (0, 0)


def test_late_want_from_another_layout_is_cut_again(managers):
    """P (tp=2) registered before D's want said D is one device: P cuts D's piece from its
    registration and D gets the right pages."""
    P = managers("prefill", pool(2, True))
    D = managers("decode", pool(1, False))
    sender = P.create_sender(1)
    sender.send([1, 2])
    uuid_before = sender.ready_msg.transfer_uuid
    recv = D.create_receiver(1, P.channel.address)
    recv.init([3, 4])
    drive(sender, recv, until=done)
    assert recv.poll() == sender.poll() == KVPoll.Success, recv.failure_exception()
    assert sender.ready_msg.transfer_uuid != uuid_before
    want = np.asarray(P.runner.kv_caches[1])[[1, 2]]
    np.testing.assert_array_equal(np.asarray(D.runner.kv_caches[1])[[3, 4]], want)


def test_manager_mismatch_fails_both_sides(managers):
    P = managers("prefill", pool(2, True))
    D = managers("decode", pool(2, False, dtype=np.int32))  # D's pool holds other values
    sender = P.create_sender(1)
    sender.send([1, 2])
    recv = D.create_receiver(1, P.channel.address)
    recv.init([3, 4])
    drive(sender, recv, until=done)
    assert recv.poll() == sender.poll() == KVPoll.Failed
    assert isinstance(recv.failure_exception(), SpecMismatchError)
    assert "dtype" in str(recv.failure_exception())
    assert "dtype" in str(sender.failure_exception())   # D told P why
    assert P.num_registered() == 0
    # page count mismatch
    P2 = managers("prefill", pool(1, True))
    s2 = P2.create_sender(2)
    s2.send([1, 2, 3])
    r2 = D.create_receiver(2, P2.channel.address)
    r2.init([5])
    drive(s2, r2, until=done)
    assert "P sends 3 pages, D preallocated 1" in str(r2.failure_exception())
    assert s2.poll() == KVPoll.Failed and P2.num_registered() == 0


def test_manager_abort_and_kv_timeout(managers):
    P = managers("prefill", pool(1, True))
    D = managers("decode", pool(1, False), kv_timeout_s=1.0)
    sender = P.create_sender(5)
    recv = D.create_receiver(5, P.channel.address)
    recv.init([1])
    drive(sender, until=lambda s: s[0] == KVPoll.WaitingForInput)
    sender.abort("prefill failed: out of memory", status=503)
    drive(recv, until=done)
    err = recv.failure_exception()
    assert recv.poll() == KVPoll.Failed and "out of memory" in str(err) and err.status == 503
    # nobody ever answers room 6 (P has no sender): D fails after kv_timeout_s
    t0 = time.monotonic()
    r6 = D.create_receiver(6, P.channel.address)
    r6.init([2])
    drive(r6, until=done)
    assert time.monotonic() - t0 < 5
    assert r6.failure_exception().status == 504 and "kv_timeout_s=1" in str(r6.failure_exception())
    with pytest.raises(KVTransferError, match="already has a receiver"):
        D.create_receiver(7, P.channel.address) and D.create_receiver(7, P.channel.address)
    with pytest.raises(ValueError, match="bootstrap_room"):
        D.create_receiver(-1, P.channel.address)
    with pytest.raises(ValueError, match="host:port"):
        D.create_receiver(8, "nohost")


def test_transfer_uuids_are_random_and_never_a_live_one(engine):
    """Whoever reaches the transfer port and knows a uuid can pull that KV: uuids are 63 random
    bits (`secrets`), not a counter, and never one registered right now."""
    uuids = [engine.new_uuid() for _ in range(200)]
    assert len(set(uuids)) == 200 and all(0 < u < 2**63 for u in uuids)
    deltas = {b - a for a, b in zip(uuids, uuids[1:], strict=False)}
    assert len(deltas) > 190  # not a base plus a counter
    assert sum(u >= 2**55 for u in uuids) > 150  # the high bits are used
    x = jax.device_put(np.arange(4, dtype=np.float32))
    live, _ = engine.register(11, [x], 30)
    assert live not in {engine.new_uuid() for _ in range(50)}
    engine.release(11)
