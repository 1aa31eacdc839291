"""The router watch (pdtopo/launcher/programs/router_watch.py) on its own: which supervisord events
count as a dead P/D, and what the watch does with them, against a fake router registry and
fake /health endpoints (the end-to-end use is tests/e2e/test_failover_load.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.admin_http import OperationError
from pdtopo.launcher.plan.expand import Process, expand_plan
from pdtopo.launcher.programs import router_watch
from pdtopo.launcher.programs.router_watch import Watch, dead_program, leader_of, parse_payload


def test_dead_program_events():
    exited = parse_payload("processname:prefill_0 groupname:prefill_0 from_state:RUNNING "
                           "expected:0 pid:4242")
    assert exited["pid"] == "4242"
    assert dead_program("PROCESS_STATE_EXITED", exited) == "prefill_0"
    assert dead_program("PROCESS_STATE_EXITED", {**exited, "expected": "1"}) is None
    for event in ("PROCESS_STATE_BACKOFF", "PROCESS_STATE_FATAL"):
        assert dead_program(event, {"processname": "decode_1"}) == "decode_1"
    for event in ("PROCESS_STATE_STOPPED", "PROCESS_STATE_STOPPING", "PROCESS_STATE_RUNNING",
                  "PROCESS_STATE_STARTING", "TICK_5"):
        assert dead_program(event, exited) is None  # stops by pdtopo/operators: left alone


def test_leader_of_counts_p_d_leaders_only():
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu_mp"]), run_dir="R",
                       python="p", cpus=[0, 1])
    leaders = [p for p in plan.processes if p.role in ("prefill", "decode") and p.leader]
    followers = [p for p in plan.processes if p.role in ("prefill", "decode") and not p.leader]
    assert leaders and followers
    for p in leaders:
        assert leader_of(plan, p.name) is p
    for p in followers:  # its death ends the leader, whose exit is the event that counts
        assert leader_of(plan, p.name) is None
    for name in ("proxy", "bootstrap", "no_such_program"):
        assert leader_of(plan, name) is None


class FakeRouter:
    """The router's worker registry; `fail` makes every call raise like an unreachable
    router."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = set(urls)
        self.calls: list[tuple[str, str]] = []
        self.fail = False
        self.url = "http://router"

    def _check(self) -> None:
        if self.fail:
            raise OperationError("the router does not answer")

    def remove(self, leader: Process) -> None:
        self._check()
        self.calls.append(("remove", leader.name))
        self.urls.discard(leader.url)

    def add(self, leader: Process) -> None:
        self._check()
        self.calls.append(("add", leader.name))
        self.urls.add(leader.url)

    def listed(self, url: str) -> bool:
        self._check()
        return url in self.urls


@pytest.fixture
def setup(tmp_path: Path, monkeypatch):
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=2p2d_cpu"]),
                       run_dir=str(tmp_path), python="p", cpus=[0, 1])
    (tmp_path / "plan.json").write_text(plan.to_json())
    servers = [p for p in plan.processes if p.role in ("prefill", "decode")]
    router = FakeRouter([p.url for p in servers])
    healthy: set[str] = {p.health_url for p in servers}
    monkeypatch.setattr(router_watch, "probe", lambda url, timeout=1.0: url in healthy)
    watch = Watch(tmp_path, router, poll_s=0.01)
    return plan, watch, router, healthy


def exited(name: str) -> dict[str, str]:
    return {"processname": name, "expected": "0", "pid": "1"}


def test_removed_at_once_and_back_once_healthy(setup):
    plan, watch, router, healthy = setup
    p0 = plan.by_name()["prefill_0"]
    healthy.discard(p0.health_url)
    watch.report("PROCESS_STATE_EXITED", exited("prefill_0"))
    watch.report("PROCESS_STATE_STOPPED", exited("decode_0"))  # a stop: ignored
    watch.report("PROCESS_STATE_EXITED", exited("proxy"))      # not a P/D: ignored
    watch.step()
    assert router.calls == [("remove", "prefill_0")] and p0.url not in router.urls
    for _ in range(3):  # still loading: stays out
        watch.step()
    assert router.calls == [("remove", "prefill_0")] and "prefill_0" in watch.waiting
    healthy.add(p0.health_url)
    watch.step()
    assert router.calls == [("remove", "prefill_0"), ("add", "prefill_0")]
    assert p0.url in router.urls and watch.waiting == {}


def test_router_down_is_retried_and_scaled_in_instances_are_dropped(setup, tmp_path):
    plan, watch, router, healthy = setup
    d1 = plan.by_name()["decode_1"]
    router.fail = True
    watch.report("PROCESS_STATE_FATAL", {"processname": "decode_1"})
    watch.step()  # the removal fails: logged; the router's own health checks remain
    assert "decode_1" in watch.waiting
    watch.step()  # healthy again, but adding fails: kept for the next pass
    assert "decode_1" in watch.waiting
    router.fail = False
    watch.step()
    assert watch.waiting == {} and d1.url in router.urls and router.calls == []  # still listed

    watch.report("PROCESS_STATE_EXITED", exited("decode_1"))
    healthy.discard(d1.health_url)
    watch.step()
    assert "decode_1" in watch.waiting
    shrunk = json.loads((tmp_path / "plan.json").read_text())
    shrunk["processes"] = [p for p in shrunk["processes"] if p["name"] != "decode_1"]
    (tmp_path / "plan.json").write_text(json.dumps(shrunk))  # `pdtopo scale decode=1`
    watch.step()
    assert watch.waiting == {} and ("add", "decode_1") not in router.calls


def test_unreadable_plan_is_logged_not_fatal(setup, tmp_path, caplog):
    _, watch, router, _ = setup
    (tmp_path / "plan.json").write_text("{not json")
    watch.report("PROCESS_STATE_EXITED", exited("prefill_0"))
    watch.step()
    assert router.calls == [] and "cannot read plan.json" in caplog.text
