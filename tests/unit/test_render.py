"""supervisord.conf rendering: sections, per-program settings, socket fallback, escaping."""

from __future__ import annotations

import configparser

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.render.supervisord import (
    MAX_SOCKET_PATH,
    ProgramSettings,
    render_supervisord,
    socket_path,
)


def rendered(run_dir="/runs/r1", *overrides, cpus=None, settings=ProgramSettings()):
    plan = expand_plan(compose_config(["model=tiny_llama", *overrides]), run_dir=run_dir,
                       python="/py", cpus=cpus)
    text = render_supervisord(plan, run_dir=run_dir, token="tok123", workdir="/work",
                              settings=settings)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    return plan, text, parser


def test_sections_and_program_settings():
    plan, _, conf = rendered("/runs/r1", settings=ProgramSettings(startsecs=5, startretries=7))
    assert conf.get("unix_http_server", "file") == "/runs/r1/supervisor.sock"
    assert conf.get("supervisorctl", "serverurl") == "unix:///runs/r1/supervisor.sock"
    assert "supervisor.rpcinterface:make_main_rpcinterface" in \
        conf.get("rpcinterface:supervisor", "supervisor.rpcinterface_factory")
    assert conf.get("supervisord", "pidfile") == "/runs/r1/supervisord.pid"
    assert conf.get("supervisord", "logfile") == "/runs/r1/supervisord.log"
    assert not conf.has_section("inet_http_server")
    programs = [s.split(":", 1)[1] for s in conf.sections() if s.startswith("program:")]
    assert programs == [p.name for p in plan.processes]
    for proc in plan.processes:
        sec = f"program:{proc.name}"
        assert conf.get(sec, "priority") == str(proc.priority)
        assert conf.get(sec, "stdout_logfile") == f"/runs/r1/logs/{proc.name}.log"
        for key, value in (("autorestart", "true"), ("stopasgroup", "true"),
                           ("killasgroup", "true"), ("redirect_stderr", "true"),
                           ("startsecs", "5"), ("startretries", "7"), ("directory", "/work")):
            assert conf.get(sec, key) == value
        assert 'PDTOPO_DEPLOYMENT_TOKEN="tok123"' in conf.get(sec, "environment")
    assert conf.get("program:prefill_0", "command") == \
        "/py -m pdtopo.runtime.server --run-dir /runs/r1 --process prefill_0"


def test_environment_parses_back_with_supervisor():
    from supervisor.datatypes import dict_of_key_value_pairs

    plan, _, conf = rendered("/runs/r1", "topology=1p1d_v6e8")
    env = dict_of_key_value_pairs(conf.get("program:decode_0", "environment"))
    assert env == {**plan.by_name()["decode_0"].env, "PDTOPO_DEPLOYMENT_TOKEN": "tok123"}


def test_cpu_affinity_wraps_command_with_pin():
    _, _, conf = rendered("/runs/r1", cpus=[2, 3])
    assert conf.get("program:prefill_0", "command").startswith(
        "/py -m pdtopo.launcher.programs.pin 2 -- /py -m pdtopo.runtime.server")
    assert conf.get("program:decode_0", "command").startswith("/py -m pdtopo.launcher.programs.pin 3 --")
    assert "pdtopo.launcher.programs.pin" not in conf.get("program:proxy", "command")


def test_long_run_dir_falls_back_to_short_socket():
    long_dir = "/tmp/" + "x" * 120
    path = socket_path(long_dir)
    assert len(path) <= MAX_SOCKET_PATH and path.startswith("/tmp/pdtopo-")
    assert socket_path(long_dir) == path  # deterministic (pure)
    _, _, conf = rendered(long_dir)
    assert conf.get("supervisorctl", "serverurl") == f"unix://{path}"


def test_percent_survives_supervisord_parsing(tmp_path):
    from supervisor.options import ServerOptions

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    _, text, _ = rendered(str(run), "proxy.api_key=a%b")
    assert "a%%b" in text
    (run / "supervisord.conf").write_text(text)
    opts = ServerOptions()
    opts.realize(args=["-c", str(run / "supervisord.conf")])
    names = [g.name for g in opts.process_group_configs]
    assert sorted(names) == ["bootstrap", "decode_0", "prefill_0", "proxy"]
    proxy = [g for g in opts.process_group_configs if g.name == "proxy"][0]
    assert proxy.process_configs[0].environment["PDTOPO_PROXY_API_KEY"] == "a%b"
    with pytest.raises(ValueError, match="contains '%'"):
        rendered(str(tmp_path / "bad%d"))


def test_router_watch_event_listener_section():
    from pdtopo.launcher.render.supervisord import program_settings

    settings = program_settings(compose_config([]))
    assert settings.router_watch  # PD, one host, rust proxy: on by default
    _, _, conf = rendered("/runs/r1", settings=settings)
    sec = "eventlistener:router_watch"
    assert conf.get(sec, "command") == "/py -m pdtopo.launcher.programs.router_watch /runs/r1"
    assert conf.get(sec, "events") == "PROCESS_STATE"
    # stdout is supervisord's event protocol: the log is stderr's
    assert conf.get(sec, "stderr_logfile") == "/runs/r1/logs/router_watch.log"
    assert conf.get(sec, "stdout_logfile") == "NONE"
    for off in (["launcher.router_watch=false"], ["proxy=mini_lb"],
                ["topology=1p1d_cpu_2host"], ["topology=colocated_cpu"]):
        assert not program_settings(compose_config(off)).router_watch, off
    _, _, conf = rendered("/runs/r1")  # ProgramSettings() default: no listener
    assert not conf.has_section(sec)
