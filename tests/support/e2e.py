"""Helpers for end-to-end tests: real deployments through `pdtopo launch --detach`, the one
way to start a colocated server process (`ColocatedServer`), the one "pools back at baseline"
check (`at_baseline` / `wait_pools_baseline`), port blocks, health waits and process-leak
checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

from pdtopo.bench.closed_loop import ClosedLoopLoad
from pdtopo.bench.deployments import (
    DetachedDeployment,
    log_tails,
    port_overrides,
    run_cli,
    wait_healthy,
)
from pdtopo.launcher.operate.supervisor_control import pid_alive
from pdtopo.ports import free_port_block
from tests.support.constants import REPO_ROOT

port_block = free_port_block            # a private block of free ports
deployment_overrides = port_overrides  # a whole deployment inside that block
run_pdtopo = run_cli                   # `pdtopo ARGS` in a subprocess


def require_model(overrides: Sequence[str], what: str) -> None:
    """Tests name the model they serve (`tests.support.constants.TINY_MODEL`, model=tiny_llama,
    where speed matters): the default model, SmolLM2, is a 93 MB download and a 30-layer
    compile that a test leaving it out would pay for without saying so."""
    if not any(str(o).startswith("model=") for o in overrides):
        raise ValueError(f"{what}: no model=NAME among the overrides {list(overrides)}; name "
                         "one (model=tiny_llama for the tiny random model)")


class Deployment(DetachedDeployment):
    """A deployment launched with `pdtopo launch --detach` into `run_dir`, with what tests
    inspect: processes, URLs, pids, logs, a leak check after stop. The overrides name the
    model (`require_model`)."""

    def __init__(self, run_dir: Path, overrides: Sequence[str]):
        require_model(overrides, "Deployment")
        super().__init__(run_dir, overrides)

    def launch(self, timeout: float = 600) -> Deployment:
        super().launch(timeout)
        return self

    def log_tails(self, n: int = 40) -> str:
        return log_tails(self.run_dir, n)

    def process(self, name: str) -> dict:
        return next(p for p in self.plan["processes"] if p["name"] == name)

    def url(self, name: str) -> str:
        p = self.process(name)
        return f"http://{p['address']}:{p['ports']['http']}"

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

    def stop_and_check(self) -> None:
        """`pdtopo stop`, then no process whose command line names the run dir may be left."""
        self.stop()
        time.sleep(0.5)
        left = processes_of_run(self.run_dir)
        assert left == [], f"processes of {self.run_dir} still alive after pdtopo stop: {left}"

    def servers(self) -> dict[str, str]:
        """{name: URL} of every P/D/colocated/local server (the leader of a multi-process
        instance: followers have no pool state of their own to report)."""
        return {p["name"]: self.url(p["name"]) for p in self.plan["processes"]
                if p["role"] in ("prefill", "decode", "colocated", "local")
                and p.get("leader", True) is not False}


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


class ColocatedServer:
    """The one way tests start a colocated (non-disaggregated) server process.

    Direct form: `python -m pdtopo.runtime.server --port PORT OVERRIDES...` (PORT: a free
    one by default). With `run_dir`: the launcher's form `--run-dir RUN --process NAME`; the
    port must then be the one RUN/plan.json gives the process. JAX runs on the CPU; `env` adds
    to the environment (e.g. XLA_FLAGS for the number of devices). Output goes to `log_path`.

    `start()` returns once /health answers 200; if the process exits or stays unhealthy it is
    stopped and the error carries the log tail. `stop()` sends SIGTERM to the process group
    (SIGKILL after `timeout`) and returns the exit code; `stop_and_check()` also requires exit
    code 0 (SIGTERM is a graceful shutdown). As a context manager: start, then stop, and with
    `check_exit=True` check the exit code when the body did not raise. The direct form's
    overrides name the model (`require_model`)."""

    def __init__(self, port: int | None = None, overrides: Sequence[str] = (),
                 log_path: Path | None = None, *, run_dir: Path | None = None,
                 process: str = "colocated_0", env: Mapping[str, str] | None = None,
                 check_exit: bool = False):
        if run_dir is None:
            require_model(overrides, "ColocatedServer")
        self.port = port if port is not None else port_block(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.overrides = list(overrides)
        self.log_path = Path(log_path) if log_path is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.process = process
        self.env = dict(env or {})
        self.check_exit = check_exit
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        if self.run_dir is not None:
            where = ["--run-dir", str(self.run_dir), "--process", self.process]
        else:
            where = ["--port", str(self.port)]
        return [sys.executable, "-m", "pdtopo.runtime.server", *where, *self.overrides]

    def start(self, timeout: float = 300) -> ColocatedServer:
        pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath, **self.env}
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command(), cwd=REPO_ROOT, env=env, stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            wait_healthy(self.url, timeout, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise type(exc)(f"colocated server {self.url}: {exc}\n{self.log_tail()}") from None
        return self

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return (f"--- {self.log_path} (last {n} characters)\n"
                + self.log_path.read_text(errors="replace")[-n:])

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM the process group, SIGKILL after `timeout`; the exit code (None: never
        started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):  # it may exit meanwhile
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def stop_and_check(self) -> None:
        code = self.stop()
        assert code == 0, f"server exit code {code} after SIGTERM:\n{self.log_tail()}"

    def __enter__(self) -> ColocatedServer:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.check_exit:
            self.stop_and_check()
        else:
            self.stop()


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


OVERSIZE_BYTES = 50 * 1024 * 1024  # a body far over server.max_body_bytes (8 MiB by default)


def post_oversize(url: str, path: str = "/generate", size: int = OVERSIZE_BYTES,
                  timeout: float = 30) -> tuple[httpx.Response, float]:
    """POST a /generate-shaped JSON body of `size` bytes to `url`; (the answer, seconds from
    the first byte sent to the whole answer read)."""
    body = b'{"text": "' + b"a" * (size - 12) + b'"}'
    t0 = time.perf_counter()
    resp = httpx.post(f"{url}{path}", content=body, timeout=timeout,
                      headers={"content-type": "application/json"})
    return resp, time.perf_counter() - t0


def assert_refused_at_once(url: str, path: str = "/generate", within_s: float = 1.0) -> None:
    """A 50 MB body to `url` is answered 413 within `within_s`: not read, tokenized or
    forwarded, not a reset or a timeout."""
    resp, took = post_oversize(url, path)
    assert resp.status_code == 413, f"{url}{path}: {resp.status_code} {resp.text[:300]}"
    assert took < within_s, f"{url}{path}: the 413 took {took:.2f} s"


def pool_state(url: str) -> dict:
    return httpx.get(f"{url}/pdtopo/state", timeout=10).json()


# Counters that are 0 on a server with nothing in flight: requests (all, running, waiting),
# P's registered KV and senders awaiting D, D's preallocation and transfer queues.
_ZERO_AT_BASELINE = ("num_reqs", "num_running", "num_waiting", "pd_registered_kv",
                     "pd_inflight_senders", "pd_prealloc", "pd_transfers")


def baseline_problems(state: dict) -> list[str]:
    """Why a server's /pdtopo/state (or a scheduler's stats()) is not at its baseline (empty:
    it is): a page neither free nor held by the prefix cache (free + tree = total), the
    scheduler's own reference check failing (`page_problems`, checked when idle), or a non-zero
    `_ZERO_AT_BASELINE` counter; also in each engine of a local server."""
    problems = []
    tree = state.get("tree_pages", 0)
    if state["free_pages"] + tree != state["total_pages"]:
        problems.append(f"free_pages={state['free_pages']} + tree_pages={tree} != "
                        f"total_pages={state['total_pages']}")
    if state.get("page_problems"):
        problems.append(f"page_problems={state['page_problems']}")
    problems += [f"{k}={state[k]}" for k in _ZERO_AT_BASELINE if state.get(k, 0)]
    for name, engine in sorted((state.get("engines") or {}).items()):
        problems += [f"engines.{name}.{p}" for p in baseline_problems(engine)]
    return problems


def at_baseline(state: dict) -> bool:
    """The pool is back at its baseline: every page free, nothing in flight."""
    return not baseline_problems(state)


def leaked_pages(states: Mapping[str, dict]) -> int:
    """Pages neither free nor held by a prefix cache, over all servers."""
    return sum(s["total_pages"] - s["free_pages"] - s.get("tree_pages", 0)
               for s in states.values())


def wait_pools_baseline(servers: Deployment | Mapping[str, str] | str, timeout: float = 10.0,
                        interval: float = 0.2) -> tuple[float, dict[str, dict]]:
    """Poll /pdtopo/state of every server (a deployment's `servers()`, a {name: URL} map or
    one URL) until all are `at_baseline` in the same round; return (seconds it took, the final
    states). A server that does not answer (restarting) is polled again. After `timeout`:
    AssertionError naming what each server still holds, its last state and its last error."""
    if isinstance(servers, Deployment):
        urls = servers.servers()
    elif isinstance(servers, str):
        urls = {servers: servers}
    else:
        urls = dict(servers)
    t0 = time.monotonic()
    states: dict[str, dict] = {}
    errors: dict[str, BaseException] = {}
    while True:
        fresh = {}
        for name, url in urls.items():
            try:
                state = pool_state(url)
                if not isinstance(state, dict) or "free_pages" not in state:
                    raise ValueError(f"no pool state in the answer: {state!r:.300}")
                fresh[name] = state
            except (httpx.HTTPError, OSError, ValueError) as exc:
                errors[name] = exc
        states.update(fresh)
        if len(fresh) == len(urls) and all(at_baseline(s) for s in fresh.values()):
            return time.monotonic() - t0, states
        if time.monotonic() - t0 > timeout:
            lines = [f"pools not back at baseline within {timeout:g} s:"]
            for name in urls:
                why = baseline_problems(states[name]) if name in states else ["no state"]
                if name not in fresh:
                    why.append(f"no answer at the last poll ({errors.get(name)!r})")
                if why:
                    lines.append(f"  {name} ({urls[name]}): {', '.join(why)}")
            lines.append("last states: " + json.dumps(states, indent=1, sort_keys=True))
            raise AssertionError("\n".join(lines))
        time.sleep(interval)


@contextmanager
def colocated_reference(log_dir: Path, overrides: Sequence[str], prompts: Sequence[str],
                        sampling: dict) -> Iterator[dict[str, list[int]]]:
    """Greedy output ids of a colocated server (same model and seed) for every prompt."""
    with ColocatedServer(port_block(1), overrides, Path(log_dir) / "colocated.log") as server:
        yield {p: generate(server.url, {"text": p, "sampling_params": sampling})["output_ids"]
               for p in prompts}


class SteadyLoad(ClosedLoopLoad):
    """`workers` threads sending /generate to the proxy one after another until stopped;
    every answer's status (or exception) is kept."""

    def __init__(self, url: str, workers: int = 3, tokens: int = 16) -> None:
        super().__init__(url, workers)
        self.tokens = tokens

    def body(self, worker: int, n: int) -> tuple[dict, int]:
        return {"text": f"load {worker}-{n}: " + "steady load " * (n % 5),
                "sampling_params": {"max_new_tokens": self.tokens, "temperature": 0,
                                    "ignore_eos": True}}, self.tokens


def said(res: subprocess.CompletedProcess) -> str:
    """A CLI run's stdout with rich's line wrapping undone."""
    return " ".join(res.stdout.split())
