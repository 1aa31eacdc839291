"""`pdtopo diff`: semantic plan diff, supervisord.conf diff, exit status like diff(1)."""

from __future__ import annotations

import subprocess

from pdtopo.cli import main
from pdtopo.config.compose import compose_config
from pdtopo.launcher.render.diff import diff_configs, to_markdown
from tests.support.constants import REPO_ROOT


def test_v6e8_vs_2p2d_semantic_diff():
    res = diff_configs(compose_config(["model=tiny_llama", "topology=1p1d_v6e8"]),
                       compose_config(["model=tiny_llama", "topology=2p2d"]), cpus=[0, 1])
    assert res.added == ["prefill_1", "decode_1"] and res.removed == []
    p0 = dict((k, (a, b)) for k, a, b in res.processes["prefill_0"])
    assert p0["chips"] == ([0, 1, 2, 3], [0, 1])
    assert p0["env.TPU_CHIPS_PER_PROCESS_BOUNDS"] == ("1,4,1", "1,2,1")
    assert p0["env.TPU_VISIBLE_CHIPS"] == ("0,1,2,3", "0,1")
    d0 = dict((k, (a, b)) for k, a, b in res.processes["decode_0"])
    assert d0["ports.http"] == (30001, 30002) and d0["ports.zmq"] == (32001, 32002)
    assert d0["env.TPU_PROCESS_PORT"] == ("8477", "8478")
    assert "command" in dict((k, 1) for k, _, _ in res.processes["proxy"])
    keys = {k for k, _, _ in res.config}
    assert {"topology.name", "topology.prefill.instances", "topology.decode.mesh.tp"} <= keys
    assert any(line.startswith("+[program:prefill_1]") for line in res.conf_diff)
    assert not any("/tmp" in line or "outputs/" in line for line in res.conf_diff)
    md = to_markdown(res)
    assert "- added: `prefill_1`" in md and "```diff" in md


def test_cli_diff_exit_codes(capsys):
    assert main(["diff", "topology=1p1d_v6e8", "--", "topology=2p2d"]) == 1
    out = capsys.readouterr().out
    assert "+prefill_1" in out and "1,4,1" in out and "supervisord.conf" in out
    assert main(["diff", "topology=2p2d", "--", "topology=2p2d"]) == 0
    assert "no differences" in capsys.readouterr().out
    assert main(["diff", "--format", "markdown", "engine.page_size=32", "--"]) == 1
    out = capsys.readouterr().out
    assert "| `engine.page_size` | `32` | `16` |" in out
    assert main(["diff", "topology=nope", "--", "topology=2p2d"]) == 2
    assert main(["diff", "topology.mode=bad", "--", "topology=2p2d"]) == 2
    assert "topology.mode" in capsys.readouterr().err


def test_diff_against_git_revision(capsys):
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    code = main(["diff", "--rev", head, "--format", "markdown", "topology=2p2d"])
    out = capsys.readouterr().out
    # identical unless conf/ has uncommitted edits in the working tree
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "conf"],
                           capture_output=True, text=True).stdout.strip()
    assert code == (1 if dirty else 0), out
    assert main(["diff", "--rev", "no-such-rev-xyz", "topology=2p2d"]) == 2
    assert "no-such-rev-xyz" in capsys.readouterr().err


def test_diff_rev_sees_old_conf(tmp_path, capsys):
    """A revision whose conf/ differs: the change shows up as config + process changes."""
    from pdtopo.launcher.render.diff import conf_at_rev

    first = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-list", "--max-parents=0", "HEAD"],
                           capture_output=True, text=True, check=True).stdout.split()[0]
    old = conf_at_rev(first, REPO_ROOT / "conf", tmp_path)
    assert (old / "config.yaml").is_file() and (old / "topology" / "1p1d_cpu.yaml").is_file()
    assert not (old / "topology" / "2p2d.yaml").exists()
