"""Helpers for the fault tests (tests/test_faults_*.py): a deployment tuned for fast failure
detection, supervisord-level process control (kill -9, SIGSTOP, restart), bounded polling for
re-registration / service resumed, RSS readings and a load generator that records what each
client request saw (status, error text, latency). Pools back at baseline:
`tests.support.e2e.wait_pools_baseline`.

Everything polls with a deadline; nothing sleeps for a fixed time where a state can be polled.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdtopo.launcher.operate.supervisor_control import Supervisor, pid_alive
from tests.support.e2e import Deployment, deployment_overrides, port_block

KV_TIMEOUT_S = 5
SENDER_EXPIRY_S = 8  # > KV_TIMEOUT_S: P never frees KV that D may still pull
HEARTBEAT_S = 1
TTL_S = 3

# Fast failure detection, small engine, router retries and circuit breaker off so that what a
# client sees for one request is decided by that request alone.
FAULT_OVERRIDES = [
    # a P slow enough to queue: 700-token prompts prefill in 64-token steps (the fault tests
    # kill processes while requests wait for prefill, for a pull and in decode)
    "model=tiny_llama",
    "model.num_layers=4",
    "engine.max_prefill_tokens=64",
    "engine.num_pages=256",
    "engine.max_model_len=1024",
    "engine.max_running_requests=32",
    f"disaggregation.kv_timeout_s={KV_TIMEOUT_S}",
    f"disaggregation.sender_expiry_s={SENDER_EXPIRY_S}",
    f"bootstrap.heartbeat_interval_s={HEARTBEAT_S}",
    f"bootstrap.heartbeat_ttl_s={TTL_S}",
    "proxy.retries=0",
    "proxy.circuit_breaker=false",
    "proxy.health_check_interval_s=1",
    "proxy.request_timeout_s=60",
]


def launch_fault_deployment(run_dir: Path, extra: list[str] = ()) -> Deployment:
    dep = Deployment(run_dir, [*FAULT_OVERRIDES, *extra,
                               *deployment_overrides(port_block(40))])
    dep.launch()
    wait_serving(dep.proxy_url, timeout=120)
    return dep


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.1,
               what: str = "condition") -> float:
    """Poll `pred` until truthy; returns the seconds it took. Raises TimeoutError."""
    t0 = time.monotonic()
    last_exc: BaseException | None = None
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            last_exc = exc
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} not reached within {timeout:g} s (last error: {last_exc!r})")
        time.sleep(interval)


def try_generate(url: str, text: str = "ping", max_new_tokens: int = 2,
                 timeout: float = 30) -> httpx.Response | None:
    try:
        return httpx.post(f"{url}/generate", timeout=timeout, json={
            "text": text, "sampling_params": {"max_new_tokens": max_new_tokens,
                                              "temperature": 0}})
    except httpx.HTTPError:
        return None


def wait_serving(proxy_url: str, timeout: float = 120) -> float:
    """Seconds until a request through the proxy succeeds."""
    def ok() -> bool:
        r = try_generate(proxy_url)
        return r is not None and r.status_code == 200
    return wait_until(ok, timeout, interval=0.25, what=f"{proxy_url} serving")


# ------------------------------------------------------------------ processes
def program_pid(dep: Deployment, name: str) -> int:
    info = Supervisor(dep.run_dir).call("supervisor.getProcessInfo", name)
    return int(info["pid"]) if info["statename"] == "RUNNING" else 0


def kill9(dep: Deployment, name: str) -> int:
    pid = program_pid(dep, name)
    assert pid > 0, f"{name} is not running"
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(dep: Deployment, name: str, old_pid: int, timeout: float = 120) -> float:
    """Seconds until supervisord runs a new `name` process and its /health answers 200."""
    url = dep.url(name) if name != "bootstrap" else dep.plan["bootstrap_url"]

    def up() -> bool:
        pid = program_pid(dep, name)
        return (pid > 0 and pid != old_pid and not pid_alive(old_pid)
                and httpx.get(f"{url}/health", timeout=2).status_code == 200)
    return wait_until(up, timeout, interval=0.2, what=f"{name} restarted and healthy")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------ state
def token(dep: Deployment) -> str:
    return (dep.run_dir / "token").read_text().strip()


def bootstrap_list(dep: Deployment, role: str | None = None) -> list[dict]:
    resp = httpx.get(f"{dep.plan['bootstrap_url']}/list", params={"role": role} if role else None,
                     headers={"Authorization": f"Bearer {token(dep)}"}, timeout=5)
    resp.raise_for_status()
    return resp.json()


# ------------------------------------------------------------------ load
@dataclass
class Outcome:
    kind: str
    status: int | None          # HTTP status, None for a transport error / client abort
    body: str
    latency_s: float
    output_ids: list[int] = field(default_factory=list)
    t_end: float = field(default_factory=time.monotonic)  # when the client had its answer


def post_generate(url: str, payload: dict, kind: str = "normal",
                  timeout: float = 90) -> Outcome:
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/generate", json=payload, timeout=timeout)
    except httpx.HTTPError as exc:
        return Outcome(kind, None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    ids = []
    if r.status_code == 200:
        data = r.json()
        ids = data["output_ids"] if isinstance(data, dict) else []
    return Outcome(kind, r.status_code, r.text[:500], time.monotonic() - t0, ids)


def abort_stream(url: str, payload: dict, after_chunks: int = 1, timeout: float = 60) -> Outcome:
    """Stream a request and close the connection after `after_chunks` SSE events."""
    t0 = time.monotonic()
    seen = 0
    try:
        with httpx.stream("POST", f"{url}/generate", json={**payload, "stream": True},
                          timeout=timeout) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen >= after_chunks:
                        break
            status = resp.status_code
    except httpx.HTTPError as exc:
        return Outcome("aborted", None, repr(exc), time.monotonic() - t0)
    return Outcome("aborted", status, f"closed after {seen} chunks", time.monotonic() - t0)


def run_concurrently(jobs: list[Callable[[], Outcome]], workers: int = 32) -> list[Outcome]:
    with cf.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda job: job(), jobs))


class Background:
    """Run `jobs` on a thread pool in the background; `.result()` joins them."""

    def __init__(self, jobs: list[Callable[[], Outcome]], workers: int = 32):
        self._ex = cf.ThreadPoolExecutor(workers)
        self._futs = [self._ex.submit(job) for job in jobs]

    def finished(self) -> dict:
        """Status counts of the jobs done so far (for failure messages)."""
        counts: dict = {}
        for f in self._futs:
            if f.done() and f.exception() is None:
                counts[f.result().status] = counts.get(f.result().status, 0) + 1
        return counts

    def result(self, timeout: float = 180) -> list[Outcome]:
        try:
            return [f.result(timeout=timeout) for f in self._futs]
        finally:
            self._ex.shutdown(wait=False, cancel_futures=True)
