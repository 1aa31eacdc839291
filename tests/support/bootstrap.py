"""A standalone bootstrap server process for the HTTP tests: `start_bootstrap` runs
`python -m pdtopo.runtime.bootstrap` on 127.0.0.1:<port> with TOKEN and a TTL and waits for
/health; `stop_bootstrap` terminates it (kill after 10 s). Used by tests/e2e/test_bootstrap.py
and tests/e2e/test_badinput_http.py."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

TOKEN = "test-token-123"


def start_bootstrap(port: int, ttl: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdtopo.runtime.bootstrap", "--port", str(port),
         "--token", TOKEN, "--ttl", str(ttl)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("bootstrap server did not come up")


def stop_bootstrap(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
