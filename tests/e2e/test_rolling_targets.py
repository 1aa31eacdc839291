"""What `pdtopo drain` / `pdtopo restart` accept before they touch anything: targets resolve to
instance leaders (a role: all of them, in order; a follower: its whole instance), and runs they
cannot operate on are refused naming the reason. Fast: `pdtopo render` run dirs, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdtopo.cli import main
from pdtopo.launcher.operate.admin_http import OperationError
from pdtopo.launcher.operate.deployment import Deployment


def rendered(tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", f"hydra.run.dir={run}", *overrides]) == 0
    return run


def test_targets_of_a_2p2d_run(tmp_path):
    dep = Deployment.load(rendered(tmp_path, "topology=2p2d_cpu"))
    assert [p.name for p in dep.targets("prefill")] == ["prefill_0", "prefill_1"]
    assert [p.name for p in dep.targets("decode_1")] == ["decode_1"]
    assert dep.proxy_url == "http://127.0.0.1:8000"
    with pytest.raises(OperationError, match="'bootstrap' is not a prefill/decode"):
        dep.targets("bootstrap")
    with pytest.raises(OperationError, match="roles: prefill, decode"):
        dep.targets("prefill_9")


def test_a_follower_names_its_instance(tmp_path):
    dep = Deployment.load(rendered(tmp_path, "topology=1p1d_cpu_mp"))
    followers = [p for p in dep.plan.processes if p.role == "prefill" and not p.leader]
    assert followers, "1p1d_cpu_mp has multi-process instances"
    (leader,) = dep.targets(followers[0].name)
    assert leader.leader and leader.instance_id == followers[0].instance_id
    assert {p.name for p in dep.instance(leader)} >= {leader.name, followers[0].name}


@pytest.mark.parametrize("overrides,reason", [
    (["topology=colocated_cpu"], "works on PD deployments"),
    (["proxy=mini_lb"], "MiniLB has a fixed worker list and no health checks"),
])
def test_runs_it_refuses(tmp_path, overrides, reason):
    with pytest.raises(OperationError, match=reason):
        Deployment.load(rendered(tmp_path, *overrides))


def test_cli_reports_a_refusal(tmp_path, capsys):
    run = rendered(tmp_path, "topology=colocated_cpu")
    capsys.readouterr()
    assert main(["restart", "colocated_0", str(run)]) == 1
    assert "works on PD deployments" in " ".join(capsys.readouterr().out.split())


def _as_launched_before_the_move(run: Path) -> None:
    """What an earlier pdtopo wrote: the programs at their old `pdtopo.launcher.*` paths."""
    conf = run / "supervisord.conf"
    text = conf.read_text()
    assert "pdtopo.launcher.programs.pin" in text
    conf.write_text(text.replace("pdtopo.launcher.programs.", "pdtopo.launcher."))


@pytest.mark.parametrize("verb,args,code", [("restart", ["prefill_0"], 1),
                                            ("scale", ["prefill=2"], 2)])
def test_verbs_that_start_programs_refuse_a_run_from_before_the_move(tmp_path, capsys, verb,
                                                                      args, code):
    run = rendered(tmp_path)
    _as_launched_before_the_move(run)
    capsys.readouterr()
    assert main([verb, *args, str(run)]) == code  # scale: 2, a request it refuses
    out = capsys.readouterr()
    said = " ".join((out.out + out.err).split())
    assert "launched by an earlier pdtopo" in said
    assert "pdtopo.launcher.pin" in said and f"stop it (pdtopo stop {run})" in said


def test_drain_and_status_still_read_a_run_from_before_the_move(tmp_path, capsys):
    run = rendered(tmp_path)
    _as_launched_before_the_move(run)
    assert Deployment.load(run, "drain").targets("prefill")[0].name == "prefill_0"
    capsys.readouterr()
    assert main(["status", str(run)]) == 3  # nothing runs: said, not a crash
    assert "not running" in " ".join(capsys.readouterr().out.split())
