"""`pdtopo scale`'s failure paths with fakes for supervisord and the router (the e2e test covers
the working path): a roll back after a new program crashed runs every step and restores the
run dir even when supervisord refuses a step; a drained instance whose removal fails is put
back in service."""

from __future__ import annotations

import xmlrpc.client
from types import SimpleNamespace

import pytest

from pdtopo.launcher.operate.admin_http import OperationError
from pdtopo.launcher.operate.scale import RunFiles, Scaler


class FakeSupervisor:
    def __init__(self, states: dict[str, str]) -> None:
        self.st = dict(states)
        self.calls: list[tuple] = []

    def states(self) -> dict[str, tuple[str, int]]:
        return {n: (s, 1) for n, s in self.st.items()}

    def call(self, method: str, *args):
        self.calls.append((method, *args))
        if method == "supervisor.stopProcess" and self.st.get(args[0]) not in ("RUNNING",):
            raise xmlrpc.client.Fault(70, "NOT_RUNNING")
        if method == "supervisor.removeProcessGroup":
            if args[0] == "prefill_3":
                raise xmlrpc.client.Fault(91, "STILL_RUNNING")
            self.st.pop(args[0], None)
        if method == "supervisor.reloadConfig":
            return [[[], [], []]]
        return True


class FakeRouter:
    def __init__(self, listed: set[str], fail_remove: bool = False) -> None:
        self.urls = set(listed)
        self.fail_remove = fail_remove
        self.added: list[str] = []

    def listed(self, url: str) -> bool:
        return url in self.urls

    def answers_listed(self, url: str, listed: bool) -> bool:
        return (url in self.urls) is listed

    def remove(self, leader) -> None:
        if self.fail_remove:
            raise OperationError("DELETE /workers/x: HTTP 500")
        self.urls.discard(leader.url)

    def add(self, leader) -> None:
        self.added.append(leader.url)
        self.urls.add(leader.url)


def _leader(name: str, port: int):
    return SimpleNamespace(name=name, role="prefill", url=f"http://127.0.0.1:{port}")


def _scaler(tmp_path, sv, router, drain_left: int = 0):
    said: list[str] = []
    s = Scaler.__new__(Scaler)
    s.dep = SimpleNamespace(run_dir=tmp_path, router=router,
                            launcher=SimpleNamespace(drain_timeout_s=1.0))
    s.say = said.append
    undone: list[str] = []
    s.op = SimpleNamespace(drain=lambda leader: drain_left,
                           set_draining=lambda leader, value: undone.append((leader.name, value)),
                           readmit=lambda leader: undone.append((leader.name, "readmit")))
    s.sv = sv
    return s, said, undone


def test_roll_back_runs_every_step_and_restores_the_files(tmp_path):
    (tmp_path / "plan.json").write_text("new shape")
    sv = FakeSupervisor({"prefill_2": "FATAL", "prefill_3": "RUNNING", "decode_0": "RUNNING"})
    router = FakeRouter({"http://127.0.0.1:9002"})
    s, said, _ = _scaler(tmp_path, sv, router)
    old = RunFiles({"plan.json": "old shape", "config.yaml": "old config"})
    s.roll_back([_leader("prefill_2", 9002), _leader("prefill_3", 9003)], old)
    assert (tmp_path / "plan.json").read_text() == "old shape"  # restored despite a failure
    assert (tmp_path / "config.yaml").read_text() == "old config"
    assert ("supervisor.stopProcess", "prefill_2", True) not in sv.calls  # FATAL: not stopped
    assert ("supervisor.removeProcessGroup", "prefill_2") in sv.calls
    assert ("supervisor.stopProcess", "prefill_3", True) in sv.calls
    assert "prefill_2" not in sv.st and "decode_0" in sv.st
    assert not router.urls  # its queued addition was removed again
    assert any("STILL_RUNNING" in line for line in said)  # the refused step is reported
    assert sv.calls[-1] == ("supervisor.reloadConfig",)


def test_failed_removal_puts_the_instance_back(tmp_path):
    sv = FakeSupervisor({"prefill_1": "RUNNING"})
    router = FakeRouter({"http://127.0.0.1:9001"}, fail_remove=True)
    s, _said, undone = _scaler(tmp_path, sv, router)
    with pytest.raises(OperationError, match="HTTP 500"):
        s.remove(_leader("prefill_1", 9001))
    assert undone == [("prefill_1", False), ("prefill_1", "readmit")]
    assert sv.st == {"prefill_1": "RUNNING"}  # never stopped


def test_drain_timeout_keeps_the_instance(tmp_path):
    sv = FakeSupervisor({"prefill_1": "RUNNING"})
    router = FakeRouter({"http://127.0.0.1:9001"})
    s, _said, undone = _scaler(tmp_path, sv, router, drain_left=3)
    with pytest.raises(OperationError, match="3 requests still in flight"):
        s.remove(_leader("prefill_1", 9001))
    assert undone == [("prefill_1", False), ("prefill_1", "readmit")]
    assert router.urls == {"http://127.0.0.1:9001"} and sv.st == {"prefill_1": "RUNNING"}


def test_scale_in_refused_when_no_instance_that_stays_serves(tmp_path):
    sv = FakeSupervisor({"prefill_0": "RUNNING", "prefill_1": "RUNNING"})
    s, _said, _undone = _scaler(tmp_path, sv, FakeRouter(set()))
    kept, gone = _leader("prefill_0", 9000), _leader("prefill_1", 9001)
    plan = SimpleNamespace(processes=[SimpleNamespace(**vars(kept), leader=True,
                                                      instance_id="prefill_0")])
    s.op._serving = lambda p: False  # prefill_0 was drained by hand
    with pytest.raises(OperationError, match="no prefill instance that stays"):
        s.check_kept_serve(plan, [gone])
    s.op._serving = lambda p: p.name == "prefill_0"
    s.check_kept_serve(plan, [gone])  # serving: allowed
