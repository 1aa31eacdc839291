"""Multi-host deployments: which host a launcher runs, and where that host's files live.

A plan whose programs sit on more than one host is launched host by host: on every host,
`pdtopo launch +host=NAME ...` (or without `+host`, the one host of the topology whose address
is bound on this machine) starts only that host's programs. Each host gets a complete run dir
of its own, `RUN/hosts/NAME/` (config.yaml, the full plan.json, token, a supervisord.conf with
only NAME's programs, logs/), so hosts share nothing but the network and, when they are on one
file system, nothing collides. All hosts of a deployment need the same deployment token:
`PDTOPO_DEPLOYMENT_TOKEN` in the launcher's environment, else the token of a run dir already
rendered or launched there (`RUN/token`, `RUN/hosts/*/token`), else a new one.
Single-host plans keep the plain layout (everything directly in RUN).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.credentials import derived_api_key
from pdtopo.config.run_files import API_KEY_FILE, TOKEN_ENV, TOKEN_FILE
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import Plan
from pdtopo.launcher.render.run_dir import monitoring_files, resolved_config, uses_derived_key

HOSTS_DIR = "hosts"
HOST_KEY = "host"  # `+host=NAME` on the command line


def requested_host(cfg: DictConfig) -> str | None:
    value = OmegaConf.select(cfg, HOST_KEY, default=None)
    return None if value is None else str(value)


def host_dir(run_dir: Path, host: str) -> Path:
    return Path(run_dir) / HOSTS_DIR / host


def address_is_local(address: str) -> bool:
    """True when `address` is bound to an interface of this machine (network namespace)."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
    return False


def select_host(plan: Plan, requested: str | None, topology_hosts: list[str]) -> str | None:
    """The host whose programs this launcher runs; None for a single-host plan (all)."""
    used = plan.hosts()
    if requested is not None and requested not in topology_hosts:
        raise TopologyError(HOST_KEY, requested,
                            f"unknown host (hosts: {', '.join(topology_hosts)})")
    if len(used) <= 1:
        if requested is not None and used and requested != used[0]:
            raise TopologyError(HOST_KEY, requested, f"runs no program: every program of this "
                                f"topology is on {used[0]}")
        return None
    if requested is not None:
        if requested not in used:
            raise TopologyError(HOST_KEY, requested, "runs no program of this topology "
                                f"(hosts with programs: {', '.join(used)})")
        return requested
    addresses = {p.host: p.address for p in plan.processes}
    local = [h for h in used if address_is_local(addresses[h])]
    if len(local) == 1:
        return local[0]
    why = ("none of their addresses is on this machine" if not local else
           f"several are on this machine ({', '.join(local)})")
    raise TopologyError(HOST_KEY, None, f"the programs of this topology run on hosts "
                        f"{', '.join(f'{h} ({addresses[h]})' for h in used)} and {why}; "
                        "say which one this is with +host=NAME")


def deployment_token(run_dir: Path) -> str | None:
    """The token shared by all hosts of a deployment, if one is known already."""
    env = os.environ.get(TOKEN_ENV)
    if env:
        return env.strip()
    run = Path(run_dir)
    for path in [run / "token", *sorted(run.glob(f"{HOSTS_DIR}/*/token"))]:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


def resolve_host_run(run: Path) -> Path:
    """A run dir argument of status/stop/logs: the plain run dir, or for a multi-host run the
    dir of the host on this machine (RUN/hosts/NAME may also be given directly)."""
    if (run / "supervisord.conf").is_file() or not (run / HOSTS_DIR).is_dir():
        return run
    dirs = sorted(p.parent for p in (run / HOSTS_DIR).glob("*/supervisord.conf"))
    local = []
    for d in dirs:
        try:
            plan = json.loads((d / "plan.json").read_text())
        except (OSError, ValueError):
            continue
        addrs = {p["address"] for p in plan.get("processes", []) if p.get("host") == d.name}
        if any(address_is_local(a) for a in addrs):
            local.append(d)
    if len(local) == 1:
        return local[0]
    names = ", ".join(str(d) for d in (local or dirs)) or "none"
    raise FileNotFoundError(f"{run} is a multi-host run; give the host's dir ({names})")


def write_global(run_dir: Path, cfg: DictConfig, plan: Plan, token: str) -> None:
    """RUN/config.yaml, plan.json and token of a multi-host render (no supervisord.conf:
    each host's is under RUN/hosts/NAME)."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(resolved_config(cfg))
    (run / "plan.json").write_text(plan.to_json())
    for name, text in monitoring_files(cfg, plan).items():  # every host's programs
        (run / name).write_text(text)
    secrets = {TOKEN_FILE: token}
    if uses_derived_key(plan):
        secrets[API_KEY_FILE] = derived_api_key(token)
    for name, value in secrets.items():
        fd = os.open(run / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(value + "\n")


def host_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))
