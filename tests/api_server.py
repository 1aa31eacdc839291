"""Start a real pdtopo server process for API tests (tiny model, fast warmup) and stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from conftest import REPO_ROOT, free_port

TINY_OVERRIDES = [
    "model.num_layers=1",
    "engine.max_model_len=1024",
    "engine.num_pages=200",
    "engine.page_size=8",
    "engine.max_running_requests=8",
    "engine.max_prefill_tokens=128",
    "engine.max_new_tokens_default=16",
    "engine.max_new_tokens_limit=1000",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextmanager
def running_server(cmd_args: list[str], port: int, log_path: Path, timeout: float = 240):
    """Yield the base URL once /health is 200; SIGTERM at the end and check a clean exit."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pdtopo.runtime.server", *cmd_args],
                            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        saw_503 = False
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n"
                                   + log_path.read_text()[-3000:])
            try:
                r = httpx.get(url + "/health", timeout=2)
                if r.status_code == 200:
                    break
                saw_503 = saw_503 or r.status_code == 503
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not healthy in time:\n" + log_path.read_text()[-3000:])
            time.sleep(0.25)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    assert proc.returncode == 0, f"server exit code {proc.returncode}:\n{log_path.read_text()[-3000:]}"


def direct_server(tmp_path: Path, extra: list[str] | None = None):
    port = free_port()
    args = ["--port", str(port), *TINY_OVERRIDES, *(extra or [])]
    return running_server(args, port, tmp_path / "server.log")


def run_dir_server(tmp_path: Path):
    """The launcher's form: a run dir with config.yaml + plan.json naming one colocated process."""
    from omegaconf import OmegaConf

    from pdtopo.config.compose import compose_config

    port = free_port()
    cfg = compose_config(TINY_OVERRIDES + ["engine.served_model_name=tiny-served"])
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    process = {"name": "colocated_0", "role": "colocated", "host": "localhost",
               "address": "127.0.0.1", "instance_id": "colocated_0",
               "rank": {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1},
               "chips": [0], "mesh": {"tp": 1}, "ports": {"http": port},
               "cpu_affinity": sorted(os.sched_getaffinity(0))}
    (run / "plan.json").write_text(json.dumps({"processes": [process]}))
    return running_server(["--run-dir", str(run), "--process", "colocated_0"], port,
                          tmp_path / "server.log")


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    """Poll /pdtopo/state until no request is in flight; return the state."""
    deadline = time.monotonic() + timeout
    while True:
        st = httpx.get(url + "/pdtopo/state", timeout=5).json()
        if st["num_reqs"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {st}")
        time.sleep(0.05)


def assert_pool_baseline(url: str) -> None:
    st = wait_idle(url)
    assert st["free_pages"] == st["total_pages"], st
