"""`pdtopo scale` over real processes: 2P2D on cpu-6 (two chips free), the Rust router, a
steady load. `scale prefill=3` starts prefill_2 on the free chip and the next unused ports, the
router takes it and it serves; `scale prefill=1` drains and removes prefill_2 and prefill_1.
No request fails, the router ends with exactly the planned workers, the run dir (config.yaml,
plan.json, supervisord) says what runs, `pdtopo status` shows it and `pdtopo stop` leaves
nothing. A request the free chips cannot hold is refused and changes nothing."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from omegaconf import OmegaConf

from pdtopo.launcher.operate.supervisor_control import Supervisor
from pdtopo.launcher.plan.expand import expand_plan
from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
    Deployment,
    SteadyLoad,
    deployment_overrides,
    generate,
    port_block,
    run_pdtopo,
    said,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

GREEDY = greedy(6)
PROMPT = "Scaling out and in: what stays the same?"


def router_workers(proxy_url: str) -> list[tuple[str, str, bool]]:
    body = httpx.get(f"{proxy_url}/workers", timeout=10).json()
    return sorted((w["worker_type"], w["url"], w["is_healthy"]) for w in body["workers"])


def planned_workers(plan: dict) -> list[tuple[str, str, bool]]:
    return sorted((p["role"], f"http://{p['address']}:{p['ports']['http']}", True)
                  for p in plan["processes"] if p["role"] in ("prefill", "decode"))


def computed_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^pdtopo:prompt_tokens_computed_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def reload(dep: Deployment) -> dict:
    dep.plan = json.loads((dep.run_dir / "plan.json").read_text())
    return dep.plan


def test_scale_out_then_in_under_load(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("scale") / "run"
    dep = Deployment(run_dir, [*TWO_LAYERS, "topology=2p2d_cpu", "topology.accelerator=cpu-6",
                               *deployment_overrides(port_block(40))]).launch()
    try:
        sv = Supervisor(run_dir)
        before = {name: pid for name, (_state, pid) in sv.states().items()}
        expected = generate(dep.proxy_url, {"text": PROMPT, "sampling_params": GREEDY})
        plan_before = (run_dir / "plan.json").read_text()
        # the launcher told the router of each server once healthy, and the router's own
        # registration of the same URLs later was refused as a duplicate: each listed once
        assert router_workers(dep.proxy_url) == planned_workers(json.loads(plan_before))

        too_many = run_pdtopo(["scale", "prefill=5", str(run_dir)], timeout=60)
        assert too_many.returncode == 2, too_many.stdout + too_many.stderr
        assert "topology.prefill.instances" in too_many.stderr
        assert "bigger topology.accelerator" in " ".join(too_many.stderr.split())
        bad = run_pdtopo(["scale", "prefill=0", str(run_dir)], timeout=60)
        assert bad.returncode == 2 and "at least one instance" in " ".join(bad.stderr.split())
        assert (run_dir / "plan.json").read_text() == plan_before  # refused: nothing changed

        with SteadyLoad(dep.proxy_url) as load:
            time.sleep(2)
            out = run_pdtopo(["scale", "prefill=3", str(run_dir)], timeout=600)
            assert out.returncode == 0, out.stdout + out.stderr + dep.log_tails(20)
            print(out.stdout)  # the steps and their times (docs/reliability.md)
            plan = reload(dep)
            assert [p["name"] for p in plan["processes"] if p["role"] == "prefill"] == \
                ["prefill_0", "prefill_1", "prefill_2"]
            new = dep.process("prefill_2")
            assert new["chips"] == [4]
            held = {port for p in json.loads(plan_before)["processes"]
                    for port in p["ports"].values()}
            assert not held.intersection(new["ports"].values()), new["ports"]
            assert router_workers(dep.proxy_url) == planned_workers(plan)
            deadline = time.monotonic() + 60  # round robin over three P: prefill_2 serves
            while computed_tokens(dep.url("prefill_2")) == 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert computed_tokens(dep.url("prefill_2")) > 0
            status = run_pdtopo(["status", str(run_dir)], timeout=60)
            assert status.returncode == 0 and "prefill_2" in status.stdout, status.stdout

            out = run_pdtopo(["scale", "prefill=1", str(run_dir)], timeout=600)
            assert out.returncode == 0, out.stdout + out.stderr + dep.log_tails(20)
            print(out.stdout)
            assert said(out).count("removed from the router") == 2, out.stdout
            time.sleep(2)
        assert load.failures == [], load.failures[:5]
        assert load.ok > 10, load.ok
        print(f"steady load: {load.ok} requests answered, {len(load.failures)} failed")

        plan = reload(dep)
        assert [p["name"] for p in plan["processes"]] == ["bootstrap", "prefill_0", "decode_0",
                                                          "decode_1", "proxy"]
        assert router_workers(dep.proxy_url) == planned_workers(plan)
        states = sv.states()  # the plan's programs and the router watch (an event listener)
        assert sorted(states) == sorted([*(p["name"] for p in plan["processes"]), "router_watch"])
        assert all(state == "RUNNING" for state, _pid in states.values()), states
        for name in ("bootstrap", "prefill_0", "decode_0", "decode_1", "proxy"):
            assert states[name][1] == before[name], name  # nothing that stayed was restarted
        # the run dir's config expands to what runs
        again = expand_plan(OmegaConf.load(run_dir / "config.yaml"), run_dir=str(run_dir))
        assert [(p.name, p.ports, p.chips) for p in again.processes] == \
            [(p["name"], p["ports"], p["chips"]) for p in plan["processes"]]
        status = run_pdtopo(["status", str(run_dir)], timeout=60)
        assert status.returncode == 0 and "prefill_1" not in status.stdout, status.stdout
        assert generate(dep.proxy_url, {"text": PROMPT, "sampling_params": GREEDY}) \
            ["output_ids"] == expected["output_ids"]
        wait_pools_baseline(dep)
    finally:
        dep.stop_and_check()
