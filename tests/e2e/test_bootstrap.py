"""Bootstrap server over real HTTP: a real uvicorn process on 127.0.0.1, driven by httpx."""

from __future__ import annotations

import time

import httpx
import pytest

from pdtopo.ports import free_port
from pdtopo.runtime.bootstrap.client import BootstrapClient, BootstrapError, RegistrationKeeper
from pdtopo.runtime.bootstrap.protocol import Registration
from pdtopo.runtime.bootstrap.registry import InstanceRegistry
from tests.support.bootstrap import TOKEN, start_bootstrap, stop_bootstrap


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_bootstrap(port, ttl=1.5)
    yield f"http://127.0.0.1:{port}"
    stop_bootstrap(proc)


def _reg(role="prefill", instance="prefill_0", tp_rank=0, tp_size=1, zmq_port=32000, **kw):
    return Registration(
        role=role, instance_id=instance, tp_rank=tp_rank, tp_size=tp_size,
        transfer_addr="127.0.0.1:31000", zmq_addr=f"127.0.0.1:{zmq_port}",
        http_addr="127.0.0.1:30000", page_size=16, kv_dtype="float32", model="tiny", **kw,
    )


@pytest.mark.slow
def test_register_list_route_and_find(server):
    c = BootstrapClient(server, TOKEN)
    assert c.register(_reg(tp_rank=0, tp_size=2, zmq_port=32010))["status"] == "registered"
    c.register(_reg(tp_rank=1, tp_size=2, zmq_port=32011))
    c.register(_reg(role="decode", instance="decode_0", zmq_port=32020))
    prefill = c.list("prefill")
    assert {(e["instance_id"], e["tp_rank"]) for e in prefill} >= {("prefill_0", 0), ("prefill_0", 1)}
    assert all(e["role"] == "prefill" for e in prefill)
    assert any(e["role"] == "decode" for e in c.list())
    r1 = c.route("prefill", "prefill_0", {"tp_rank": 1})
    assert r1["zmq_addr"] == "127.0.0.1:32011" and r1["tp_size"] == 2
    assert c.find_prefill("localhost", 32010)["tp_rank"] == 0
    with pytest.raises(BootstrapError, match="no live prefill instance"):
        c.find_prefill("127.0.0.1", 1)
    with pytest.raises(BootstrapError, match="404"):
        c.route("prefill", "prefill_0", {"tp_rank": 5})


@pytest.mark.slow
def test_heartbeat_and_ttl_expiry(server):
    c = BootstrapClient(server, TOKEN)
    c.register(_reg(instance="prefill_ttl", zmq_port=32030))
    hb = {"role": "prefill", "instance_id": "prefill_ttl"}
    for _ in range(4):  # heartbeats every 0.5 s keep it alive past the 1.5 s TTL
        time.sleep(0.5)
        assert httpx.post(f"{server}/heartbeat", json=hb,
                          headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert c.route("prefill", "prefill_ttl")["instance_id"] == "prefill_ttl"
    time.sleep(2.2)  # heartbeats stop: removed after the TTL
    assert all(e["instance_id"] != "prefill_ttl" for e in c.list("prefill"))
    resp = httpx.post(f"{server}/heartbeat", json=hb, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 404 and "register again" in resp.json()["detail"]


@pytest.mark.slow
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_wrong_token_is_401(server, headers):
    body = _reg(instance="intruder").model_dump()
    resp = httpx.put(f"{server}/route", json=body, headers=headers)
    assert resp.status_code == 401 and "token" in resp.json()["detail"]
    assert httpx.get(f"{server}/list", headers=headers).status_code == 401
    assert httpx.post(f"{server}/heartbeat", json={"role": "prefill", "instance_id": "x"},
                      headers=headers).status_code == 401
    ok = BootstrapClient(server, TOKEN).list()
    assert all(e["instance_id"] != "intruder" for e in ok)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: b.update(role="router"), "role"),
        (lambda b: b.update(tp_rank=2, tp_size=2), "tp_rank"),
        (lambda b: b.update(zmq_addr="nohostport"), "zmq_addr"),
        (lambda b: b.update(transfer_addr="127.0.0.1:99999"), "transfer_addr"),
        (lambda b: b.update(page_size=0), "page_size"),
        (lambda b: b.pop("instance_id"), "instance_id"),
        (lambda b: b.update(tp_rank="zero"), "tp_rank"),
    ],
)
def test_malformed_payloads_are_400_naming_the_field(server, mutate, field):
    body = _reg(instance="bad").model_dump()
    mutate(body)
    resp = httpx.put(f"{server}/route", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 400, resp.text
    assert field in " ".join(resp.json()["detail"])
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.slow
def test_garbage_bodies_keep_server_up(server):
    h = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for raw in (b"{", b"[]", b"null", b"\xff\xfe", b'{"role": 1}' * 1000):
        resp = httpx.put(f"{server}/route", content=raw, headers=h)
        assert 400 <= resp.status_code < 500
    resp = httpx.get(f"{server}/route", params={"role": "prefill"}, headers=h)
    assert resp.status_code == 400 and "instance_id" in " ".join(resp.json()["detail"])
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/openapi.json").json()["info"]["title"] == "pdtopo bootstrap server"


@pytest.mark.slow
def test_keeper_reregisters_after_bootstrap_restart():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_bootstrap(port, ttl=3.0)
    client = BootstrapClient(url, TOKEN, timeout_s=2)
    keeper = RegistrationKeeper(client, _reg(instance="prefill_keep", zmq_port=32040),
                                interval_s=0.3).start()
    try:
        assert keeper.wait_registered(10)
        time.sleep(1.0)
        assert client.route("prefill", "prefill_keep")["instance_id"] == "prefill_keep"
        assert keeper.registrations == 1  # heartbeats, not re-registrations, while up
        stop_bootstrap(proc)
        time.sleep(1.0)
        proc = start_bootstrap(port, ttl=3.0)  # a fresh server with an empty registry
        deadline = time.monotonic() + 3.0  # within one TTL
        while time.monotonic() < deadline:
            if any(e["instance_id"] == "prefill_keep" for e in client.list("prefill")):
                break
            time.sleep(0.1)
        assert client.route("prefill", "prefill_keep")["zmq_addr"] == "127.0.0.1:32040"
        assert keeper.registrations >= 2
    finally:
        keeper.stop()
        client.close()
        stop_bootstrap(proc)


def test_registry_ttl_with_fake_clock():
    now = [0.0]
    reg = InstanceRegistry(ttl_s=15, clock=lambda: now[0])
    reg.register(_reg().model_dump())
    now[0] = 10
    assert reg.heartbeat("prefill", "prefill_0", {})
    now[0] = 24
    assert len(reg.list()) == 1
    now[0] = 25.5
    assert reg.list() == [] and not reg.heartbeat("prefill", "prefill_0", {})
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        InstanceRegistry(ttl_s=0)
