"""PD overhead at concurrency 1: a colocated server vs 1P1D through each sglang-router proxy.

One command: `python benchmarks/bench_pd_latency.py [--requests N] [--max-new-tokens M]`.
It starts a colocated server (the baseline, measured in the same run) and then 1p1d_cpu
deployments behind the Rust router and behind MiniLB (`pdtopo launch --detach`), sends the
same prompts one at a time, and prints per server:
- TTFT of a streaming request (first SSE event at the client) and its end-to-end time;
- the latency of a non-streaming 1-token request (prefill + hand-off + one answer: the
  time to first token as a non-streaming client sees it);
then the PD overhead (PD - colocated) at p50 and p99. Goal: PD TTFT overhead <= 10 ms p50.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from pdtopo.bench.deployments import (
    ColocatedProcess,
    DetachedDeployment,
    free_port_block,
    port_overrides,
)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def measure(url: str, prompts: list[str], max_new_tokens: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"ttft": [], "e2e": [], "one_token": []}
    with httpx.Client(timeout=120) as client:
        for prompt in prompts:
            body = {"text": prompt, "stream": True,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", f"{url}/generate", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data:") and first is None:
                        first = time.perf_counter() - t0
            out["e2e"].append(time.perf_counter() - t0)
            out["ttft"].append(first if first is not None else out["e2e"][-1])
            one = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            t0 = time.perf_counter()
            client.post(f"{url}/generate", json=one).raise_for_status()
            out["one_token"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    prompts = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
               for i in range(args.requests + args.warmup)]
    results: dict[str, dict[str, list[float]]] = {}

    def run(name: str, url: str) -> None:
        measure(url, prompts[: args.warmup], args.max_new_tokens)
        results[name] = measure(url, prompts[args.warmup:], args.max_new_tokens)

    with tempfile.TemporaryDirectory(prefix="pdtopo-bench-") as tmp:
        colo = ColocatedProcess(free_port_block(1), log_path=Path(tmp) / "colocated.log")
        try:
            colo.start()
            run("colocated", colo.url)
        finally:
            colo.stop()
        for proxy in ("rust", "mini_lb"):
            dep = DetachedDeployment(Path(tmp) / f"run-{proxy}",
                             [f"proxy={proxy}", *port_overrides(free_port_block(40))])
            try:
                t0 = time.perf_counter()
                dep.launch()
                print(f"1p1d_cpu proxy={proxy} launched and healthy in "
                      f"{time.perf_counter() - t0:.1f}s")
                run(f"1P1D {proxy}", dep.proxy_url)
            finally:
                dep.stop()

    print(f"\n{args.requests} requests per server at concurrency 1 (times in ms): streaming "
          f"with {args.max_new_tokens} new tokens, and non-streaming with 1 new token")
    print(f"{'server':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p50':>10}{'E2E p99':>10}"
          f"{'1-tok p50':>11}{'1-tok p99':>11}")
    for name, r in results.items():
        print(f"{name:<16}" + "".join(
            f"{_pct(r[k], q) * 1e3:>{w}.1f}" for k, q, w in
            (("ttft", 50, 10), ("ttft", 99, 10), ("e2e", 50, 10), ("e2e", 99, 10),
             ("one_token", 50, 11), ("one_token", 99, 11))))
    base = results["colocated"]
    print()
    for name, r in results.items():
        if name == "colocated":
            continue
        for key, label in (("ttft", "streaming TTFT"), ("one_token", "1-token latency")):
            o50 = (_pct(r[key], 50) - _pct(base[key], 50)) * 1e3
            o99 = (_pct(r[key], 99) - _pct(base[key], 99)) * 1e3
            ratio = _pct(r[key], 50) / _pct(base[key], 50)
            goal = "met" if o50 <= 10 else "NOT met"
            print(f"{name:<16} {label:<16} overhead p50 {o50:+7.1f} ms, p99 {o99:+7.1f} ms "
                  f"(p50 ratio {ratio:.2f}x; goal p50 <= 10 ms: {goal})")


if __name__ == "__main__":
    main()
