"""The run directory of a deployment: writing it, and finding it again.

`write_run_dir` lays out RUN/config.yaml (composed, resolved, no hydra node, proxy.api_key
redacted), plan.json,
supervisord.conf (0600: it holds the token), token (0600) and logs/. `find_latest_run`
returns the newest run dir under outputs/ (or multirun/) of a working directory.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pdtopo.launcher.plan import Plan

CONF_FILE = "supervisord.conf"
TOKEN_FILE = "token"
LOG_DIR = "logs"
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


def holds_deployment(run_dir: Path) -> bool:
    return (run_dir / "plan.json").exists() or (run_dir / CONF_FILE).exists()


def write_run_dir(run_dir: Path, cfg: DictConfig, plan: Plan, conf_text: str, token: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOG_DIR).mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(resolved_config(cfg))
    (run_dir / "plan.json").write_text(plan.to_json())
    _write_private(run_dir / TOKEN_FILE, token + "\n")
    _write_private(run_dir / CONF_FILE, conf_text)


def remove_if_empty(run_dir: Path) -> None:
    """Undo the empty directory Hydra created for a job that failed validation (and its
    outputs/<date>/ parent when that is empty too)."""
    try:
        run_dir.rmdir()
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", run_dir.parent.name):
            run_dir.parent.rmdir()
    except OSError:
        return


def find_latest_run(root: Path | None = None) -> Path | None:
    base = Path.cwd() if root is None else root
    candidates = [*base.glob(f"outputs/*/*/{CONF_FILE}"), *base.glob(f"multirun/*/*/*/{CONF_FILE}")]
    candidates += [p.parent.parent for p in base.glob(f"outputs/*/*/hosts/*/{CONF_FILE}")]
    if not candidates:
        return None
    latest = max(candidates, key=lambda p: p.stat().st_mtime)
    return latest.parent if latest.name == CONF_FILE else latest  # a multi-host run: RUN


def resolve_run_dir(arg: str | None) -> Path:
    if arg:
        run = Path(arg).resolve()
        if not (run / CONF_FILE).is_file() and not any(run.glob(f"hosts/*/{CONF_FILE}")):
            raise FileNotFoundError(f"{run} is not a pdtopo run directory (no {CONF_FILE})")
        return run
    latest = find_latest_run()
    if latest is None:
        raise FileNotFoundError(f"no pdtopo run directory under {Path.cwd()}/outputs")
    return latest.resolve()
