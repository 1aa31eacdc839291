"""Security, port conflicts and bad input against real deployments.

Two PD deployments run side by side on one host with different port bases: A uses the Rust
router with an API key read from a file, B uses MiniLB without a key. A colocated server with
the same model is the token reference. Checked on the real processes:
  - the proxy rejects requests without the key (401) and serves them with it; the key appears
    in no process's command line, nor in plan.json / config.yaml;
  - the bootstrap server answers 401 to registration, heartbeat and lookups without the
    per-deployment token, and its registry is intact afterwards;
  - every listening socket of the deployment is bound to 127.0.0.1;
  - a prefill rejection (too long, bad sampling values) reaches the client as the same clear
    400 at once; D generates nothing for it and every pool is back at its baseline;
  - side-channel garbage sent to P's ZMQ ROUTER (random bytes, truncated, oversized, wrong
    version, wrong direction, unknown room, another D's room) is dropped and counted, P keeps
    serving;
  - launching a third deployment on A's ports fails before starting anything, naming the port
    and the program, and A keeps serving; A and B both serve the reference tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import zmq

from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
    ColocatedServer,
    Deployment,
    deployment_overrides,
    generate,
    pool_state,
    port_block,
    processes_of_run,
    run_pdtopo,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

GREEDY = greedy(8)
PROMPT = "The capital of France is"
API_KEY = "pdtopo-test-key-5b1e0c"


def _stop(dep: Deployment) -> None:
    dep.stop()
    time.sleep(0.5)
    left = processes_of_run(dep.run_dir)
    assert left == [], f"processes of {dep.run_dir} still alive after pdtopo stop: {left}"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "api_key"
    path.write_text(API_KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def deps(tmp_path_factory, key_file):
    root = tmp_path_factory.mktemp("side-by-side")
    a = Deployment(root / "a", ["proxy=rust", f"proxy.api_key_file={key_file}", *TWO_LAYERS,
                                *deployment_overrides(port_block(40))])
    b = Deployment(root / "b", ["proxy=mini_lb", *TWO_LAYERS, *deployment_overrides(port_block(40))])
    ref = ColocatedServer(port_block(1), TWO_LAYERS, log_path=root / "colocated.log")
    started = []
    try:
        for dep in (a, b):
            dep.launch()
            started.append(dep)
        ref.start()
        yield {"a": a, "b": b, "ref": ref}
    finally:
        ref.stop()
        for dep in started:
            _stop(dep)


@pytest.fixture(scope="module")
def reference(deps):
    return generate(deps["ref"].url, {"text": PROMPT, "sampling_params": GREEDY})


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, headers=headers or {}, timeout=120)


def _servers(dep: Deployment) -> list[str]:
    return dep.names("prefill") + dep.names("decode")


# ---------------------------------------------------------------------------- item 9: API key

def test_proxy_requires_api_key(deps, reference):
    a = deps["a"]
    body = {"text": PROMPT, "sampling_params": GREEDY}
    for headers in ({}, _auth("wrong-key")):
        resp = _post(a.proxy_url, body, headers)
        assert resp.status_code == 401, (headers, resp.status_code, resp.text)
    resp = httpx.post(f"{a.proxy_url}/v1/completions", timeout=60,
                      json={"model": "x", "prompt": PROMPT, "max_tokens": 2})
    assert resp.status_code == 401
    resp = _post(a.proxy_url, body, _auth(API_KEY))
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == reference["output_ids"]


def test_api_key_stays_off_command_lines_and_plan(deps):
    a = deps["a"]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            assert API_KEY.encode() not in cmd, f"pid {entry.name} has the API key in argv"
    for name in ("plan.json", "config.yaml"):
        assert API_KEY not in (a.run_dir / name).read_text(), name
    conf = a.run_dir / "supervisord.conf"
    assert oct(conf.stat().st_mode & 0o777) == "0o600"


# ---------------------------------------------------------------------------- item 9: token

def test_bootstrap_requires_deployment_token(deps):
    a = deps["a"]
    boot = a.plan["bootstrap_url"]
    token = (a.run_dir / "token").read_text().strip()
    good = _auth(token)
    before = httpx.get(f"{boot}/list", headers=good, timeout=10)
    assert before.status_code == 200
    entries = before.json()
    assert {e["role"] for e in entries} == {"prefill", "decode"}
    fake = {**entries[0], "instance_id": "intruder", "zmq_addr": "127.0.0.1:1"}
    hb = {"role": entries[0]["role"], "instance_id": entries[0]["instance_id"]}
    for headers in ({}, _auth("not-the-token"), {"Authorization": token}):
        assert httpx.put(f"{boot}/route", json=fake, headers=headers).status_code == 401
        assert httpx.post(f"{boot}/heartbeat", json=hb, headers=headers).status_code == 401
        assert httpx.get(f"{boot}/list", headers=headers).status_code == 401
        assert httpx.get(f"{boot}/route", headers=headers, params={
            "role": "prefill", "instance_id": "prefill_0"}).status_code == 401
    # B's token does not open A's registry either
    other = (deps["b"].run_dir / "token").read_text().strip()
    assert other != token
    assert httpx.put(f"{boot}/route", json=fake, headers=_auth(other)).status_code == 401
    after = httpx.get(f"{boot}/list", headers=good, timeout=10).json()
    strip = lambda es: sorted((e["instance_id"], e["zmq_addr"]) for e in es)  # noqa: E731
    assert strip(after) == strip(entries)


# ---------------------------------------------------------------------------- item 9: loopback

def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in (Path("/proc") / str(pid) / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _listening() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket (IPv4 and IPv6)."""
    out = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            if v6:
                addr = "::1" if hexaddr == "00000000000000000000000001000000" else (
                    "::" if set(hexaddr) == {"0"} else hexaddr)
            else:
                addr = ".".join(str(b) for b in reversed(bytes.fromhex(hexaddr)))
            out[f[9]] = (addr, int(hexport, 16))
    return out


def test_every_listening_socket_is_loopback(deps):
    a = deps["a"]
    supervisord = int((a.run_dir / "supervisord.pid").read_text().strip())
    pids = _descendants(supervisord)
    listening = _listening()
    ours = {}
    for pid in pids:
        for inode in _socket_inodes(pid):
            if inode in listening:
                ours[listening[inode]] = pid
    assert ours, "no listening socket found for the deployment"
    exposed = {k: v for k, v in ours.items() if k[0] not in ("127.0.0.1", "::1")}
    assert not exposed, f"sockets not bound to loopback (addr, port) -> pid: {exposed}"
    planned = {port for p in a.plan["processes"] for kind, port in p["ports"].items()
               if not (p["role"] == "decode" and kind == "zmq")}  # D only connects (DEALER)
    bound = {port for _, port in ours}
    assert planned <= bound, f"planned ports not listening: {sorted(planned - bound)}"


# ---------------------------------------------------------------------------- item 4

@pytest.mark.parametrize("body, field", [
    ({"input_ids": [5] * 1100, "sampling_params": {"max_new_tokens": 4}}, "max_model_len"),
    ({"text": "hello", "sampling_params": {"temperature": -1.0}}, "temperature"),
    ({"text": "hello", "sampling_params": {"top_p": 2.5}}, "top_p"),
])
def test_prefill_rejection_is_a_clear_400_and_d_decodes_nothing(deps, reference, body, field):
    a = deps["a"]
    before = {n: pool_state(a.url(n)) for n in _servers(a)}
    t0 = time.monotonic()
    resp = _post(a.proxy_url, body, _auth(API_KEY))
    took = time.monotonic() - t0
    assert resp.status_code == 400, resp.text
    assert field in resp.text
    assert took < 5.0, f"rejection took {took:.1f}s"
    _, states = wait_pools_baseline(a)
    for name in a.names("decode"):
        assert states[name]["num_generated"] == before[name]["num_generated"], name
        assert states[name]["num_forward"] == before[name]["num_forward"], name
    out = _post(a.proxy_url, {"text": PROMPT, "sampling_params": GREEDY}, _auth(API_KEY))
    assert out.json()["output_ids"] == reference["output_ids"]


# ---------------------------------------------------------------------------- items 8 + 9

def _dealer(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"tcp://{endpoint}")
    return sock


def _msg(**fields) -> bytes:
    return json.dumps({"v": 1, **fields}).encode()


def test_side_channel_garbage_is_dropped_and_prefill_keeps_serving(deps, reference):
    a = deps["a"]
    p = a.process("prefill_0")
    endpoint = f"{p['address']}:{p['ports']['zmq']}"
    dropped0 = pool_state(a.url("prefill_0"))["pd_side_channel_dropped"]
    ctx = zmq.Context()
    rogue = _dealer(ctx, endpoint, b"rogue-d")
    owner = _dealer(ctx, endpoint, b"owner-d")
    room = 987654321
    garbage = [
        os.urandom(64),                                        # random bytes
        _msg(type="done", room=5, ok=True)[:-7],                # truncated JSON
        b"x" * 70000,                                          # oversized (> 65536)
        json.dumps({"v": 99, "type": "want", "room": 1}).encode(),  # wrong version
        _msg(type="launch_missiles", room=1),                   # unknown type
        _msg(type="ready", room=1, transfer_addr="a:1"),         # wrong direction (P gets no ready)
        _msg(type="want", room=-3),                             # room out of range
        _msg(type="done", room=424242, ok=True),                # unknown room
        _msg(type="failed", room=424243, reason="x"),           # unknown room
    ]
    try:
        owner.send(_msg(type="want", room=room))   # owner-d claims the room
        time.sleep(0.3)
        for raw in garbage:
            rogue.send(raw)
        rogue.send_multipart([b"part1", b"part2"])             # two payload frames
        # another D's room: claiming, finishing or failing it from rogue-d is refused
        rogue.send(_msg(type="want", room=room))
        rogue.send(_msg(type="done", room=room, ok=True))
        rogue.send(_msg(type="failed", room=room, reason="hijack"))
        expected = len(garbage) + 1 + 3
        deadline = time.monotonic() + 10
        while True:
            dropped = pool_state(a.url("prefill_0"))["pd_side_channel_dropped"] - dropped0
            if dropped >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert dropped == expected, f"dropped {dropped}, expected {expected}"
    finally:
        rogue.close()
        owner.close()
        ctx.term()
    for _ in range(2):
        out = _post(a.proxy_url, {"text": PROMPT, "sampling_params": GREEDY}, _auth(API_KEY))
        assert out.json()["output_ids"] == reference["output_ids"]
    wait_pools_baseline(a)


# ---------------------------------------------------------------------------- item 10

def test_two_deployments_side_by_side_serve_reference_tokens(deps, reference):
    a, b = deps["a"], deps["b"]
    ports_a = {port for p in a.plan["processes"] for port in p["ports"].values()}
    ports_b = {port for p in b.plan["processes"] for port in p["ports"].values()}
    assert not ports_a & ports_b
    body = {"text": PROMPT, "sampling_params": GREEDY}
    for _ in range(2):
        assert _post(a.proxy_url, body, _auth(API_KEY)).json()["output_ids"] \
            == reference["output_ids"]
        assert generate(b.proxy_url, body)["output_ids"] == reference["output_ids"]
    wait_pools_baseline(a)
    wait_pools_baseline(b)


def test_launch_on_a_live_deployments_ports_fails_before_starting_anything(deps, tmp_path,
                                                                          reference):
    a = deps["a"]
    run = tmp_path / "c"
    t0 = time.monotonic()
    res = run_pdtopo(["launch", "--detach", *a.overrides, f"hydra.run.dir={run}"], timeout=120)
    took = time.monotonic() - t0
    err = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 2, err
    assert "already in use" in err
    bootstrap_port = a.process("bootstrap")["ports"]["http"]
    assert "topology.bootstrap.port" in err and f"port {bootstrap_port} for program bootstrap" in err
    assert not run.exists(), "a run dir was written although a port was taken"
    assert processes_of_run(run) == []
    assert took < 60
    out = _post(a.proxy_url, {"text": PROMPT, "sampling_params": GREEDY}, _auth(API_KEY))
    assert out.json()["output_ids"] == reference["output_ids"]
