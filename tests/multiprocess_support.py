"""Multi-process P/D instances for tests, before the launcher plans them: render a 1p1d_cpu run
directory, then rewrite plan.json so an instance spans N processes (the plan contract of
`pdtopo.runtime.distributed.cluster`: `distributed`, `leader`, leader `ports.coordinator` /
`ports.control`), and start every process of the plan directly (no supervisord)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e_support import REPO_ROOT, deployment_overrides, port_block, run_pdtopo

TOKEN = "mp-test-token"


def render(run_dir: Path, overrides: list[str], base: int) -> dict:
    res = run_pdtopo(["render", *deployment_overrides(base), *overrides,
                      f"hydra.run.dir={run_dir}"], timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"pdtopo render failed:\n{res.stdout}\n{res.stderr}")
    return json.loads((run_dir / "plan.json").read_text())


def split_instance(plan: dict, name: str, processes: int, devices_per_process: int = 1) -> None:
    """Turn single-process instance `name` into `processes` processes (leader keeps the name and
    ports; followers get fresh ports); the mesh spans all devices: tp = processes x devices."""
    entries = plan["processes"]
    idx = next(i for i, p in enumerate(entries) if p["name"] == name)
    lead = entries[idx]
    tp = processes * devices_per_process
    ports = port_block(2 + 3 * processes)
    coord, control = ports, ports + 1
    new = []
    for i in range(processes):
        e = copy.deepcopy(lead)
        if i:
            e["name"] = f"{name}_p{i}"
            base = ports + 2 + 3 * i
            e["ports"] = {"http": base, "transfer": base + 1, "zmq": base + 2}
            e["health_url"] = f"http://{e['address']}:{base}/health"
            e["command"] = [*lead["command"][:-1], e["name"]]
        else:
            e["ports"] = {**lead["ports"], "coordinator": coord, "control": control}
        e["leader"] = i == 0
        e["mesh"] = {"tp": tp}
        e["rank"] = {**lead["rank"], "tp_rank": i, "tp_size": processes}
        e["env"] = {**lead["env"], "XLA_FLAGS":
                    f"--xla_force_host_platform_device_count={devices_per_process}"}
        e["cpu_affinity"] = None
        e["distributed"] = {"coordinator": f"127.0.0.1:{coord}", "num_processes": processes,
                            "process_id": i, "local_device_ids": list(range(devices_per_process))}
        new.append(e)
    entries[idx:idx + 1] = new


def add_single_process(plan: dict, like: str, name: str, devices: int) -> dict:
    """Add instance `name`: one process like `like`'s leader but with `devices` emulated devices
    (tp = devices) and fresh ports. Returns its entry."""
    entries = plan["processes"]
    e = copy.deepcopy(next(p for p in entries if p["name"] == like))
    base = port_block(3)
    e.update(name=name, instance_id=name, leader=True, distributed=None, mesh={"tp": devices},
             cpu_affinity=None, rank={**e["rank"], "tp_rank": 0, "tp_size": 1},
             ports={"http": base, "transfer": base + 1, "zmq": base + 2},
             health_url=f"http://{e['address']}:{base}/health",
             command=[*e["command"][:-1], name])
    e["env"] = {**e["env"], "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    entries.insert(entries.index(next(p for p in entries if p["name"] == like)) + 1, e)
    return e


def write_plan(run_dir: Path, plan: dict) -> None:
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))


class Processes:
    """Every process of a plan, started directly with its env; logs in run_dir/logs."""

    def __init__(self, run_dir: Path, plan: dict):
        self.run_dir = Path(run_dir)
        self.plan = plan
        self.procs: dict[str, subprocess.Popen] = {}
        (self.run_dir / "logs").mkdir(exist_ok=True)

    def entry(self, name: str) -> dict:
        return next(p for p in self.plan["processes"] if p["name"] == name)

    def start(self, names: list[str] | None = None) -> None:
        for e in self.plan["processes"]:
            if names is not None and e["name"] not in names:
                continue
            env = {**os.environ, **e["env"], "PDTOPO_DEPLOYMENT_TOKEN": TOKEN}
            env.pop("PYTEST_CURRENT_TEST", None)
            log = open(self.run_dir / "logs" / f"{e['name']}.log", "ab")  # noqa: SIM115
            self.procs[e["name"]] = subprocess.Popen(
                [sys.executable, *e["command"][1:]], cwd=REPO_ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, names: list[str] | None = None, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for e in self.plan["processes"]:
            if names is not None and e["name"] not in names:
                continue
            while True:
                proc = self.procs[e["name"]]
                if proc.poll() is not None:
                    raise RuntimeError(f"{e['name']} exited with {proc.returncode}:\n"
                                       + self.log_tail(e["name"]))
                try:
                    if httpx.get(e["health_url"], timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{e['name']} not healthy after {timeout}s:\n"
                                       + self.log_tail(e["name"]))
                time.sleep(0.3)

    def bring_up(self, timeout: float = 400) -> None:
        """Start in the launcher's order (bootstrap, servers, proxy) and wait until the router
        has healthy workers (`/readiness`)."""
        by_priority: dict[int, list[str]] = {}
        for e in self.plan["processes"]:
            by_priority.setdefault(int(e["priority"]), []).append(e["name"])
        for prio in sorted(by_priority):
            self.start(by_priority[prio])
            self.wait_healthy(by_priority[prio], timeout)
        url = self.plan["proxy_url"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readiness", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"router {url} has no healthy workers after 60 s:\n"
                           + self.log_tail("proxy"))

    def log_tail(self, name: str, n: int = 4000) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"

    def stop(self, names: list[str] | None = None, timeout: float = 20) -> dict[str, int]:
        """SIGTERM (then SIGKILL) each process group; returns exit codes."""
        chosen = [n for n in self.procs if names is None or n in names]
        for n in chosen:
            if self.procs[n].poll() is None:
                os.killpg(self.procs[n].pid, signal.SIGTERM)
        codes = {}
        for n in chosen:
            p = self.procs.pop(n)
            try:
                codes[n] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes[n] = p.wait()
        return codes
