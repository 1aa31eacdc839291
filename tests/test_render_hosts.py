"""Golden per-host supervisord configs of a multi-host render (`pdtopo render` writes
RUN/hosts/NAME/supervisord.conf per host). Regenerate the golden files with
PDTOPO_REGEN_GOLDEN=1 python -m pytest tests/test_render_hosts.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from pdtopo.cli import main
from pdtopo.launcher.render_supervisord import socket_path

GOLDEN = Path(__file__).resolve().parent / "golden" / "hosts"
REGEN = os.environ.get("PDTOPO_REGEN_GOLDEN") == "1"


def _neutral(text: str, run: Path, hdir: Path) -> str:
    """Machine-independent text: run dir, socket, interpreter, token and CPU cores neutral."""
    out = text.replace(socket_path(hdir), "SOCKET")
    out = re.sub(r"pdtopo\.launcher\.pin [0-9,]+ --", "pdtopo.launcher.pin CORES --", out)
    out = out.replace(str(run), "RUN").replace(os.getcwd(), "WORKDIR")
    token = (run / "token").read_text().strip()
    return out.replace(token, "TOKEN").replace(os.sys.executable, "PYTHON")


@pytest.mark.parametrize("topology,hosts", [
    ("1p1d_v6e16", ["tpu-0", "tpu-1", "tpu-2", "tpu-3"]),
    ("1p1d_cpu_2host", ["host-a", "host-b"]),
])
def test_per_host_supervisord_golden(tmp_path, topology, hosts):
    run = tmp_path / "run"
    assert main(["render", f"topology={topology}", "server.bind_host=null",
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
