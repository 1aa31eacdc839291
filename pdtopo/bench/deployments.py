"""Deployments a benchmark (or a test) brings up and tears down itself, through pdtopo's CLI.

`DetachedDeployment(run_dir, overrides).launch()` runs `pdtopo launch --detach` in a
subprocess, reads RUN/plan.json and `stop()` runs `pdtopo stop`; `ColocatedProcess` starts one
colocated server (`python -m pdtopo.runtime.server --port P overrides...`) in its own session and
waits for its /health. `port_overrides(base)` puts a whole deployment into a private block of
ports (`pdtopo.ports.free_port_block`), so that runs on one machine do not collide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from pdtopo.config.run_files import PLAN_FILE

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent


def port_overrides(base: int, *, instances: int = 2) -> list[str]:
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


def run_cli(args: Sequence[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`pdtopo ARGS` in a subprocess (the project root as working directory)."""
    return subprocess.run([sys.executable, "-m", "pdtopo.cli", *args], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def log_tails(run_dir: Path, n: int = 40) -> str:
    out = []
    for log in sorted((Path(run_dir) / "logs").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-n:]
        out.append(f"--- {log.name}\n" + "\n".join(lines))
    return "\n".join(out)


class DetachedDeployment:
    """A deployment launched with `pdtopo launch --detach` into `run_dir`."""

    def __init__(self, run_dir: Path, overrides: Sequence[str]):
        self.run_dir = Path(run_dir)
        self.overrides = list(overrides)
        self.plan: dict = {}

    def launch(self, timeout: float = 600) -> DetachedDeployment:
        res = run_cli(["launch", "--detach", *self.overrides, f"hydra.run.dir={self.run_dir}"],
                      timeout)
        if res.returncode != 0:
            raise RuntimeError(f"pdtopo launch failed ({res.returncode}):\n{res.stdout}\n"
                               f"{res.stderr}\n{log_tails(self.run_dir)}")
        self.plan = json.loads((self.run_dir / PLAN_FILE).read_text())
        return self

    @property
    def proxy_url(self) -> str:
        return self.plan["proxy_url"]

    def stop(self) -> None:
        run_cli(["stop", str(self.run_dir)], timeout=120)


def wait_healthy(url: str, timeout: float = 300, proc: subprocess.Popen | None = None,
                 path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


class ColocatedProcess:
    """One colocated server started directly (no run dir), in its own process session."""

    def __init__(self, port: int, overrides: Sequence[str] = (), log_path: Path | None = None,
                 host: str = "127.0.0.1"):
        self.port = port
        self.url = f"http://{host}:{port}"
        self.overrides = list(overrides)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> ColocatedProcess:
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdtopo.runtime.server", "--port", str(self.port),
             *self.overrides],
            cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
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
