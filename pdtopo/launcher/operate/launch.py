"""The launch job: prepared plan -> run dir -> supervisord -> healthy deployment.

`launch_job` prepares the plan (`prepare.prepare_or_report`: plan, model pre-flight, platform,
host ports; a sweep job's ports are waited for, a previous job may still be releasing them),
writes the run dir, starts supervisord, waits for every program's health in start order with a
live table, prints endpoints and either returns (detach), runs the `bench` config against it and
tears down (multirun jobs: `pdtopo.bench.job`, whatever happens), or stays up until Ctrl-C /
`pdtopo stop`. Only `pdtopo.cli` imports this module.
Exit codes: 0 ok, 1 runtime failure (health, FATAL, supervisord), 2 invalid topology.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from omegaconf import DictConfig
from rich.live import Live

from pdtopo.bench.job import bench_job, record_job
from pdtopo.config.run_conf import proxy_api_key
from pdtopo.config.run_files import API_KEY_FILE
from pdtopo.config.schema import typed_proxy
from pdtopo.config.settings import group_settings
from pdtopo.launcher.operate import display
from pdtopo.launcher.operate.health import (
    WorkerAnnouncer,
    attention_of,
    router_workers_ready,
    wait_for_programs,
)
from pdtopo.launcher.operate.prepare import Prepared, prepare_or_report
from pdtopo.launcher.operate.router_admin import RouterAdmin, router_url
from pdtopo.launcher.operate.supervisor_control import (
    Supervisor,
    SupervisorError,
    log_tail,
    teardown,
)
from pdtopo.launcher.render.run_dir import uses_derived_key, write_run_dir

MULTIRUN_PORT_WAIT_S = 60.0


@dataclass
class LaunchOptions:
    detach: bool = False
    multirun: bool = False


class _Terminate(Exception):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminate()


def launch_job(cfg: DictConfig, run_dir: Path, opts: LaunchOptions) -> int:
    errors: list[str] = []
    # sweep jobs run one after another on the same ports: wait for the previous job's to free
    prepared = prepare_or_report(cfg, run_dir, check_ports=True, errors=errors,
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


def _announcer(cfg: DictConfig, plan, api_key: str | None) -> WorkerAnnouncer | None:
    """Who tells the router of a server as soon as it is healthy: the PD router (rust or
    gateway, which keep a worker registry) of a plan that holds it; None otherwise."""
    proxy = next((p for p in plan.processes if p.role == "proxy"), None)
    if proxy is None or typed_proxy(cfg).kind not in ("rust", "gateway") or \
            not any(p.role in ("prefill", "decode") for p in plan.processes):
        return None
    return WorkerAnnouncer(RouterAdmin(router_url(proxy), api_key))


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
        pools = prepared.kv_pools
        with Live(display.health_table(plan, [], kv_pools=pools), console=con,
                  refresh_per_second=4) as live:
            result = wait_for_programs(
                plan, sv.states, timeout,
                on_update=lambda rows: live.update(display.health_table(plan, rows,
                                                                        kv_pools=pools)),
                workers_fn=partial(router_workers_ready, api_key=api_key),
                announce=_announcer(cfg, plan, api_key),
                attention_fn=partial(attention_of, token=prepared.token))
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
        for row in result.rows:  # warmup fell back from the TPU kernel (attention column)
            if "refused" in row.attention:
                con.print(f"  {row.name}: attention {row.attention} (logs/{row.name}.log)",
                          style="red", markup=False, highlight=False)
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
