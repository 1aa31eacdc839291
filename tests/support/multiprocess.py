"""Extra server processes next to a launched deployment (e.g. single-process instances laid out
unlike the deployment's multi-process ones): a run directory of their own (the deployment's
config.yaml + a plan with the deployment's bootstrap URL and the extra entries), processes
started directly with the deployment's token, stopped by process group."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.e2e import REPO_ROOT, port_block


def single_process_entry(like: dict, name: str, devices: int, run_dir: Path) -> dict:
    """A one-process instance `name` like plan entry `like` (a P/D process) with `devices`
    emulated devices (mesh tp = devices) and fresh ports."""
    e = copy.deepcopy(like)
    base = port_block(3)
    e.update(name=name, instance_id=name, leader=True, distributed=None, mesh={"tp": devices},
             cpu_affinity=None, rank={**e["rank"], "tp_rank": 0, "tp_size": 1},
             ports={"http": base, "transfer": base + 1, "zmq": base + 2},
             health_url=f"http://{e['address']}:{base}/health",
             command=[sys.executable, "-m", "pdtopo.runtime.server", "--run-dir", str(run_dir),
                      "--process", name])
    e["env"] = {**e["env"], "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return e


class ExtraProcesses:
    """Processes of a private run dir that joins a launched deployment (same bootstrap, token)."""

    def __init__(self, run_dir: Path, deployment_dir: Path, entries: list[dict]):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        shutil.copy(Path(deployment_dir) / "config.yaml", self.run_dir / "config.yaml")
        base = json.loads((Path(deployment_dir) / "plan.json").read_text())
        self.plan = {**{k: v for k, v in base.items() if k != "processes"}, "processes": entries}
        (self.run_dir / "plan.json").write_text(json.dumps(self.plan, indent=2))
        self.token = (Path(deployment_dir) / "token").read_text().strip()
        self.procs: dict[str, subprocess.Popen] = {}

    def entry(self, name: str) -> dict:
        return next(p for p in self.plan["processes"] if p["name"] == name)

    def start(self, timeout: float = 300) -> None:
        for e in self.plan["processes"]:
            env = {**os.environ, **e["env"], "PDTOPO_DEPLOYMENT_TOKEN": self.token}
            log = open(self.run_dir / "logs" / f"{e['name']}.log", "ab")  # noqa: SIM115
            self.procs[e["name"]] = subprocess.Popen(
                e["command"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        for e in self.plan["processes"]:
            while True:
                if self.procs[e["name"]].poll() is not None:
                    raise RuntimeError(f"{e['name']} exited:\n{self.log_tail(e['name'])}")
                try:
                    if httpx.get(e["health_url"], timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{e['name']} not healthy:\n{self.log_tail(e['name'])}")
                time.sleep(0.3)

    def log_tail(self, name: str, n: int = 4000) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"

    def stop(self, timeout: float = 20) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
