"""The run directory of a deployment: writing it, and finding it again.

`write_run_dir` lays out RUN/config.yaml (composed, resolved, no hydra node, proxy.api_key
redacted), plan.json, supervisord.conf (0600: it holds the token), token (0600), api_key (0600,
only when the proxy key is derived from the token: what clients send), logs/, and
prometheus.yml + grafana-dashboard.json for the programs this supervisord runs
(`pdtopo.launcher.render.monitoring`; names in `pdtopo.config.run_files`, which also finds a run dir
again).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.credentials import API_KEY_DERIVED_ENV, derived_api_key
from pdtopo.config.run_files import (
    API_KEY_FILE,
    CONF_FILE,
    CONFIG_FILE,
    DASHBOARD_FILE,
    LOG_DIR,
    PLAN_FILE,
    PROMETHEUS_FILE,
    TOKEN_FILE,
)
from pdtopo.config.settings import group_settings
from pdtopo.launcher.plan.expand import Plan
from pdtopo.launcher.render.monitoring import render_dashboard, render_prometheus

REDACTED = "<redacted: in supervisord.conf>"


def new_token() -> str:
    return secrets.token_hex(16)


def resolved_config(cfg: DictConfig) -> str:
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    data.pop("hydra", None)
    proxy = data.get("proxy")
    if isinstance(proxy, dict) and proxy.get("api_key"):
        proxy["api_key"] = REDACTED  # the key lives in supervisord.conf (0600) only
    return OmegaConf.to_yaml(OmegaConf.create(data))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def monitoring_files(cfg: DictConfig, monitored: Plan) -> dict[str, str]:
    """File name -> text of the run dir's Prometheus config and Grafana dashboard."""
    interval = group_settings(cfg, "launcher").prometheus_scrape_interval_s
    return {PROMETHEUS_FILE: render_prometheus(monitored, interval),
            DASHBOARD_FILE: render_dashboard(monitored)}


def write_run_dir(run_dir: Path, cfg: DictConfig, plan: Plan, conf_text: str, token: str,
                  monitored: Plan | None = None) -> None:
    """`monitored`: the programs prometheus.yml scrapes (this host's part of a multi-host
    plan); default the whole plan."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOG_DIR).mkdir(exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(resolved_config(cfg))
    (run_dir / PLAN_FILE).write_text(plan.to_json())
    _write_private(run_dir / TOKEN_FILE, token + "\n")
    if uses_derived_key(plan):
        _write_private(run_dir / API_KEY_FILE, derived_api_key(token) + "\n")
    _write_private(run_dir / CONF_FILE, conf_text)
    for name, text in monitoring_files(cfg, monitored or plan).items():
        (run_dir / name).write_text(text)


def uses_derived_key(plan: Plan) -> bool:
    """The API key is derived from the token (servers that require a credential, none
    configured): clients find it in RUN/api_key."""
    return any(API_KEY_DERIVED_ENV in p.env for p in plan.processes)


def remove_if_empty(run_dir: Path) -> None:
    """Undo the empty directory Hydra created for a job that failed validation (and its
    outputs/<date>/ parent when that is empty too)."""
    try:
        run_dir.rmdir()
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", run_dir.parent.name):
            run_dir.parent.rmdir()
    except OSError:
        return
