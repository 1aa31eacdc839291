"""A running PD deployment as the operations on it read it from its run directory.

`Deployment.load(run_dir, verb)` reads plan.json, config.yaml, the deployment token and the
proxy's API key and refuses what the verbs (drain, restart, scale, the router watch) cannot work
on (not PD, several hosts, MiniLB) with an `OperationError` naming the run; `targets` turns a
program or role name into the instance leaders it names. A run launched before the launcher's
programs moved to `pdtopo.launcher.programs` names their old module paths in its
supervisord.conf: the verbs that start programs (restart, scale) refuse it, asking for a
relaunch (`pdtopo stop` and `status` still work on it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from pdtopo.config.run_conf import proxy_api_key
from pdtopo.config.run_files import CONF_FILE
from pdtopo.config.schema import ProxySchema, typed_proxy
from pdtopo.config.settings import LauncherSettings, runtime_settings
from pdtopo.launcher.operate.admin_http import OperationError
from pdtopo.launcher.operate.hosts import deployment_token
from pdtopo.launcher.operate.router_admin import RouterAdmin, router_url
from pdtopo.launcher.plan.expand import Plan, Process

SERVER_ROLES = ("prefill", "decode")
# programs once run as `pdtopo.launcher.<name>`, now `pdtopo.launcher.programs.<name>`
MOVED_PROGRAMS = ("pin", "router_entry", "router_watch", "nodelay_exec", "mini_lb_entry")
STARTING_VERBS = ("restart", "scale")  # verbs that make supervisord start programs again


def moved_program_modules(run_dir: Path) -> list[str]:
    """The old `pdtopo.launcher.<program>` module paths the run's supervisord.conf still runs."""
    try:
        text = (run_dir / CONF_FILE).read_text()
    except OSError:
        return []
    return sorted({m.group(0) for m in re.finditer(r"\bpdtopo\.launcher\.(\w+)\b", text)
                   if m.group(1) in MOVED_PROGRAMS})


@dataclass
class Deployment:
    """What drain/restart read from a run directory."""

    run_dir: Path
    plan: Plan
    proxy: ProxySchema
    launcher: LauncherSettings
    token: str
    proxy_url: str | None
    router: RouterAdmin
    migration: bool = False  # disaggregation.migration: a drained D's requests may move

    @classmethod
    def load(cls, run_dir: Path, verb: str = "drain/restart") -> Deployment:
        try:
            plan = Plan.from_dict(json.loads((run_dir / "plan.json").read_text()))
            cfg = OmegaConf.load(run_dir / "config.yaml")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OperationError(f"{run_dir}: not a readable pdtopo run ({exc})") from None
        moved = moved_program_modules(run_dir) if verb in STARTING_VERBS else []
        if moved:
            raise OperationError(f"{run_dir} was launched by an earlier pdtopo: its "
                                 f"{CONF_FILE} runs {', '.join(moved)} (now under "
                                 f"pdtopo.launcher.programs), so "
                                 f"pdtopo {verb} would start programs that no longer exist; "
                                 f"stop it (pdtopo stop {run_dir}) and launch it again")
        if cfg.get("topology", {}).get("mode") != "pd":
            raise OperationError(f"{run_dir}: pdtopo {verb} works on PD deployments (topology."
                                 f"mode={cfg.topology.mode!r}); stop and launch it again instead")
        hosts = {p.host for p in plan.processes}
        if len(hosts) > 1:
            raise OperationError(f"{run_dir}: a multi-host run ({', '.join(sorted(hosts))}); "
                                 f"pdtopo {verb} works on one-host runs this release")
        proxy = typed_proxy(cfg)
        if proxy.kind == "mini_lb":
            raise OperationError(f"proxy.kind=mini_lb: MiniLB has a fixed worker list and no "
                                 f"health checks, so pdtopo {verb} cannot change whom it routes to; "
                                 "use proxy=rust or gateway")
        token = deployment_token(run_dir)
        if not token:
            raise OperationError(f"{run_dir}: no deployment token (RUN/token)")
        proxies = [p for p in plan.processes if p.role == "proxy"]
        url = router_url(proxies[0]) if proxies else None
        router = RouterAdmin(url, proxy_api_key(run_dir, proxy))
        settings = runtime_settings(cfg)
        return cls(run_dir, plan, proxy, settings.launcher, token, url, router,
                   bool(settings.disaggregation.migration))

    def leaders(self, role: str) -> list[Process]:
        return [p for p in self.plan.processes
                if p.role == role and getattr(p, "leader", True) is not False]

    def instance(self, leader: Process) -> list[Process]:
        return [p for p in self.plan.processes if p.instance_id == leader.instance_id]

    def targets(self, target: str) -> list[Process]:
        """The leaders the target names, in order; OperationError for anything else."""
        if target in SERVER_ROLES:
            found = self.leaders(target)
            if not found:
                raise OperationError(f"this deployment has no {target} instance")
            return found
        by_name = self.plan.by_name()
        proc = by_name.get(target)
        if proc is None or proc.role not in SERVER_ROLES:
            names = [p.name for p in self.plan.processes if p.role in SERVER_ROLES]
            raise OperationError(f"{target!r} is not a prefill/decode program or role of this "
                                 f"deployment (programs: {', '.join(names)}; roles: prefill, "
                                 "decode)")
        return [p for p in self.leaders(proc.role) if p.instance_id == proc.instance_id]
