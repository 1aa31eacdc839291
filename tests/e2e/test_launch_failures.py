"""A launch that cannot succeed ends at once, saying why, with nothing left running: a program
whose start-up error comes after supervisord's startsecs (so supervisord keeps restarting it)
is a crash loop, not a slow start; a TPU topology on a host without TPUs is refused with the
emulation hint, and `topology.platform=cpu` alone runs that topology emulated."""

from __future__ import annotations

import time

import pytest

from tests.support.e2e import (
    Deployment,
    deployment_overrides,
    generate,
    port_block,
    processes_of_run,
    run_pdtopo,
)

pytestmark = pytest.mark.slow
SMALL = ["model=tiny_llama", "model.num_layers=2",
         "engine.num_pages=128", "engine.max_model_len=128"]


def test_crash_loop_ends_the_launch_with_the_programs_error(tmp_path):
    """kv_memory_fraction needs device memory statistics, which the CPU backend lacks: the
    real server fails after loading JAX, every time it is restarted. It gets that far in
    about 2 s here, so startsecs is 1: each run counts as started (past startsecs) and the
    launch must end at the second exit, not wait for supervisord's FATAL."""
    run = tmp_path / "run"
    started = time.monotonic()
    res = run_pdtopo(["launch", "topology=colocated_cpu", *SMALL, "engine.kv_memory_fraction=0.5",
                      "launcher.health_timeout_s=180", "launcher.startsecs=1",
                      *deployment_overrides(port_block(40)),
                      f"hydra.run.dir={run}"], timeout=240)
    took = time.monotonic() - started
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "colocated_0 exited 2 times during start-up" in out and "crash loop" in out, out
    assert "needs device memory statistics" in out  # the program's own error, from its log
    assert took < 120, f"took {took:.0f} s: the health timeout (180 s), not the crash loop"
    assert "torn down" in out and processes_of_run(run) == []


def test_tpu_topology_without_tpus_is_refused_with_the_emulation_hint(tmp_path):
    run = tmp_path / "run"
    res = run_pdtopo(["launch", "topology=1p1d_v6e8", f"hydra.run.dir={run}"], timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no TPU devices" in res.stderr and "topology.platform=cpu" in res.stderr
    assert not (run / "supervisord.pid").exists()


def test_platform_cpu_alone_emulates_a_tpu_topology(tmp_path):
    """1p1d_v6e8 (P and D of 4 chips, tp=4) on cpu devices: same chip split, serves."""
    dep = Deployment(tmp_path / "run", ["topology=1p1d_v6e8", "topology.platform=cpu", *SMALL,
                                        *deployment_overrides(port_block(40))])
    dep.launch()
    try:
        chips = {p["name"]: (p["chips"], p["mesh"], p["env"].get("XLA_FLAGS"))
                 for p in dep.plan["processes"] if p["role"] in ("prefill", "decode")}
        assert chips == {
            "prefill_0": ([0, 1, 2, 3], {"tp": 4},
                          "--xla_force_host_platform_device_count=4"),
            "decode_0": ([4, 5, 6, 7], {"tp": 4}, "--xla_force_host_platform_device_count=4")}
        out = generate(dep.proxy_url, {"input_ids": [256, 72, 105], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
        assert len(out["output_ids"]) == 4
    finally:
        dep.stop_and_check()
