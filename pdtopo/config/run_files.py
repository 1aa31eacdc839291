"""Names inside a run directory, and finding a run directory again (shared by all layers).

The launcher writes RUN/ (`pdtopo.launcher.render.run_dir`), the runtime reads it
(`pdtopo.runtime.settings`), the CLI verbs and `pdtopo bench` find it: the file names, the
token's environment variable and the look-up live here, below all of them.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.yaml"        # the composed, resolved config
PLAN_FILE = "plan.json"            # the plan (every program of the deployment)
CONF_FILE = "supervisord.conf"     # 0600: holds the token
TOKEN_FILE = "token"               # 0600
API_KEY_FILE = "api_key"           # 0600: the derived proxy API key (pdtopo.config.credentials)
LOG_DIR = "logs"
PROMETHEUS_FILE = "prometheus.yml"          # scrape config of the programs (this host's)
DASHBOARD_FILE = "grafana-dashboard.json"   # a Grafana dashboard over those metrics
TOKEN_ENV = "PDTOPO_DEPLOYMENT_TOKEN"  # how the token reaches a program (supervisord env)


def holds_deployment(run_dir: Path) -> bool:
    return (run_dir / PLAN_FILE).exists() or (run_dir / CONF_FILE).exists()


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
