"""`pdtopo render --format k8s`: the usual run dir, plus RUN/k8s/ with the GKE manifests.

Flow: composed config (with `server.bind_host=null`: every pod listens on its own plan
address) -> `expand_plan` -> `k8s_plan` (refuses what Kubernetes output cannot hold, e.g. a cpu
topology: exit 2, nothing written) -> `render_job` writes the run dir as for supervisord ->
`render_k8s` with the run's token -> RUN/k8s/*.yaml. The Secret holds the token of this
render (RUN/token); rendering again makes a new one, so apply the Secret with the pods.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.credentials import API_KEY_DERIVED_ENV, derived_api_key
from pdtopo.config.run_files import TOKEN_FILE
from pdtopo.config.schema import TopologyError, typed_proxy
from pdtopo.launcher.operate import display
from pdtopo.launcher.operate.prepare import render_job
from pdtopo.launcher.plan.expand import Plan, expand_plan
from pdtopo.launcher.plan.k8s import k8s_plan
from pdtopo.launcher.render.k8s import render_k8s, write_k8s_dir
from pdtopo.launcher.render.run_dir import remove_if_empty, resolved_config

FORMATS = ("supervisord", "k8s")


def k8s_objects(cfg: DictConfig, run_dir: Path, token: str) -> dict[str, dict]:
    """The manifests of a composed config (pure apart from the config; TopologyError)."""
    plan = expand_plan(cfg, run_dir=str(run_dir), cpus=[0], routable=True)  # pods: DNS names
    kplan, groups, settings = k8s_plan(plan, cfg)
    return render_k8s(kplan, groups, settings, config_text=resolved_config(cfg), token=token,
                      api_key=typed_proxy(cfg).api_key or clients_key(kplan, token))


def clients_key(plan: Plan, token: str) -> str | None:
    """The derived proxy API key when the plan uses one (P/D beyond loopback, no key
    configured): the Secret carries it for clients; the pods derive it from the token."""
    proxy = plan.by_name().get("proxy")
    if proxy is None or API_KEY_DERIVED_ENV not in proxy.env:
        return None
    return derived_api_key(token)


def render_k8s_job(cfg: DictConfig, run_dir: Path) -> int:
    OmegaConf.update(cfg, "server.bind_host", None, merge=False)
    try:
        k8s_objects(cfg, run_dir, "validation")
    except TopologyError as err:
        display.print_topology_error(err, display.console(stderr=True))
        remove_if_empty(run_dir)
        return 2
    code = render_job(cfg, run_dir)
    if code != 0:
        return code
    token = (Path(run_dir) / TOKEN_FILE).read_text().strip()
    objects = k8s_objects(cfg, run_dir, token)
    out = write_k8s_dir(run_dir, objects)
    con = display.console()
    con.print(f"  k8s: {len(objects)} objects in {out} (kubectl apply -f {out}); the Secret "
              f"holds this render's deployment token ({Path(run_dir) / TOKEN_FILE})")
    return 0
