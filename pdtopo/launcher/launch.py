"""The launch and render jobs: composed config -> validated plan -> run dir -> supervisord.

`prepare` does everything that can fail on bad input without touching disk or processes
(plan expansion + validation, supervisord.conf rendering); the model pre-flight
(`preflight.check_model`: config.json, checkpoint headers, tp vs heads) reads the checkpoint
but starts nothing. `render_job` then writes the run dir; `launch_job` additionally checks host ports, starts supervisord, waits for every program's
health in start order with a live table, prints endpoints and either returns (detach), runs the
`bench` config against it and tears down (multirun jobs: `pdtopo.bench.job`, whatever happens;
the job's ports are waited for, a previous job may still be releasing them), or stays up until
Ctrl-C / `pdtopo stop`.
Exit codes: 0 ok, 1 runtime failure (health, FATAL, supervisord), 2 invalid topology.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.live import Live

from pdtopo.bench.job import bench_job, record_job
from pdtopo.config.run_files import API_KEY_FILE, holds_deployment
from pdtopo.config.schema import TopologyError, typed_proxy
from pdtopo.config.settings import group_settings
from pdtopo.launcher import display, hosts
from pdtopo.launcher.health import router_workers_ready, wait_for_programs
from pdtopo.launcher.plan import Plan, expand_plan
from pdtopo.launcher.ports import wait_ports_free
from pdtopo.launcher.preflight import check_model, check_platform
from pdtopo.launcher.render_supervisord import ProgramSettings, render_supervisord
from pdtopo.launcher.run_conf import proxy_api_key
from pdtopo.launcher.run_dir import new_token, remove_if_empty, uses_derived_key, write_run_dir
from pdtopo.launcher.supervisor_control import Supervisor, SupervisorError, teardown

LOG_TAIL_LINES = 40
MULTIRUN_PORT_WAIT_S = 60.0


@dataclass
class LaunchOptions:
    detach: bool = False
    multirun: bool = False


@dataclass
class Prepared:
    plan: Plan  # what this supervisord runs (one host's programs of a multi-host plan)
    conf_text: str
    token: str
    full_plan: Plan | None = None  # the whole plan (plan.json) when `plan` is one host's part
    run_dir: Path | None = None    # where supervisord runs: RUN, or RUN/hosts/NAME


def host_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def program_settings(cfg: DictConfig) -> ProgramSettings:
    launcher = group_settings(cfg, "launcher")
    return ProgramSettings(startsecs=launcher.startsecs, startretries=launcher.startretries,
                           router_watch=launcher.router_watch and watchable(cfg))


def watchable(cfg: DictConfig) -> bool:
    """A deployment the router watch can serve: PD, one host, a proxy with a worker registry
    (rust, gateway; MiniLB has a fixed list)."""
    topo = cfg.topology
    return (topo.mode == "pd" and len(topo.get("hosts") or []) <= 1
            and typed_proxy(cfg).kind in ("rust", "gateway"))


def prepare(cfg: DictConfig, run_dir: Path, *, token: str | None = None,
            workdir: Path | None = None, python: str | None = None,
            cpus: list[int] | None = None, host: str | None = None) -> Prepared:
    """Plan + supervisord.conf for `run_dir`; with `host`, the conf holds that host's programs."""
    run_dir = Path(run_dir)
    full = expand_plan(cfg, run_dir=str(run_dir), python=python or sys.executable,
                       cpus=host_cpus() if cpus is None else cpus)
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


def _prepare_or_report(cfg: DictConfig, run_dir: Path, check_ports: bool,
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
        prepared.plan.warnings += check_model(cfg, prepared.plan, strict=check_ports)
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
    prepared = _prepare_or_report(cfg, run_dir, check_ports=False, select_host=False)
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
    return 0


def log_tail(run_dir: Path, program: str, lines: int = LOG_TAIL_LINES) -> str:
    path = run_dir / "logs" / f"{program}.log"
    try:
        data = path.read_bytes()[-65536:].decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(data.splitlines()[-lines:])


class _Terminate(Exception):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminate()


def launch_job(cfg: DictConfig, run_dir: Path, opts: LaunchOptions) -> int:
    errors: list[str] = []
    # sweep jobs run one after another on the same ports: wait for the previous job's to free
    prepared = _prepare_or_report(cfg, run_dir, check_ports=True, errors=errors,
                                  wait_ports_s=MULTIRUN_PORT_WAIT_S if opts.multirun else 0.0)
    if prepared is None:
        if opts.multirun:
            record_job(run_dir, "invalid", cfg=cfg, error="; ".join(errors), exit_code=2)
        return 2
    run_dir = prepared.run_dir or run_dir  # RUN/hosts/NAME for one host of a multi-host plan
    try:
        return _launch_prepared(cfg, run_dir, opts, prepared)
    except Exception as exc:
        try:
            teardown(run_dir)  # nothing of a failed job may stay up
        except Exception as down_exc:  # noqa: BLE001
            display.console(stderr=True).print(f"[bold red]teardown failed:[/] {down_exc!r}")
        if not opts.multirun:
            raise
        display.console().print(f"[bold red]job failed:[/] {exc!r}; torn down")
        record_job(run_dir, "failed", cfg=cfg, error=repr(exc), exit_code=1)
        return 1


def _launch_prepared(cfg: DictConfig, run_dir: Path, opts: LaunchOptions,
                     prepared: Prepared) -> int:
    plan = prepared.plan
    write_run_dir(run_dir, cfg, prepared.full_plan or plan, prepared.conf_text, prepared.token,
                  monitored=plan)
    con = display.console()
    con.print(f"launching [bold]{plan.topology}[/] from {run_dir}")
    sv = Supervisor(run_dir)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        started = time.perf_counter()
        try:
            sv.start()
        except SupervisorError as exc:
            con.print(f"[bold red]error:[/] {exc}")
            teardown(run_dir)
            if opts.multirun:
                record_job(run_dir, "failed", cfg=cfg, error=str(exc), exit_code=1)
            return 1
        timeout = group_settings(cfg, "launcher").health_timeout_s
        api_key = proxy_api_key(run_dir, typed_proxy(cfg))
        with Live(display.health_table(plan, []), console=con, refresh_per_second=4) as live:
            result = wait_for_programs(
                plan, sv.states, timeout,
                on_update=lambda rows: live.update(display.health_table(plan, rows)),
                workers_fn=partial(router_workers_ready, api_key=api_key))
        if not result.ok:
            con.print(f"[bold red]launch failed:[/] {result.reason}")
            con.rule(f"last lines of logs/{result.failed}.log")
            con.print(log_tail(run_dir, result.failed or ""), markup=False, highlight=False)
            con.rule()
            teardown(run_dir)
            con.print("torn down")
            if opts.multirun:
                record_job(run_dir, "failed", cfg=cfg, error=f"launch: {result.reason}",
                           exit_code=1, log_tail=log_tail(run_dir, result.failed or "", 10))
            return 1
        healthy_s = time.perf_counter() - started
        con.print(f"[bold green]all programs healthy[/] ({healthy_s:.1f} s after launch)")
        key_file = run_dir / API_KEY_FILE if uses_derived_key(plan) else None
        for line in display.endpoints_text(plan, key_file):
            con.print("  " + line, markup=False)
        if opts.multirun:  # a sweep job: benchmark, then tear down whatever happens
            try:
                return bench_job(cfg, run_dir, plan, healthy_s, con, api_key=api_key)
            finally:
                teardown(run_dir)
                con.print("multirun job: torn down")
        if opts.detach:
            con.print(f"detached; stop with: pdtopo stop {run_dir}")
            return 0
        con.print("serving; Ctrl-C or `pdtopo stop` to tear down")
        while sv.is_up():
            time.sleep(1.0)
        con.print("supervisord stopped; checking that nothing is left")
        teardown(run_dir)
        return 0
    except (KeyboardInterrupt, _Terminate):
        con.print("\ntearing down ...")
        killed = teardown(run_dir)
        con.print(f"torn down{f' (killed leftovers {killed})' if killed else ''}")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
