"""What `pdtopo drain` / `pdtopo restart` accept before they touch anything: targets resolve to
instance leaders (a role: all of them, in order; a follower: its whole instance), and runs they
cannot operate on are refused naming the reason. Fast: `pdtopo render` run dirs, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdtopo.cli import main
from pdtopo.launcher import rolling


def rendered(tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    assert main(["render", f"hydra.run.dir={run}", *overrides]) == 0
    return run


def test_targets_of_a_2p2d_run(tmp_path):
    dep = rolling.Deployment.load(rendered(tmp_path, "topology=2p2d_cpu"))
    assert [p.name for p in dep.targets("prefill")] == ["prefill_0", "prefill_1"]
    assert [p.name for p in dep.targets("decode_1")] == ["decode_1"]
    assert dep.proxy_url == "http://127.0.0.1:8000"
    with pytest.raises(rolling.OperationError, match="'bootstrap' is not a prefill/decode"):
        dep.targets("bootstrap")
    with pytest.raises(rolling.OperationError, match="roles: prefill, decode"):
        dep.targets("prefill_9")


def test_a_follower_names_its_instance(tmp_path):
    dep = rolling.Deployment.load(rendered(tmp_path, "topology=1p1d_cpu_mp"))
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
    with pytest.raises(rolling.OperationError, match=reason):
        rolling.Deployment.load(rendered(tmp_path, *overrides))


def test_cli_reports_a_refusal(tmp_path, capsys):
    run = rendered(tmp_path, "topology=colocated_cpu")
    capsys.readouterr()
    assert main(["restart", "colocated_0", str(run)]) == 1
    assert "works on PD deployments" in " ".join(capsys.readouterr().out.split())
