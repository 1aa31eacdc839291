"""Prepare a launch or a render: composed config -> validated plan -> supervisord.conf.

`prepare` does everything that can fail on bad input without touching processes (plan
expansion + validation, supervisord.conf rendering); `prepare_or_report` adds the model
pre-flight (`preflight.check_model`: config.json, checkpoint headers, tp vs heads), and for a
launch the platform and host-port checks, printing a `TopologyError` as the user sees it.
`render_job` (`pdtopo render`) writes the run dir from it and starts nothing; `launch.launch_job`
starts what it prepared.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.run_files import holds_deployment
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.operate import display, hosts
from pdtopo.launcher.operate.preflight import check_platform, checked_model, wait_ports_free
from pdtopo.launcher.plan.expand import Plan, expand_plan
from pdtopo.launcher.plan.kv_pool import pool_summaries
from pdtopo.launcher.render.run_dir import new_token, remove_if_empty, write_run_dir
from pdtopo.launcher.render.supervisord import program_settings, render_supervisord


@dataclass
class Prepared:
    plan: Plan  # what this supervisord runs (one host's programs of a multi-host plan)
    conf_text: str
    token: str
    full_plan: Plan | None = None  # the whole plan (plan.json) when `plan` is one host's part
    run_dir: Path | None = None    # where supervisord runs: RUN, or RUN/hosts/NAME
    kv_pools: dict[str, str] = field(default_factory=dict)  # program -> its KV pool (kv_pool)


def prepare(cfg: DictConfig, run_dir: Path, *, token: str | None = None,
            workdir: Path | None = None, python: str | None = None,
            cpus: list[int] | None = None, host: str | None = None) -> Prepared:
    """Plan + supervisord.conf for `run_dir`; with `host`, the conf holds that host's programs."""
    run_dir = Path(run_dir)
    full = expand_plan(cfg, run_dir=str(run_dir), python=python or sys.executable,
                       cpus=hosts.host_cpus() if cpus is None else cpus)
    plan = full
    if host is not None:
        plan = full.for_host(host)
        plan.warnings = list(full.warnings)
    token = token or new_token()
    conf = render_supervisord(plan, run_dir=run_dir, token=token,
                              workdir=workdir or Path.cwd(), settings=program_settings(cfg))
    return Prepared(plan, conf, token, full, run_dir)


def _host_target(cfg: DictConfig, run_dir: Path) -> tuple[Path, str | None, str | None]:
    """(supervisord dir, host, shared token) of this launcher: RUN for single-host plans,
    RUN/hosts/NAME for the host of a multi-host plan (+host=NAME or auto-detected)."""
    plan = expand_plan(cfg, run_dir=str(run_dir), cpus=[0])
    names = [str(h.name) for h in OmegaConf.select(cfg, "topology.hosts", default=[]) or []]
    host = hosts.select_host(plan, hosts.requested_host(cfg), names)
    if host is None:
        return run_dir, None, None
    return hosts.host_dir(run_dir, host), host, hosts.deployment_token(run_dir)


def prepare_or_report(cfg: DictConfig, run_dir: Path, check_ports: bool,
                       wait_ports_s: float = 0.0,
                       errors: list[str] | None = None,
                       select_host: bool = True) -> Prepared | None:
    con = display.console(stderr=True)
    try:
        sv_dir, host, token = _host_target(cfg, run_dir) if select_host else (run_dir, None,
                                                                              None)
        if holds_deployment(sv_dir):
            raise TopologyError("hydra.run.dir", str(sv_dir),
                                "already holds a deployment; pick a new run dir")
        prepared = prepare(cfg, sv_dir, token=token, host=host)
        # launch: strict (the programs start here); render: a dry run (see preflight)
        if check_ports:
            check_platform(prepared.plan)
        warnings, model = checked_model(cfg, prepared.plan, strict=check_ports)
        prepared.plan.warnings += warnings
        prepared.kv_pools = pool_summaries(cfg, prepared.plan, model)
        for warning in prepared.plan.warnings:
            con.print(f"[bold yellow]WARNING:[/] {warning}", highlight=False)
        if check_ports:
            wait_ports_free(prepared.plan, wait_ports_s)
        return prepared
    except TopologyError as err:
        if errors is not None:
            errors.append(str(err))
        display.print_topology_error(err, con)
        remove_if_empty(run_dir)
        return None


def render_job(cfg: DictConfig, run_dir: Path) -> int:
    prepared = prepare_or_report(cfg, run_dir, check_ports=False, select_host=False)
    if prepared is None:
        return 2
    con = display.console()
    if len(prepared.plan.hosts()) > 1:  # RUN: config + plan + token; RUN/hosts/NAME per host
        hosts.write_global(run_dir, cfg, prepared.plan, prepared.token)
        for name in prepared.plan.hosts():
            part = prepare(cfg, hosts.host_dir(run_dir, name), token=prepared.token, host=name)
            write_run_dir(hosts.host_dir(run_dir, name), cfg, part.full_plan or part.plan,
                          part.conf_text, part.token, monitored=part.plan)
            con.print(f"  {name}: {len(part.plan.processes)} programs in "
                      f"{hosts.host_dir(run_dir, name)}")
        con.print(f"rendered [bold]{prepared.plan.topology}[/] "
                  f"({len(prepared.plan.processes)} programs on "
                  f"{len(prepared.plan.hosts())} hosts) into {run_dir}")
        return 0
    write_run_dir(run_dir, cfg, prepared.plan, prepared.conf_text, prepared.token)
    con.print(f"rendered [bold]{prepared.plan.topology}[/] "
              f"({len(prepared.plan.processes)} programs) into {run_dir}")
    for name, pool in prepared.kv_pools.items():
        con.print(f"  {name}: KV pool {pool}", highlight=False, soft_wrap=True)
    return 0
