"""Two hosts for real, and a stranger beside them: three Linux network namespaces (A
10.200.0.1, B 10.200.0.2, C 10.200.0.3, /24) joined through a bridge that lives in a fourth
namespace, all created by this test. Host A runs bootstrap, prefill and the proxy, host B the
decode server, each started with
`ip netns exec NS pdtopo launch --detach [+host=NAME] topology=1p1d_cpu_2host ...`, so every
KV transfer, side-channel message and bootstrap lookup crosses the bridge. Greedy output
through the proxy must equal a colocated server's. C is on the same network but not in the
deployment: it cannot register or heartbeat at the bootstrap server (401), cannot complete a
CURVE handshake with P's side channel (P's received/dropped counters do not move), and gets 401
from P's and D's HTTP APIs without the proxy API key and 200 with it, while the deployment keeps
serving colocated tokens. Everything is torn down and the namespaces deleted. Skipped only
where namespaces cannot be created (no `ip`, no privileges), and under CI=true a failure
there (tests/support/ci.py)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdtopo.runtime.disagg.transport.curve import deployment_keys
from tests.support.ci import missing, require_tool
from tests.support.constants import ONE_LAYER, greedy
from tests.support.e2e import REPO_ROOT, ColocatedServer, generate, port_block, processes_of_run

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a"]
GREEDY = greedy(8)
ADDR = {"a": "10.200.0.1", "b": "10.200.0.2", "c": "10.200.0.3"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


class Namespaces:
    """Three namespaces, each with a veth pair whose other end is a port of one bridge in a
    fourth namespace (the "switch"); names unique per run."""

    SIDES = "abc"

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.ns = {side: f"pdtopo-{tag}-{side}" for side in self.SIDES}
        self.switch = f"pdtopo-{tag}-sw"
        self.veth = {side: f"pdt{tag}{side}" for side in self.SIDES}  # <= 15 chars
        self.created: list[str] = []

    def create(self) -> None:
        for ns in (self.switch, *self.ns.values()):
            _ip("netns", "add", ns)
            self.created.append(ns)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for side in self.SIDES:
            ns, dev, port = self.ns[side], self.veth[side], self.veth[side] + "s"
            _ip("link", "add", dev, "type", "veth", "peer", "name", port)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{ADDR[side]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        for side in self.SIDES:  # only if still in this namespace (a failed create)
            _ip("link", "del", self.veth[side], check=False)
        for ns in self.created:
            _ip("netns", "delete", ns, check=False)
        self.created = []

    def exec(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]


def _namespaces_or_skip() -> Namespaces:
    require_tool("ip", "apt-get install -y iproute2 (.ci/run installs it)")
    nss = Namespaces()
    try:
        nss.create()
    except subprocess.CalledProcessError as exc:
        nss.delete()
        missing(f"cannot create network namespaces here ({' '.join(exc.cmd)}: "
                f"{exc.stderr.strip()})", "run the test as root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
    return nss


def _pdtopo(nss: Namespaces, side: str, args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([*nss.exec(side), sys.executable, "-m", "pdtopo.cli", *args],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _kill_run(run_dir: Path) -> None:
    for pid in processes_of_run(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    nss = _namespaces_or_skip()
    run_dir = tmp_path_factory.mktemp("netns") / "run"
    env = {**os.environ, "PDTOPO_DEPLOYMENT_TOKEN": secrets.token_hex(16)}
    common = ["launch", "--detach", "topology=1p1d_cpu_2host", "server.bind_host=null",
              *ONE_LAYER, f"hydra.run.dir={run_dir}"]
    try:
        # host A is named; host B is found by its address (10.200.0.2 is bound only in B)
        procs = {"a": _pdtopo(nss, "a", [*common, "+host=host-a"], env),
                 "b": _pdtopo(nss, "b", common, env)}
        outs = {side: p.communicate(timeout=600)[0] for side, p in procs.items()}
        for side, p in procs.items():
            assert p.returncode == 0, f"launch on host {side} failed:\n{outs[side]}"
        yield nss, run_dir, outs
    finally:
        for side in "ab":
            host_dir = run_dir / "hosts" / f"host-{side}"
            if (host_dir / "supervisord.conf").exists():
                subprocess.run([*nss.exec(side), sys.executable, "-m", "pdtopo.cli", "stop",
                                str(host_dir)], cwd=REPO_ROOT, capture_output=True, timeout=120)
        time.sleep(0.5)
        left = processes_of_run(run_dir)
        _kill_run(run_dir)
        nss.delete()
        assert left == [], f"processes of {run_dir} alive after pdtopo stop: {left}"
        assert not {*nss.ns.values(), nss.switch} & set(_ip("netns", "list").stdout.split())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    log = tmp_path_factory.mktemp("colocated") / "server.log"
    with ColocatedServer(port_block(1), ONE_LAYER, log_path=log) as server:
        yield {p: generate(server.url, {"text": p, "sampling_params": GREEDY}) for p in PROMPTS}


def _in(nss: Namespaces, side: str, action: str, args: dict) -> dict:
    """Run one tests.support.netns_outsider action inside namespace `side`."""
    res = subprocess.run([*nss.exec(side), sys.executable, "-m", "tests.support.netns_outsider", action,
                          json.dumps(args)], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def _secrets(run_dir: Path) -> tuple[str, str]:
    """(the deployment token, the proxy API key derived from it), as host A's run dir has
    them (beyond loopback with no proxy.api_key, the launcher derives the key)."""
    host_a = run_dir / "hosts" / "host-a"
    return ((host_a / "token").read_text().strip(), (host_a / "api_key").read_text().strip())


def _proxy_tokens(nss: Namespaces, key: str, reference: dict) -> None:
    for prompt, ref in reference.items():
        out = _in(nss, "a", "http", {"method": "POST", "url": f"http://{ADDR['a']}:8000/generate",
                                     "headers": _bearer(key),
                                     "json": {"text": prompt, "sampling_params": GREEDY}})
        assert out["status"] == 200, out
        assert out["body"]["output_ids"] == ref["output_ids"], prompt
        assert out["body"]["text"] == ref["text"]


def _state(nss: Namespaces, side: str, url: str, token: str) -> dict:
    out = _in(nss, side, "http", {"method": "GET", "url": f"{url}/pdtopo/state",
                                  "headers": _bearer(token)})
    assert out["status"] == 200, out
    return out["body"]


def test_each_host_runs_only_its_programs(two_hosts):
    nss, run_dir, outs = two_hosts
    for side, names in (("a", {"bootstrap", "prefill_0", "proxy"}), ("b", {"decode_0"})):
        conf = (run_dir / "hosts" / f"host-{side}" / "supervisord.conf").read_text()
        assert {line[9:-1] for line in conf.splitlines() if line.startswith("[program:")} == names
    plan = json.loads((run_dir / "hosts" / "host-b" / "plan.json").read_text())
    decode = next(p for p in plan["processes"] if p["name"] == "decode_0")
    assert decode["address"] == ADDR["b"] and decode["host"] == "host-b"
    # the token is shared (from the launcher's environment)
    tokens = {(run_dir / "hosts" / f"host-{s}" / "token").read_text() for s in "ab"}
    assert len(tokens) == 1


P_URL, D_URL = f"http://{ADDR['a']}:30000", f"http://{ADDR['b']}:30001"


def test_proxy_output_equals_colocated_across_the_bridge(two_hosts, reference):
    nss, run_dir, _ = two_hosts
    token, key = _secrets(run_dir)
    no_key = _in(nss, "a", "http", {"method": "POST", "url": f"http://{ADDR['a']}:8000/generate",
                                    "json": {"text": "hi", "sampling_params": GREEDY}})
    assert no_key["status"] == 401  # the router checks the derived key
    _proxy_tokens(nss, key, reference)
    # D lives in namespace B: the only way its pulls reached P (10.200.0.1) is the bridge
    state = _state(nss, "b", D_URL, token)
    assert state["role"] == "decode" and state["ready"] and state["pd_transfers"] == 0
    # beyond loopback the side channel speaks CURVE (disaggregation.side_channel_curve: auto)
    p_state = _state(nss, "a", P_URL, token)
    assert state["pd_side_channel_curve"] is True and p_state["pd_side_channel_curve"] is True
    assert p_state["pd_side_channel_curve_denied"] == 0 and p_state["pd_side_channel_dropped"] == 0


def test_a_stranger_on_the_network_gets_nowhere_without_the_credentials(two_hosts, reference):
    """C shares the deployment's network but not its token or key."""
    nss, run_dir, _ = two_hosts
    token, key = _secrets(run_dir)
    prompt = PROMPTS[0]
    body = {"text": prompt, "sampling_params": GREEDY}
    p_before = _state(nss, "a", P_URL, token)

    # the bootstrap registry: no registration, heartbeat or lookup without the token
    boot = f"http://{ADDR['a']}:8998"
    fake = {"role": "prefill", "instance_id": "intruder", "zmq_addr": f"{ADDR['c']}:1"}
    for method, path, payload in (("PUT", "/route", fake),
                                  ("POST", "/heartbeat", {"role": "prefill",
                                                          "instance_id": "prefill_0"}),
                                  ("GET", "/list", None)):
        for headers in ({}, _bearer(key)):  # the proxy's key is not the deployment token
            out = _in(nss, "c", "http", {"method": method, "url": f"{boot}{path}",
                                         "headers": headers, "json": payload})
            assert out["status"] == 401, (path, out)

    # P's side channel: no CURVE handshake completes, so nothing reaches P's scheduler
    _in(nss, "c", "side_channel", {"address": f"{ADDR['a']}:32000",
                                   "server_public_z85": deployment_keys(token).public.decode()})
    p_after = _state(nss, "a", P_URL, token)
    assert p_after["pd_side_channel_received"] == p_before["pd_side_channel_received"]
    assert p_after["pd_side_channel_dropped"] == p_before["pd_side_channel_dropped"]
    assert p_after["pd_side_channel_curve_denied"] > p_before["pd_side_channel_curve_denied"]

    # P's and D's HTTP APIs: 401 without the key (or with a wrong one), 200 with it
    for url in (P_URL, D_URL):
        for headers in ({}, _bearer(key[::-1])):
            out = _in(nss, "c", "http", {"method": "POST", "url": f"{url}/generate",
                                         "headers": headers, "json": body})
            assert out["status"] == 401, (url, out)
            assert "credential" in out["body"]["error"]["message"]
        health = _in(nss, "c", "http", {"method": "GET", "url": f"{url}/health"})
        assert health["status"] == 200  # the router's health checks carry no credential
    room_body = {**body, "bootstrap_host": ADDR["a"], "bootstrap_port": 32000,
                 "bootstrap_room": 4711}
    keyed = _in(nss, "c", "pair", {"p_url": f"{P_URL}/generate", "d_url": f"{D_URL}/generate",
                                   "headers": _bearer(key), "body": room_body})
    assert keyed["p"]["status"] == 200 and keyed["d"]["status"] == 200, keyed
    assert keyed["d"]["body"]["output_ids"] == reference[prompt]["output_ids"]

    # the deployment served colocated tokens throughout, its own peers still admitted
    _proxy_tokens(nss, key, reference)
    p_end = _state(nss, "a", P_URL, token)
    assert p_end["pd_side_channel_received"] > p_after["pd_side_channel_received"]
    assert p_end["pd_side_channel_dropped"] == p_before["pd_side_channel_dropped"]
