"""Benchmark: expand + render a 256-process synthetic cpu-N topology (goal < 0.5 s).

Baseline in the same run: the 1p1d (2 server processes) topology. Prints both times
(best of N after a warm-up) and the ratio. Run: python benchmarks/bench_plan.py
"""

from __future__ import annotations

import time

from pdtopo.config.compose import compose_config
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.render.supervisord import render_supervisord

GOAL_S = 0.5
REPEATS = 5


def expand_and_render(cfg) -> int:
    plan = expand_plan(cfg, run_dir="/runs/bench", python="python", cpus=16)
    text = render_supervisord(plan, run_dir="/runs/bench", token="t" * 32, workdir="/work")
    assert text.count("[program:") == len(plan.processes)
    return len(plan.processes)


def best_time(cfg) -> tuple[float, int]:
    n = expand_and_render(cfg)  # warm-up
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        expand_and_render(cfg)
        best = min(best, time.perf_counter() - t0)
    return best, n


def main() -> None:
    half = 128
    big = compose_config([
        f"topology.accelerator=cpu-{2 * half}", f"topology.prefill.instances={half}",
        f"topology.decode.instances={half}", "topology.ports.http_base=20000",
        "topology.ports.transfer_base=30000", "topology.ports.zmq_base=40000",
        "topology.proxy.port=50000", "topology.proxy.prometheus_port=50001",
        "topology.bootstrap.port=50002",
    ])
    small = compose_config([])
    t_small, n_small = best_time(small)
    t_big, n_big = best_time(big)
    servers = n_big - 2
    print(f"baseline 1p1d_cpu     : {n_small:4d} programs ({n_small - 2} servers) "
          f"{t_small * 1e3:8.2f} ms")
    print(f"synthetic cpu-{2 * half}   : {n_big:4d} programs ({servers} servers) "
          f"{t_big * 1e3:8.2f} ms")
    print(f"ratio big/baseline    : {t_big / t_small:.1f}x for {servers / (n_small - 2):.0f}x "
          f"the server processes")
    verdict = "OK" if t_big < GOAL_S else "SLOW"
    print(f"goal < {GOAL_S * 1e3:.0f} ms for {servers} server processes: {verdict}")


if __name__ == "__main__":
    main()
