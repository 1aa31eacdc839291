"""The live planner over real processes (tiny model, 1P1D on cpu-3: a budget of 3 instances,
the Rust router, supervisord, `pdtopo scale` doing every change), with a client sending
requests through the router throughout.

What is real: the load (prompt-heavy: 300-token prompts, 2 output tokens; decode-heavy: 8-token
prompts, 64 output tokens; then a trickle), the planner's scrapes of every instance's
/metrics, its decisions, and every change it makes (health-gated scale out, drain-then-stop
scale in, the role change as one `pdtopo scale`). What is fixed: the per-instance capacity,
a planner profile (planner.capacity.source=profile) of 540 prompt tok/s per P and 225 output
tok/s per D, far below what the 2 shared cores serve, so the measured loads sit clearly over
or under it (measured here: ~2,100 prompt tok/s in the prompt phase, ~1,000 output tok/s in
the decode phase, a few tens in the trickle); the live-capacity path is unit-tested.

act: prompt-heavy -> scale_out(prefill) decided within two intervals, 2P1D; decode-heavy ->
role_change(prefill->decode), the new D on the chip the P left, 1P2D; trickle -> scale_in
(decode), 1P1D; a `pdtopo scale prefill=2` by hand pauses the planner (logged, not acted),
`pdtopo planner resume` lets it scale back in; zero failed requests; status, top and
`pdtopo planner status` show it. recommend: decisions logged, nothing changes; the planner
killed (-9) is restarted by supervisord while requests keep succeeding."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdtopo.bench.closed_loop import PhasedLoad
from pdtopo.launcher.operate import planner_files as files
from pdtopo.launcher.operate.supervisor_control import Supervisor
from tests.support.constants import TWO_LAYERS
from tests.support.e2e import (
    Deployment,
    deployment_overrides,
    port_block,
    run_pdtopo,
    said,
)

pytestmark = pytest.mark.slow

INTERVAL = 3.0
PROFILE = {"prefill_tps": 600, "decode_tps": [[1, 250]], "max_batch": 8}  # 540 / 225 counted
CHANGE_TIMEOUT_S = 180.0


def planner_overrides(profile: Path, mode: str) -> list[str]:
    return ["planner.enabled=true", f"planner.mode={mode}", f"planner.interval_s={INTERVAL}",
            "planner.slo.ttft_ms=null", "planner.slo.itl_ms=null",
            "planner.hysteresis.min_change_interval_s=3", "planner.hysteresis.margin=0.1",
            "planner.hysteresis.backoff_s=10", "planner.capacity.source=profile",
            f"planner.capacity.profile={profile}"]


def launch(tmp_path_factory, mode: str) -> Deployment:
    root = tmp_path_factory.mktemp(f"planner_{mode}")
    profile = root / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    block = port_block(48)
    return Deployment(root / "run", [*TWO_LAYERS, "topology.accelerator=cpu-3",
                                     *deployment_overrides(block, instances=8),
                                     *planner_overrides(profile, mode)]).launch()


def wait_record(dep: Deployment, pred: Callable[[dict], bool], timeout: float, what: str,
                after: int = 0) -> dict:
    """The first planner.log record past line `after` that `pred` accepts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in files.read_lines(dep.run_dir)[after:]:
            if pred(rec):
                return rec
        time.sleep(0.5)
    tail = "\n".join(json.dumps({k: r.get(k) for k in ("event", "label", "acted", "not_acted",
                                                         "reason", "ok")})
                     for r in files.read_lines(dep.run_dir, last=15))
    raise AssertionError(f"no planner record {what} within {timeout:.0f} s; last ones:\n{tail}"
                         f"\n{dep.log_tails(15)}")


def decided(label: str, acted: bool | None = True) -> Callable[[dict], bool]:
    return lambda r: r.get("event") == "decision" and r.get("label") == label and \
        (acted is None or r.get("acted") is acted)


def outcome(label: str) -> Callable[[dict], bool]:
    return lambda r: r.get("event") == "outcome" and r.get("label") == label


def lines(dep: Deployment) -> int:
    return len(files.read_lines(dep.run_dir))


def shape(dep: Deployment) -> list[tuple[str, list[int]]]:
    dep.plan = json.loads((dep.run_dir / "plan.json").read_text())
    return [(p["name"], p["chips"]) for p in dep.plan["processes"]
            if p["role"] in ("prefill", "decode")]


def router_urls(dep: Deployment) -> list[tuple[str, str]]:
    body = httpx.get(f"{dep.proxy_url}/workers", timeout=10).json()
    return sorted((w["worker_type"], w["url"]) for w in body["workers"])


def planned_urls(dep: Deployment) -> list[tuple[str, str]]:
    return sorted((p["role"], f"http://{p['address']}:{p['ports']['http']}")
                  for p in dep.plan["processes"] if p["role"] in ("prefill", "decode"))


def test_planner_acts_on_phases_without_losing_a_request(tmp_path_factory):
    dep = launch(tmp_path_factory, "act")
    run = dep.run_dir
    t_start = time.monotonic()
    try:
        assert shape(dep) == [("prefill_0", [0]), ("decode_0", [1])]
        assert "planner" in Supervisor(run).states()
        wait_record(dep, lambda r: r.get("event") == "start", 30, "start")
        with PhasedLoad(dep.proxy_url) as load:
            mark, t_load = lines(dep), time.time()
            rec = wait_record(dep, decided("scale_out(prefill)"), 4 * INTERVAL + 10,
                              "scale_out(prefill)", mark)
            took = rec["at"] - t_load
            assert took <= 2 * INTERVAL + 1.5, f"decided {took:.1f} s after the load began"
            assert rec["capacity_source"] == "prefill=profile decode=profile"
            assert rec["observation"]["instances"] and rec["load"]["prompt_tps"] > 540
            done = wait_record(dep, outcome("scale_out(prefill)"), CHANGE_TIMEOUT_S,
                               "scale_out done", mark)
            assert done["ok"], done
            assert shape(dep) == [("prefill_0", [0]), ("prefill_1", [2]), ("decode_0", [1])]
            assert router_urls(dep) == planned_urls(dep)
            p1_chips = dep.process("prefill_1")["chips"]
            print(f"scale_out: decided {took:.1f} s after the load began (prompt "
                  f"{rec['load']['prompt_tps']:.0f} tok/s, needed {rec['needed']}), done in "
                  f"{done['took_s']} s")

            load.phase, mark = "decode", lines(dep)
            rec = wait_record(dep, decided("role_change(prefill->decode)"), 6 * INTERVAL + 10,
                              "role_change(prefill->decode)", mark)
            assert "budget is 3" in rec["reason"], rec["reason"]
            done = wait_record(dep, outcome("role_change(prefill->decode)"), CHANGE_TIMEOUT_S,
                               "role change done", mark)
            assert done["ok"], done
            assert shape(dep) == [("prefill_0", [0]), ("decode_0", [1]), ("decode_1", p1_chips)]
            assert router_urls(dep) == planned_urls(dep)
            print(f"role_change: decided {rec['at'] - t_load:.1f} s in (output "
                  f"{rec['load']['decode_tps']:.0f} tok/s, needed {rec['needed']}), done in "
                  f"{done['took_s']} s")

            load.phase, mark = "trickle", lines(dep)
            rec = wait_record(dep, decided("scale_in(decode)"), 12 * INTERVAL + 10,
                              "scale_in(decode)", mark)
            done = wait_record(dep, outcome("scale_in(decode)"), CHANGE_TIMEOUT_S,
                               "scale_in done", mark)
            assert done["ok"], done
            assert shape(dep) == [("prefill_0", [0]), ("decode_0", [1])]
            print(f"scale_in: done in {done['took_s']} s")

            status = run_pdtopo(["status", str(run)], timeout=60)
            assert status.returncode == 0, status.stdout + status.stderr
            assert "planner (act, every 3 s): 1P1D" in said(status)
            assert "last change scale_in(decode) done" in said(status)
            top = run_pdtopo(["top", str(run), "--once", "--interval", "1"], timeout=60)
            assert "planner (act" in said(top), top.stdout

            # a scale by hand pauses the planner; it decides on, acts after resume
            mark = lines(dep)
            out = run_pdtopo(["scale", "prefill=2", str(run)], timeout=300)
            assert out.returncode == 0, out.stdout + out.stderr
            assert "planner is paused" in said(out)
            assert files.paused(run).startswith("`pdtopo scale prefill=2` by hand")
            rec = wait_record(dep, decided("scale_in(prefill)", acted=False), 8 * INTERVAL,
                              "a paused scale_in(prefill)", mark)
            assert rec["not_acted"].startswith("paused: `pdtopo scale prefill=2` by hand")
            st = run_pdtopo(["planner", "status", str(run)], timeout=60)
            assert st.returncode == 0 and "PAUSED" in said(st), st.stdout + st.stderr
            res = run_pdtopo(["planner", "resume", str(run)], timeout=60)
            assert res.returncode == 0 and "was paused" in said(res), res.stdout
            mark = lines(dep)
            wait_record(dep, decided("scale_in(prefill)"), 6 * INTERVAL + 10,
                        "scale_in(prefill) after resume", mark)
            done = wait_record(dep, outcome("scale_in(prefill)"), CHANGE_TIMEOUT_S,
                               "scale_in(prefill) done", mark)
            assert done["ok"] and shape(dep) == [("prefill_0", [0]), ("decode_0", [1])]
            time.sleep(1)
        assert load.failures == [], load.failures[:5]
        assert load.ok > 50, load.ok
        print(f"client: {load.ok} requests answered, 0 failed, over "
              f"{time.monotonic() - t_start:.0f} s")

        metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(
                       (run / files.METRICS_FILE).read_text()) for s in f.samples}
        for action, least in (("scale_out", 1), ("role_change", 1), ("scale_in", 2)):
            assert metrics[("pdtopo:planner_decisions_total", (("action", action),))] >= least
        assert metrics[("pdtopo:planner_changes_total", (("outcome", "ok"),))] == 4
        assert metrics[("pdtopo:planner_changes_total", (("outcome", "failed"),))] == 0
        assert metrics[("pdtopo:planner_current_instances", (("role", "decode"),))] == 1
    finally:
        dep.stop_and_check()


def test_recommend_changes_nothing_and_a_killed_planner_is_restarted(tmp_path_factory):
    dep = launch(tmp_path_factory, "recommend")
    run = dep.run_dir
    try:
        plan_before = (run / "plan.json").read_text()
        sv = Supervisor(run)
        pids = {name: pid for name, (_state, pid) in sv.states().items()}
        wait_record(dep, lambda r: r.get("event") == "start", 30, "start")
        with PhasedLoad(dep.proxy_url) as load:
            mark = lines(dep)
            for _ in range(2):
                rec = wait_record(dep, decided("scale_out(prefill)", acted=False),
                                  4 * INTERVAL + 10, "a recommended scale_out", mark)
                assert rec["mode"] == "recommend" and rec["act"] is False
                mark = files.read_lines(run).index(rec) + 1
            mark = lines(dep)
            os.kill(pids["planner"], signal.SIGKILL)
            t_kill = time.monotonic()
            deadline = t_kill + 30
            while time.monotonic() < deadline:
                state, pid = sv.states()["planner"]
                if state == "RUNNING" and pid != pids["planner"]:
                    break
                time.sleep(0.2)
            assert (state, pid != pids["planner"]) == ("RUNNING", True)
            wait_record(dep, lambda r: r.get("event") == "start", 30, "a restart", mark)
            wait_record(dep, decided("scale_out(prefill)", acted=False), 4 * INTERVAL + 10,
                        "a decision after the restart", mark)
            print(f"planner killed, back and deciding {time.monotonic() - t_kill:.1f} s later")
        assert load.failures == [], load.failures[:5]
        assert load.ok > 10
        assert (run / "plan.json").read_text() == plan_before
        assert not (run / "logs" / "planner_scale.log").exists()
        after = {name: pid for name, (_state, pid) in sv.states().items()}
        assert {n: p for n, p in after.items() if n != "planner"} == \
            {n: p for n, p in pids.items() if n != "planner"}
        status = run_pdtopo(["status", str(run)], timeout=60)
        assert "planner (recommend, every 3 s): 1P1D" in said(status), status.stdout
        assert "scale_out(prefill) -> 2P1D" in said(status)
    finally:
        dep.stop_and_check()
