"""Helpers for end-to-end tests: real deployments through `pdtopo launch --detach`, a real
colocated reference server, port blocks, health waits, and process-leak checks."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdtopo.launcher.supervisor_control import pid_alive
from tests.conftest import ephemeral_low

REPO_ROOT = Path(__file__).resolve().parent.parent


def port_block(n: int, lo: int = 10000, hi: int | None = None) -> int:
    """A base port such that base..base+n-1 are all free on 127.0.0.1 right now, below the
    kernel's ephemeral range (outgoing connections cannot take them meanwhile)."""
    hi = hi if hi is not None else ephemeral_low()
    for _ in range(200):
        base = random.randrange(lo, hi - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports found")


def deployment_overrides(base: int, *, instances: int = 2) -> list[str]:
    """Port overrides that put a whole deployment in a private block starting at `base`."""
    span = max(4, instances)
    return [
        f"topology.bootstrap.port={base}",
        f"topology.proxy.port={base + 1}",
        f"topology.proxy.prometheus_port={base + 2}",
        f"topology.ports.http_base={base + 10}",
        f"topology.ports.transfer_base={base + 10 + span}",
        f"topology.ports.zmq_base={base + 10 + 2 * span}",
    ]


def run_pdtopo(args: Sequence[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdtopo.cli", *args], cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=timeout,
    )


class Deployment:
    """A deployment launched with `pdtopo launch --detach` into `run_dir`."""

    def __init__(self, run_dir: Path, overrides: Sequence[str]):
        self.run_dir = Path(run_dir)
        self.overrides = list(overrides)
        self.plan: dict = {}

    def launch(self, timeout: float = 600) -> Deployment:
        res = run_pdtopo(
            ["launch", "--detach", *self.overrides, f"hydra.run.dir={self.run_dir}"], timeout
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"pdtopo launch failed ({res.returncode}):\n{res.stdout}\n{res.stderr}\n"
                + self.log_tails()
            )
        self.plan = json.loads((self.run_dir / "plan.json").read_text())
        return self

    def log_tails(self, n: int = 40) -> str:
        out = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def process(self, name: str) -> dict:
        return next(p for p in self.plan["processes"] if p["name"] == name)

    def url(self, name: str) -> str:
        p = self.process(name)
        return f"http://{p['address']}:{p['ports']['http']}"

    @property
    def proxy_url(self) -> str:
        return self.plan["proxy_url"]

    def names(self, role: str) -> list[str]:
        return [p["name"] for p in self.plan["processes"] if p["role"] == role]

    def pids(self) -> list[int]:
        pids = []
        pidfile = self.run_dir / "supervisord.pid"
        if pidfile.exists():
            pids.append(int(pidfile.read_text().strip()))
        res = run_pdtopo(["status", str(self.run_dir)], timeout=60)
        for line in res.stdout.splitlines():
            for tok in line.replace(",", " ").split():
                if tok.isdigit() and int(tok) > 1 and pid_alive(int(tok)):
                    pids.append(int(tok))
        return pids

    def stop(self) -> None:
        run_pdtopo(["stop", str(self.run_dir)], timeout=120)

    def stop_and_check(self) -> None:
        """`pdtopo stop`, then no process whose command line names the run dir may be left."""
        self.stop()
        time.sleep(0.5)
        left = processes_of_run(self.run_dir)
        assert left == [], f"processes of {self.run_dir} still alive after pdtopo stop: {left}"

    def wait_pools_baseline(self, timeout: float = 10.0) -> dict[str, dict]:
        """Poll every P/D/colocated/local server until its pool is back at its baseline (all
        pages free, no request, no registered KV); fails with the last states otherwise."""
        names = [p["name"] for p in self.plan["processes"]
                 if p["role"] in ("prefill", "decode", "colocated", "local")
                 and p.get("leader", True) is not False]
        deadline = time.monotonic() + timeout
        while True:
            states = {n: pool_state(self.url(n)) for n in names}
            if all(at_baseline(s) for s in states.values()):
                return states
            assert time.monotonic() < deadline, f"pools not back at baseline: {states}"
            time.sleep(0.2)


def processes_of_run(run_dir: Path) -> list[int]:
    """PIDs of any process whose command line mentions this run directory."""
    found = []
    needle = str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmd and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def wait_healthy(url: str, timeout: float = 300, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


class ColocatedServer:
    """The reference: one non-disaggregated server with the same model, started directly."""

    def __init__(self, port: int, overrides: Sequence[str] = (), log_path: Path | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.overrides = list(overrides)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> ColocatedServer:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdtopo.runtime.server", "--port", str(self.port),
             *self.overrides],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_healthy(self.url, timeout, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def generate(url: str, payload: dict, timeout: float = 120) -> dict | list:
    resp = httpx.post(f"{url}/generate", json=payload, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def stream_generate(url: str, payload: dict, timeout: float = 120) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/generate", json={**payload, "stream": True},
                      timeout=timeout) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def pool_state(url: str) -> dict:
    return httpx.get(f"{url}/pdtopo/state", timeout=10).json()


def at_baseline(state: dict) -> bool:
    return (state["free_pages"] == state["total_pages"] and state["num_reqs"] == 0
            and state.get("pd_registered_kv", 0) == 0)


@contextmanager
def colocated_reference(log_dir: Path, overrides: Sequence[str], prompts: Sequence[str],
                        sampling: dict) -> Iterator[dict[str, list[int]]]:
    """Greedy output ids of a colocated server (same model and seed) for every prompt."""
    log = Path(log_dir) / "colocated.log"
    server = ColocatedServer(port_block(1), overrides, log_path=log)
    try:
        try:
            server.start()
        except Exception:
            raise RuntimeError(f"colocated server failed:\n{log.read_text()[-4000:]}") from None
        yield {p: generate(server.url, {"text": p, "sampling_params": sampling})["output_ids"]
               for p in prompts}
    finally:
        server.stop()
