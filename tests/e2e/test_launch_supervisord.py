"""Real supervisord: `pdtopo launch --detach`, `status`, `supervisorctl`, `logs`, `stop`.

`test_launch_real_runtime` uses the real bootstrap server, the real pdtopo.runtime.server and
the real sglang-router. The other tests swap the P/D engine for a tiny HTTP program (through
`launcher.server_module`) to exercise launcher mechanics deterministically and fast: FATAL
detection with the log tail, teardown, colocated mode. Every test checks by PID that nothing
of the run is left alive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from pdtopo.launcher.operate.supervisor_control import Supervisor, descendants, pid_alive
from pdtopo.launcher.programs.nodelay_exec import compiler_on_path
from pdtopo.ports import free_port
from tests.support.constants import REPO_ROOT

FAKE_SERVER = textwrap.dedent('''
    """Launcher-test stand-in for the engine: serves /health on its plan port."""
    import argparse, http.server, json, os, sys
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir"); ap.add_argument("--process")
    a = ap.parse_args()
    plan = json.load(open(os.path.join(a.run_dir, "plan.json")))
    me = [p for p in plan["processes"] if p["name"] == a.process][0]
    print("fake", a.process, "cores", sorted(os.sched_getaffinity(0)),
          "token", os.environ.get("PDTOPO_DEPLOYMENT_TOKEN"), flush=True)
    if os.environ.get("FAKE_FAIL") == a.process:
        print("fake engine: simulated crash in", a.process, flush=True)
        sys.exit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", me["ports"]["http"]), H).serve_forever()
''')


def port_overrides() -> list[str]:
    return [f"topology.ports.http_base={free_port()}",
            f"topology.ports.transfer_base={free_port()}",
            f"topology.ports.zmq_base={free_port()}",
            f"topology.bootstrap.port={free_port()}",
            f"topology.proxy.port={free_port()}",
            f"topology.proxy.prometheus_port={free_port()}"]


def pdtopo(cwd: Path, *args: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdtopo.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_pids(run: Path) -> list[int]:
    sv = Supervisor(run)
    pids = [sv.supervisord_pid()]
    for info in sv.processes():
        pids += [info["pid"], *descendants(info["pid"])]
    return [p for p in pids if p]


def assert_all_gone(run: Path, pids: list[int]) -> None:
    assert pids
    alive = [p for p in pids if pid_alive(p)]
    assert not alive, f"processes of {run} still alive: {alive}"


def force_cleanup(run: Path) -> None:
    if (run / "supervisord.conf").exists() and Supervisor(run).is_up():
        from pdtopo.launcher.operate.supervisor_control import teardown
        teardown(run)


@pytest.fixture
def fake_env(tmp_path):
    pkg = tmp_path / "fakes"
    pkg.mkdir()
    (pkg / "pdtopo_fake_server.py").write_text(FAKE_SERVER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg), str(REPO_ROOT),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.mark.slow
def test_launch_status_stop_with_fake_engine(tmp_path, fake_env):
    run = tmp_path / "outputs" / "2030-01-01" / "00-00-00"  # found as the latest run
    try:
        res = pdtopo(tmp_path, "launch", "--detach", f"hydra.run.dir={run}", "model=tiny_llama",
                     "launcher.server_module=pdtopo_fake_server", "launcher.health_timeout_s=60",
                     *port_overrides(), env=fake_env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "all programs healthy" in res.stdout
        lines = res.stdout.splitlines()
        healthy_at = next(i for i, line in enumerate(lines) if "all programs healthy" in line)
        endpoints = [line.strip() for line in lines[healthy_at + 1:] if line.strip()]
        assert endpoints[0].split()[0] == "proxy" and "send requests here" in endpoints[0]
        sv = Supervisor(run)
        infos = {i["name"]: i for i in sv.processes()}
        # the plan's programs and the router watch (an event listener, launcher.router_watch)
        assert set(infos) == {"bootstrap", "prefill_0", "decode_0", "proxy", "router_watch"}
        assert {i["statename"] for i in infos.values()} == {"RUNNING"}
        # the Rust router runs with the accept wrapper (proxy.client_nodelay: auto), whose file
        # is gone once loaded
        maps = Path(f"/proc/{infos['proxy']['pid']}/maps").read_text()
        proxy_log = (run / "logs" / "proxy.log").read_text()
        if compiler_on_path():
            assert "accept_nodelay.so (deleted)" in maps
            assert "client_nodelay" not in proxy_log  # no warning
        else:  # auto without a compiler: one warning naming the setting, the router runs
            assert "proxy.client_nodelay=auto" in proxy_log
        token = (run / "token").read_text().strip()
        log = (run / "logs" / "prefill_0.log").read_text()
        assert f"token {token}" in log
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # P and D pinned to disjoint cores
            assert f"cores [{cores[0]}" in log
        status = pdtopo(tmp_path, "status", str(run), env=fake_env)
        assert status.returncode == 0, status.stdout + status.stderr
        for name in infos:
            assert name in status.stdout
        assert status.stdout.count("healthy") >= 4
        ctl = subprocess.run(["supervisorctl", "-c", str(run / "supervisord.conf"), "status"],
                             capture_output=True, text=True, timeout=60)
        assert ctl.stdout.count("RUNNING") == 5, ctl.stdout  # 4 programs + the router watch
        logs = pdtopo(tmp_path, "logs", "decode_0", str(run), env=fake_env)
        assert "fake decode_0" in logs.stdout
        # latest run by default
        assert "fake prefill_0" in pdtopo(tmp_path, "logs", "prefill_0", env=fake_env).stdout
        pids = run_pids(run)
        stop = pdtopo(tmp_path, "stop", env=fake_env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert_all_gone(run, pids)
        assert pdtopo(tmp_path, "status", str(run), env=fake_env).returncode == 3
    finally:
        force_cleanup(run)


@pytest.mark.slow
def test_fatal_program_prints_log_tail_and_tears_down(tmp_path, fake_env):
    run = tmp_path / "run"
    fake_env = {**fake_env, "FAKE_FAIL": "decode_0"}
    try:
        res = pdtopo(tmp_path, "launch", "--detach", f"hydra.run.dir={run}", "model=tiny_llama",
                     "launcher.server_module=pdtopo_fake_server", "launcher.startretries=1",
                     "launcher.health_timeout_s=60", *port_overrides(), env=fake_env)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "decode_0 is FATAL" in res.stdout
        assert "simulated crash in decode_0" in res.stdout  # the log tail
        assert "torn down" in res.stdout
        assert not Supervisor(run).is_up()
        assert not Supervisor(run).supervisord_pid()
    finally:
        force_cleanup(run)


@pytest.mark.slow
def test_colocated_launch_foreground_until_stop(tmp_path, fake_env):
    run = tmp_path / "run"
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdtopo.cli", "launch", f"hydra.run.dir={run}",
         "topology=colocated_cpu", "model=tiny_llama", f"topology.ports.http_base={http}",
         f"topology.ports.transfer_base={free_port()}", f"topology.ports.zmq_base={free_port()}",
         "launcher.server_module=pdtopo_fake_server"],
        cwd=tmp_path, env=fake_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C" in line:
                break
        assert any("all programs healthy" in ln for ln in lines), "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5) as r:
            assert r.status == 200
        pids = run_pids(run)
        assert pdtopo(tmp_path, "stop", str(run), env=fake_env).returncode == 0
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert_all_gone(run, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        force_cleanup(run)


@pytest.mark.slow
def test_launch_real_runtime(tmp_path):
    """1p1d_cpu with the real bootstrap server, real engine and real sglang-router."""
    run = tmp_path / "run"
    try:
        res = pdtopo(tmp_path, "launch", "--detach", f"hydra.run.dir={run}",
                     "launcher.health_timeout_s=240", "model=tiny_llama", "model.num_layers=1",
                     *port_overrides(), timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        sv = Supervisor(run)
        assert {i["statename"] for i in sv.processes()} == {"RUNNING"}
        status = pdtopo(tmp_path, "status", str(run))
        assert status.returncode == 0 and status.stdout.count("healthy") >= 4, status.stdout
        pids = run_pids(run)
        stop = pdtopo(tmp_path, "stop", str(run))
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert_all_gone(run, pids)
    finally:
        force_cleanup(run)
