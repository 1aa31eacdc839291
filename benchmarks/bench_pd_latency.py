"""PD overhead at concurrency 1: colocated server vs 1P1D through the Rust router.

One command: `python benchmarks/bench_pd_latency.py [--requests N] [--max-new-tokens M]`.
It launches a 1p1d_cpu deployment (`pdtopo launch --detach`) and a colocated server with the
same model and seed, sends the same prompts one at a time as streaming /generate requests to
both, and prints TTFT and end-to-end latency p50/p99 for each and the PD overhead (PD - colocated).
Goal: PD TTFT overhead <= 10 ms p50 on the tiny model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e_support import (  # noqa: E402
    ColocatedServer,
    Deployment,
    deployment_overrides,
    port_block,
)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def measure(url: str, prompts: list[str], max_new_tokens: int) -> tuple[list[float], list[float]]:
    ttfts, e2es = [], []
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
            e2es.append(time.perf_counter() - t0)
            ttfts.append(first if first is not None else e2es[-1])
    return ttfts, e2es


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    prompts = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
               for i in range(args.requests + args.warmup)]
    base = port_block(40)
    with tempfile.TemporaryDirectory(prefix="pdtopo-bench-") as tmp:
        dep = Deployment(Path(tmp) / "run", deployment_overrides(base))
        colo = ColocatedServer(port_block(1), log_path=Path(tmp) / "colocated.log")
        try:
            t0 = time.perf_counter()
            dep.launch()
            print(f"1p1d_cpu launched and healthy in {time.perf_counter() - t0:.1f}s")
            colo.start()
            results = {}
            for name, url in (("colocated", colo.url), ("1P1D rust router", dep.proxy_url)):
                measure(url, prompts[: args.warmup], args.max_new_tokens)
                results[name] = measure(url, prompts[args.warmup:], args.max_new_tokens)
        finally:
            colo.stop()
            dep.stop()

    print(f"\n{args.requests} streaming requests at concurrency 1, "
          f"{args.max_new_tokens} new tokens each (times in ms)")
    print(f"{'server':<20}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p50':>10}{'E2E p99':>10}")
    for name, (ttft, e2e) in results.items():
        print(f"{name:<20}{_pct(ttft, 50) * 1e3:>10.1f}{_pct(ttft, 99) * 1e3:>10.1f}"
              f"{_pct(e2e, 50) * 1e3:>10.1f}{_pct(e2e, 99) * 1e3:>10.1f}")
    (c_ttft, c_e2e), (p_ttft, p_e2e) = results["colocated"], results["1P1D rust router"]
    over50 = (_pct(p_ttft, 50) - _pct(c_ttft, 50)) * 1e3
    over99 = (_pct(p_ttft, 99) - _pct(c_ttft, 99)) * 1e3
    print(f"\nPD TTFT overhead: p50 {over50:+.1f} ms, p99 {over99:+.1f} ms "
          f"(ratio p50 {_pct(p_ttft, 50) / _pct(c_ttft, 50):.2f}x); goal p50 <= 10 ms: "
          f"{'met' if over50 <= 10 else 'NOT met'}")
    print(f"PD E2E overhead: p50 {(_pct(p_e2e, 50) - _pct(c_e2e, 50)) * 1e3:+.1f} ms, "
          f"mean {(statistics.mean(p_e2e) - statistics.mean(c_e2e)) * 1e3:+.1f} ms")


if __name__ == "__main__":
    main()
