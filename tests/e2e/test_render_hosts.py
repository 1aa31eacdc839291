"""Golden per-host supervisord configs of a multi-host render (`pdtopo render` writes
RUN/hosts/NAME/supervisord.conf per host). Regenerate the golden files with
PDTOPO_REGEN_GOLDEN=1 python -m pytest tests/e2e/test_render_hosts.py."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from pdtopo.cli import main
from pdtopo.launcher.render.supervisord import socket_path
from tests.support.constants import GOLDEN_DIR
from tests.support.golden import neutral_text

GOLDEN = GOLDEN_DIR / "hosts"
REGEN = os.environ.get("PDTOPO_REGEN_GOLDEN") == "1"


def _neutral(text: str, run: Path, hdir: Path, *, workdir: str | None = None,
             python: str | None = None) -> str:
    """Machine-independent text: run dir, socket, working directory, interpreter, token and
    CPU cores neutral (`workdir` / `python`: the cwd and sys.executable by default)."""
    out = neutral_text(text, {
        socket_path(hdir): "SOCKET",
        str(run): "RUN",
        workdir if workdir is not None else os.getcwd(): "WORKDIR",
        python if python is not None else sys.executable: "PYTHON",
        (run / "token").read_text().strip(): "TOKEN",
    })
    return re.sub(r"pdtopo\.launcher\.programs\.pin [0-9,]+ --", "pdtopo.launcher.programs.pin CORES --", out)


# Interpreter layouts relative to the working directory "nc": wherever the venv is, the
# goldens say WORKDIR and PYTHON (a plain replace of the cwd first would leave
# WORKDIR/.venv/bin/python or WORKDIR-venv/bin/python).
VENVS = {"venv-inside-checkout": "nc/.venv/bin/python",
         "venv-beside-checkout": "nc-venv/bin/python"}


@pytest.mark.parametrize("python", VENVS.values(), ids=VENVS.keys())
def test_neutral_text_whole_paths_longest_first(python):
    run, workdir, py = "/x/run", "/x/nc", f"/x/{python}"
    text = (f"directory={workdir}\n"
            f"command={py} -m pdtopo.launcher.programs.pin 0,1 -- {py} -m pdtopo.runtime.server "
            f"--run-dir {run}/hosts/h --process p\n"
            f'environment=PDTOPO_DEPLOYMENT_TOKEN="tok"\n'
            f"serverurl=unix://{run}/hosts/h/supervisor.sock\n"
            f"kept={workdir}-other/x /y{workdir} {run}2\n")
    got = neutral_text(text, {f"{run}/hosts/h/supervisor.sock": "SOCKET", run: "RUN",
                              workdir: "WORKDIR", py: "PYTHON", "tok": "TOKEN"})
    assert got == ("directory=WORKDIR\n"
                   "command=PYTHON -m pdtopo.launcher.programs.pin 0,1 -- PYTHON -m pdtopo.runtime.server "
                   "--run-dir RUN/hosts/h --process p\n"
                   'environment=PDTOPO_DEPLOYMENT_TOKEN="TOKEN"\n'
                   "serverurl=unix://SOCKET\n"
                   f"kept={workdir}-other/x /y{workdir} {run}2\n")
    assert neutral_text(text, {}) == text


@pytest.mark.parametrize("python", VENVS.values(), ids=VENVS.keys())
def test_golden_independent_of_venv_location(tmp_path, monkeypatch, python):
    """The real render with the checkout at tmp/nc and the interpreter inside it or beside it
    matches the same golden."""
    (tmp_path / "nc").mkdir()
    monkeypatch.chdir(tmp_path / "nc")
    monkeypatch.setattr(sys, "executable", str(tmp_path / python))
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", "topology=1p1d_cpu_2host", "server.bind_host=null",
                 "launcher.compilation_cache_dir=null", f"hydra.run.dir={run}"]) == 0
    for host in ("host-a", "host-b"):
        hdir = run / "hosts" / host
        raw = (hdir / "supervisord.conf").read_text()
        assert f"{tmp_path / python} -m pdtopo.runtime" in raw  # the layout under test
        conf = _neutral(raw, run, hdir)
        assert "WORKDIR/" not in conf and "WORKDIR-" not in conf
        assert conf == (GOLDEN / "1p1d_cpu_2host" / f"{host}.conf").read_text()


@pytest.mark.parametrize("topology,hosts", [
    ("1p1d_v6e16", ["tpu-0", "tpu-1", "tpu-2", "tpu-3"]),
    ("1p1d_cpu_2host", ["host-a", "host-b"]),
])
def test_per_host_supervisord_golden(tmp_path, topology, hosts):
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", f"topology={topology}", "server.bind_host=null",
                 "launcher.compilation_cache_dir=null", f"hydra.run.dir={run}"]) == 0
    assert sorted(p.name for p in (run / "hosts").iterdir()) == sorted(hosts)
    assert not (run / "supervisord.conf").exists()  # no all-hosts supervisord
    plan = json.loads((run / "plan.json").read_text())
    for host in hosts:
        hdir = run / "hosts" / host
        conf = _neutral((hdir / "supervisord.conf").read_text(), run, hdir)
        programs = [line[9:-1] for line in conf.splitlines() if line.startswith("[program:")]
        assert programs == [p["name"] for p in plan["processes"] if p["host"] == host]
        assert (hdir / "token").read_text() == (run / "token").read_text()
        golden = GOLDEN / topology / f"{host}.conf"
        if REGEN:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(conf)
        assert conf == golden.read_text(), f"{golden} differs (PDTOPO_REGEN_GOLDEN=1 to update)"


def test_launch_refuses_unknown_or_idle_host(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["launch", "--detach", "topology=1p1d_cpu_2host", "server.bind_host=null",
                 "+host=host-z", f"hydra.run.dir={run}"]) == 2
    assert "host" in capsys.readouterr().err and not (run / "hosts").exists()
    # auto-detection: 10.200.0.x is not bound on this machine (outside the netns test)
    assert main(["launch", "--detach", "topology=1p1d_cpu_2host", "server.bind_host=null",
                 f"hydra.run.dir={run}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "+host=NAME" in err and "host-a (10.200.0.1)" in err
