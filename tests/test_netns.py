"""Two hosts for real: Linux network namespaces joined by a veth pair (10.200.0.1/24 and
10.200.0.2/24, only inside namespaces this test creates). Host A runs bootstrap, prefill and
the proxy, host B the decode server, each started with
`ip netns exec NS pdtopo launch --detach [+host=NAME] topology=1p1d_cpu_2host ...`, so every
KV transfer, side-channel message and bootstrap lookup crosses the veth interface. Greedy
output through the proxy must equal a colocated server's; everything is torn down and the
namespaces deleted. Skipped only where namespaces cannot be created (no `ip`, no privileges)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e_support import REPO_ROOT, ColocatedServer, generate, port_block, processes_of_run

pytestmark = pytest.mark.slow

MODEL = ["model.num_layers=1"]
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a"]
GREEDY = {"max_new_tokens": 8, "temperature": 0}
ADDR = {"a": "10.200.0.1", "b": "10.200.0.2"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


class Namespaces:
    """Two namespaces with a veth pair between them; names unique per run."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.ns = {"a": f"pdtopo-{tag}-a", "b": f"pdtopo-{tag}-b"}
        self.veth = {"a": f"pdt{tag}a", "b": f"pdt{tag}b"}  # <= 15 chars
        self.created: list[str] = []

    def create(self) -> None:
        for side in "ab":
            _ip("netns", "add", self.ns[side])
            self.created.append(self.ns[side])
        _ip("link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"])
        for side in "ab":
            ns, dev = self.ns[side], self.veth[side]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDR[side]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        _ip("link", "del", self.veth["a"], check=False)  # only if still in this namespace
        for ns in self.created:
            _ip("netns", "delete", ns, check=False)
        self.created = []

    def exec(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]


def _namespaces_or_skip() -> Namespaces:
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: apt-get install -y iproute2")
    nss = Namespaces()
    try:
        nss.create()
    except subprocess.CalledProcessError as exc:
        nss.delete()
        pytest.skip(f"cannot create network namespaces here ({' '.join(exc.cmd)}: "
                    f"{exc.stderr.strip()})")
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
              *MODEL, f"hydra.run.dir={run_dir}"]
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
        assert not {nss.ns["a"], nss.ns["b"]} & set(_ip("netns", "list").stdout.split())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    log = tmp_path_factory.mktemp("colocated") / "server.log"
    with ColocatedServer(port_block(1), MODEL, log_path=log) as server:
        yield {p: generate(server.url, {"text": p, "sampling_params": GREEDY}) for p in PROMPTS}


def _post_in(nss: Namespaces, side: str, url: str, payload: dict) -> dict:
    code = ("import json, sys, httpx; r = httpx.post(sys.argv[1], json=json.loads(sys.argv[2]),"
            " timeout=120); r.raise_for_status(); print(json.dumps(r.json()))")
    res = subprocess.run([*nss.exec(side), sys.executable, "-c", code, url, json.dumps(payload)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


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


def test_proxy_output_equals_colocated_across_the_veth(two_hosts, reference):
    nss, run_dir, _ = two_hosts
    for prompt, ref in reference.items():
        out = _post_in(nss, "a", f"http://{ADDR['a']}:8000/generate",
                       {"text": prompt, "sampling_params": GREEDY})
        assert out["output_ids"] == ref["output_ids"], prompt
        assert out["text"] == ref["text"]
    # D lives in namespace B: the only way its pulls reached P (10.200.0.1) is the veth pair
    state = _post_get(nss, "b", f"http://{ADDR['b']}:30001/pdtopo/state")
    assert state["role"] == "decode" and state["ready"] and state["pd_transfers"] == 0
    # beyond loopback the side channel speaks CURVE (disaggregation.side_channel_curve: auto)
    p_state = _post_get(nss, "a", f"http://{ADDR['a']}:30000/pdtopo/state")
    assert state["pd_side_channel_curve"] is True and p_state["pd_side_channel_curve"] is True
    assert p_state["pd_side_channel_curve_denied"] == 0 and p_state["pd_side_channel_dropped"] == 0


def _post_get(nss: Namespaces, side: str, url: str) -> dict:
    code = "import sys, httpx; print(httpx.get(sys.argv[1], timeout=30).text)"
    res = subprocess.run([*nss.exec(side), sys.executable, "-c", code, url],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)
