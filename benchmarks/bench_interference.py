"""Prefill/decode interference: colocated vs 1P1D at the same total CPU core budget.

One command: `python benchmarks/bench_interference.py [--topologies colocated_cpu,1p1d_cpu]`.
For each topology it launches a deployment (`pdtopo launch --detach`; the plan gives the
colocated server all cores and P and D disjoint halves, so the budgets are equal), then sends
a mixed workload: "decode" requests (short prompts, long outputs) that keep a decode batch
running, and "long" requests (long prompts, few outputs) arriving among them. It prints ITL p99
of the decode requests, TTFT p50/p99 of the long ones and goodput for each topology, and the
ratios against the first topology (goal: PD decode ITL p99 <= 0.5x colocated).
It also measures launch-to-healthy / launch-to-serving of 1p1d_cpu with an empty JAX
compilation cache (cold) and the same cache again (warm) (goals: < 30 s cold, < 10 s warm).
Add a future topology as a third column with `--topologies colocated_cpu,1p1d_cpu,local_cpu`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from pdtopo.bench.deployments import (
    DetachedDeployment,
    port_overrides,
)
from pdtopo.bench.run import run_bench, url_of_plan, wait_serving
from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.workload import synthetic
from pdtopo.ports import free_port_block


def launch(run_dir: Path, overrides: list[str]) -> tuple[DetachedDeployment, float, float]:
    """Launch; returns (deployment, launch-to-healthy s, launch-to-serving s)."""
    dep = DetachedDeployment(run_dir, overrides)
    t0 = time.perf_counter()
    try:
        dep.launch()
        healthy = time.perf_counter() - t0
        wait_serving(url_of_plan(dep.plan), 300)
    except BaseException:
        dep.stop()
        raise
    return dep, healthy, time.perf_counter() - t0


def mixed_workload(args, settings: BenchSettings):
    decode = synthetic(settings, args.decode_requests, seed_offset=1, input_len=32,
                       output_len=args.decode_output, tag="decode")
    long = synthetic(settings, args.long_requests, seed_offset=2, input_len=args.long_input,
                     output_len=4, tag="long")
    offsets = [i * 0.02 for i in range(len(decode))]
    offsets += [args.long_start + i * args.long_interval for i in range(len(long))]
    return decode + long, offsets


def bench_topology(topo: str, args, tmp: Path, common: list[str]) -> dict:
    dep, _, _ = launch(tmp / f"run-{topo}", [f"topology={topo}", *common,
                                              *port_overrides(free_port_block(40))])
    try:
        settings = BenchSettings.with_defaults({
            "num_requests": args.decode_requests + args.long_requests, "warmup_requests": 3,
            "max_concurrency": args.decode_requests + args.long_requests, "timeout_s": 300,
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
            "progress": False})
        workload, offsets = mixed_workload(args, settings)
        return run_bench(url_of_plan(dep.plan), settings, workload=workload, offsets=offsets)
    finally:
        dep.stop()


def startup_times(tmp: Path, common: list[str]) -> dict[str, tuple[float, float]]:
    cache = tmp / "jax-cache"  # empty: a cold start compiles everything
    out = {}
    for kind in ("cold", "warm"):
        dep, healthy, serving = launch(
            tmp / f"run-start-{kind}",
            ["topology=1p1d_cpu", *common, f"launcher.compilation_cache_dir={cache}",
             *port_overrides(free_port_block(40))])
        dep.stop()
        out[kind] = (healthy, serving)
        print(f"1p1d_cpu {kind} start: launch->healthy {healthy:.1f} s, "
              f"launch->serving {serving:.1f} s", flush=True)
    return out


def _v(m: dict, tag: str | None, key: str, q: str) -> float | None:
    s = m["stats"] if tag is None else m["stats"]["by_tag"][tag]
    return s[key][q] if key != "goodput" else s["goodput"]["rps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default="colocated_cpu,1p1d_cpu",
                    help="comma list; the first is the baseline of the ratios")
    ap.add_argument("--decode-requests", type=int, default=16)
    # decode requests must outlast the long prompts' arrival window, or nothing interferes
    ap.add_argument("--decode-output", type=int, default=768)
    ap.add_argument("--long-requests", type=int, default=16)
    ap.add_argument("--long-input", type=int, default=768)
    ap.add_argument("--long-start", type=float, default=0.5, help="s after the first request")
    ap.add_argument("--long-interval", type=float, default=0.15)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000)
    ap.add_argument("--slo-itl-ms", type=float, default=50)
    ap.add_argument("--skip-startup", action="store_true", help="skip cold/warm start timing")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every deployment")
    args = ap.parse_args()
    # a pool that holds every request at once: preemption would confound the comparison
    common = ["model=tiny_llama", "engine.max_model_len=1024", "engine.max_prefill_tokens=1024",
              "engine.num_pages=2048", "launcher.health_timeout_s=900", *args.overrides]
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]

    with tempfile.TemporaryDirectory(prefix="pdtopo-interf-") as tmp_s:
        tmp = Path(tmp_s)
        starts = {} if args.skip_startup else startup_times(tmp, common)
        results = {t: bench_topology(t, args, tmp, common) for t in topologies}

    print(f"\nmixed workload: {args.decode_requests} decode requests (32-token prompts, "
          f"{args.decode_output} output tokens) + {args.long_requests} long prompts "
          f"({args.long_input} tokens, 4 outputs) every {args.long_interval} s; "
          f"same total core budget; times in ms")
    rows = [("decode ITL p99", "decode", "itl_ms", "p99"),
            ("decode ITL p50", "decode", "itl_ms", "p50"),
            ("long TTFT p50", "long", "ttft_ms", "p50"),
            ("long TTFT p99", "long", "ttft_ms", "p99"),
            ("all TTFT p99", None, "ttft_ms", "p99"),
            ("goodput req/s", None, "goodput", "")]
    base = topologies[0]
    header = f"{'metric':<16}" + "".join(f"{t:>16}" for t in topologies) + \
        "".join(f"{t + '/' + base:>26}" for t in topologies[1:])
    print(header)
    for label, tag, key, q in rows:
        vals = [_v(results[t], tag, key, q) for t in topologies]
        line = f"{label:<16}" + "".join(f"{v:>16.2f}" if v is not None else f"{'-':>16}"
                                        for v in vals)
        for v in vals[1:]:
            ratio = v / vals[0] if v is not None and vals[0] else None
            line += f"{ratio:>25.2f}x" if ratio is not None else f"{'-':>26}"
        print(line)
    for t in topologies:
        req = results[t]["stats"]["requests"]
        print(f"{t}: {req['completed']}/{req['total']} requests ok, errors "
              f"{results[t]['stats']['errors'] or 'none'}")
    for t in topologies[1:]:
        pd, colo = _v(results[t], "decode", "itl_ms", "p99"), _v(results[base], "decode",
                                                                   "itl_ms", "p99")
        if pd is not None and colo:
            print(f"goal {t} decode ITL p99 <= 0.5x {base}: {pd / colo:.2f}x -> "
                  f"{'met' if pd / colo <= 0.5 else 'NOT met'}")
    for kind, goal in (("cold", 30.0), ("warm", 10.0)):
        if kind in starts:
            healthy, serving = starts[kind]
            print(f"1p1d_cpu {kind} start: launch->healthy {healthy:.1f} s, launch->serving "
                  f"{serving:.1f} s (goal < {goal:.0f} s: {'met' if serving < goal else 'NOT met'})")


if __name__ == "__main__":
    main()
