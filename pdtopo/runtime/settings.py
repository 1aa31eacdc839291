"""The one place a runtime process reads its configuration.

A launched program is started as `python -m pdtopo.runtime.<entry> --run-dir RUN --process NAME`.
`load_process_context` reads RUN/config.yaml (the composed config) and RUN/plan.json (the plan),
picks the process entry named NAME and returns a `ProcessContext`. The per-run deployment token
arrives through the environment (the launcher puts it into supervisord's program environment)
and is read here, nowhere else; so is the proxy's API key of a server that checks credentials
(`pdtopo.config.credentials`). A colocated server started directly gets a context built from a
composed config and a port via `direct_process_context`.

Per-role engine overrides: a topology may give `topology.<role>.engine.<key>` (e.g. a decode
pool with another page size, for experts and compatibility tests); `role_engine_config` merges
the non-null ones into `cfg.engine` for that role's processes. `ctx.settings` is the typed,
checked view of that config (`pdtopo.config.settings.RuntimeSettings`, built once per
process): the runtime reads its settings there, never raw config keys with casts and defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.credentials import read_api_key
from pdtopo.config.run_files import CONFIG_FILE, PLAN_FILE, TOKEN_ENV
from pdtopo.config.settings import RuntimeSettings, role_engine_overrides, runtime_settings


@dataclass(frozen=True)
class ProcessContext:
    """Everything a runtime process needs: composed config, its plan entry, the whole plan."""

    cfg: DictConfig
    process: dict[str, Any]
    plan: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None
    token: str | None = None
    api_key: str | None = None  # the proxy's API key, where the plan gives it (credentials.py)

    @property
    def name(self) -> str:
        return self.process["name"]

    @property
    def role(self) -> str:
        return self.process["role"]

    @property
    def address(self) -> str:
        return self.process.get("address", "127.0.0.1")

    @property
    def ports(self) -> dict[str, int]:
        return dict(self.process.get("ports", {}))

    @property
    def rank(self) -> dict[str, int]:
        return dict(self.process.get("rank", {}))

    @cached_property
    def settings(self) -> RuntimeSettings:
        """The typed settings of this process (its role's engine overrides applied)."""
        return runtime_settings(self.cfg)

    @property
    def bootstrap_url(self) -> str | None:
        return self.plan.get("bootstrap_url")

    @property
    def bind_host(self) -> str:
        """Where this process's servers listen: `server.bind_host`, or (null) its plan
        address, so that programs on other hosts of a multi-host topology reach it."""
        configured = self.settings.server.bind_host
        return configured or self.address


def role_engine_config(cfg: DictConfig, role: str) -> DictConfig:
    """`cfg` with the non-null values of `topology.<role>.engine` merged into `engine`."""
    values = role_engine_overrides(cfg, role)
    if not values:
        return cfg
    merged = OmegaConf.to_container(cfg, resolve=True)
    merged["engine"] = {**merged.get("engine", {}), **values}
    return OmegaConf.create(merged)


def load_process_context(run_dir: str | Path, process_name: str) -> ProcessContext:
    run = Path(run_dir)
    cfg_path, plan_path = run / CONFIG_FILE, run / PLAN_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: is --run-dir a pdtopo run directory?")
    cfg = OmegaConf.load(cfg_path)
    plan = json.loads(plan_path.read_text()) if plan_path.is_file() else {"processes": []}
    by_name = {p["name"]: p for p in plan.get("processes", [])}
    if process_name not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        raise KeyError(f"process {process_name!r} is not in {plan_path} (known: {known})")
    process = by_name[process_name]
    return ProcessContext(
        cfg=role_engine_config(cfg, process["role"]),
        process=process,
        plan=plan,
        run_dir=run,
        token=os.environ.get(TOKEN_ENV),
        api_key=read_api_key(os.environ, os.environ.get(TOKEN_ENV)),
    )


def direct_process_context(
    cfg: DictConfig, *, role: str = "colocated", port: int = 30000, host: str = "127.0.0.1",
    name: str | None = None, extra: dict[str, Any] | None = None, token: str | None = None,
) -> ProcessContext:
    """A context for a server started without a launcher run directory (tests, direct form)."""
    process: dict[str, Any] = {
        "name": name or f"{role}_direct",
        "role": role,
        "host": "localhost",
        "address": host,
        "instance_id": name or f"{role}_direct",
        "rank": {"tp_rank": 0, "tp_size": 1, "cp_rank": 0, "cp_size": 1,
                 "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1},
        "chips": [0],
        "mesh": {"tp": 1},
        "ports": {"http": port},
    }
    process.update(extra or {})
    return ProcessContext(cfg=role_engine_config(cfg, process["role"]), process=process, plan={}, run_dir=None,
                          token=token if token is not None else os.environ.get(TOKEN_ENV))
