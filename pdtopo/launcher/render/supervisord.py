"""Render a Plan as a supervisord.conf (plain text, pure).

The conf holds a unix socket (no TCP port) inside the run dir, or under /tmp when the run-dir
path would exceed the AF_UNIX path limit; `[rpcinterface:supervisor]` and `[supervisorctl]`
so `supervisorctl -c RUN/supervisord.conf` works; one `[program:NAME]` per plan process, in
plan order. The deployment token (and the proxy's API key, `Process.secret_env`) go into the
programs' environment, so the conf is written with mode 0600. Processes with `cpu_affinity`
run through `pdtopo.launcher.programs.pin`. With `ProgramSettings.router_watch`, an
`[eventlistener:router_watch]` (pdtopo.launcher.programs.router_watch) follows the programs;
with `ProgramSettings.planner` (planner.enabled), a `[program:planner]`
(pdtopo.launcher.programs.planner): started last, stopped first, restarted when it exits.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import PurePath

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.run_files import TOKEN_ENV
from pdtopo.config.schema import PROGRAM_STOP_WAIT_S, typed_proxy
from pdtopo.config.settings import group_settings
from pdtopo.launcher.plan.expand import Plan, Process

SOCKET_NAME = "supervisor.sock"
MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux (104 on macOS); keep a margin
PIN_MODULE = "pdtopo.launcher.programs.pin"
ROUTER_WATCH_MODULE = "pdtopo.launcher.programs.router_watch"
PLANNER_MODULE = "pdtopo.launcher.programs.planner"
PLANNER_PROGRAM = "planner"
PLANNER_PRIORITY = 999  # after every program of the plan; supervisord stops it first
PLANNER_STOP_WAIT_S = 30  # a change under way is interrupted and rolled back (programs/planner)


@dataclass(frozen=True)
class ProgramSettings:
    startsecs: int = 2
    startretries: int = 3
    stopwaitsecs: int = PROGRAM_STOP_WAIT_S
    stopsignal: str = "TERM"
    router_watch: bool = False  # add the router watch event listener (launcher.router_watch)
    planner: bool = False       # add the live planner's program (planner.enabled)


def socket_path(run_dir: str | PurePath) -> str:
    """The supervisord unix socket for a run dir (short /tmp fallback for long paths)."""
    inside = str(PurePath(run_dir) / SOCKET_NAME)
    if len(inside) <= MAX_SOCKET_PATH:
        return inside
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]
    return f"/tmp/pdtopo-{digest}.sock"


def _escape(text: str) -> str:
    return text.replace("%", "%%")


def _env_value(key: str, value: str) -> str:
    if "\n" in value or ('"' in value and "'" in value):
        raise ValueError(f"environment variable {key} has a value supervisord cannot hold: "
                         f"{value!r}")
    quote = "'" if '"' in value else '"'
    return f"{key}={quote}{_escape(value)}{quote}"


def program_command(proc: Process) -> list[str]:
    if proc.cpu_affinity:
        python = proc.command[0]
        cores = ",".join(str(c) for c in proc.cpu_affinity)
        return [python, "-m", PIN_MODULE, cores, "--", *proc.command]
    return list(proc.command)


def render_supervisord(plan: Plan, *, run_dir: str | PurePath, token: str,
                       workdir: str | PurePath, settings: ProgramSettings = ProgramSettings(),
                       ) -> str:
    run = PurePath(run_dir)
    for what, path in (("run dir", run_dir), ("working directory", workdir)):
        if "%" in str(path):  # supervisord expands some path options twice; refuse
            raise ValueError(f"{what} {str(path)!r} contains '%', which supervisord cannot hold")
    sock = socket_path(run)
    lines = [
        f"; pdtopo deployment of topology {plan.topology} (mode {plan.mode}). Generated: "
        "edit the topology, not this file.",
        "[unix_http_server]",
        f"file={_escape(sock)}",
        "chmod=0700",
        "",
        "[supervisord]",
        f"logfile={_escape(str(run / 'supervisord.log'))}",
        f"pidfile={_escape(str(run / 'supervisord.pid'))}",
        f"childlogdir={_escape(str(run / 'logs'))}",
        f"directory={_escape(str(workdir))}",
        f"identifier=pdtopo-{plan.topology}",
        "nodaemon=false",
        "loglevel=info",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{_escape(sock)}",
        "",
    ]
    for proc in plan.processes:
        env = {**proc.env, **proc.secret_env, TOKEN_ENV: token}
        lines += [
            f"[program:{proc.name}]",
            f"command={_escape(shlex.join(program_command(proc)))}",
            "environment=" + ",".join(_env_value(k, str(v)) for k, v in env.items()),
            f"directory={_escape(str(workdir))}",
            f"priority={proc.priority}",
            "autostart=true",
            "autorestart=true",
            f"startsecs={settings.startsecs}",
            f"startretries={settings.startretries}",
            "stopasgroup=true",
            "killasgroup=true",
            f"stopsignal={settings.stopsignal}",
            f"stopwaitsecs={settings.stopwaitsecs}",
            f"stdout_logfile={_escape(str(run / 'logs' / (proc.name + '.log')))}",
            "stdout_logfile_maxbytes=50MB",
            "stdout_logfile_backups=2",
            "redirect_stderr=true",
            "",
        ]
    proxy = next((p for p in plan.processes if p.role == "proxy"), None)
    if settings.router_watch and proxy is not None:
        lines += _router_watch(proxy.command[0], run, workdir)
    if settings.planner and proxy is not None:
        lines += _planner(proxy.command[0], run, workdir)
    return "\n".join(lines)


def _router_watch(python: str, run: PurePath, workdir: str | PurePath) -> list[str]:
    """The event listener section; its stdout is supervisord's event protocol, so its log is
    its stderr."""
    return [
        "[eventlistener:router_watch]",
        f"command={_escape(shlex.join([python, '-m', ROUTER_WATCH_MODULE, str(run)]))}",
        "events=PROCESS_STATE",
        f"directory={_escape(str(workdir))}",
        "priority=1",
        "autostart=true",
        "autorestart=true",
        "stopasgroup=true",
        "killasgroup=true",
        "stdout_logfile=NONE",  # the protocol channel: no AUTO log file of it in logs/
        f"stderr_logfile={_escape(str(run / 'logs' / 'router_watch.log'))}",
        "stderr_logfile_maxbytes=10MB",
        "stderr_logfile_backups=2",
        "",
    ]


def _planner(python: str, run: PurePath, workdir: str | PurePath) -> list[str]:
    """The planner's program: restarted whenever it exits (a crash loop ends in FATAL, the
    deployment serving on as it is); stopped, it waits for the roll-back of a change under
    way (PLANNER_STOP_WAIT_S); its own log is logs/planner.log, its decisions
    RUN/planner.log."""
    return [
        f"[program:{PLANNER_PROGRAM}]",
        f"command={_escape(shlex.join([python, '-m', PLANNER_MODULE, str(run)]))}",
        f"directory={_escape(str(workdir))}",
        f"priority={PLANNER_PRIORITY}",
        "autostart=true",
        "autorestart=true",
        "startsecs=1",
        "startretries=10",
        "stopasgroup=true",
        "killasgroup=true",
        "stopsignal=TERM",
        f"stopwaitsecs={PLANNER_STOP_WAIT_S}",
        f"stdout_logfile={_escape(str(run / 'logs' / (PLANNER_PROGRAM + '.log')))}",
        "stdout_logfile_maxbytes=10MB",
        "stdout_logfile_backups=2",
        "redirect_stderr=true",
        "",
    ]


def program_settings(cfg: DictConfig) -> ProgramSettings:
    launcher = group_settings(cfg, "launcher")
    return ProgramSettings(startsecs=launcher.startsecs, startretries=launcher.startretries,
                           router_watch=launcher.router_watch and watchable(cfg),
                           planner=bool(OmegaConf.select(cfg, "planner.enabled", default=False))
                           and cfg.topology.mode == "pd")


def watchable(cfg: DictConfig) -> bool:
    """A deployment the router watch can serve: PD, one host, a proxy with a worker registry
    (rust, gateway; MiniLB has a fixed list)."""
    topo = cfg.topology
    return (topo.mode == "pd" and len(topo.get("hosts") or []) <= 1
            and typed_proxy(cfg).kind in ("rust", "gateway"))
