"""Prefix reuse on the multiturn workload: what the prefix cache buys, colocated and in PD.

One command, one run: `python benchmarks/bench_prefix_cache.py [--conversations C] [--turns T]`.
Every configuration serves the same seeded multiturn workload (`bench.workload=multiturn`: C
conversations of T turns, each with its own ~1,000-token context, a turn's prompt being the
conversation so far plus a new 32-token user message, 16-token answers, all conversations at
once). Pairs, each baseline measured in the same run:

1. colocated, engine.prefix_cache false vs true;
2. 1P1D (Rust router), false vs true;
3. 2P2D behind the model gateway (`proxy=gateway`), proxy.policy round_robin vs cache_aware,
   the prefill pools sized to hold about half of the conversations (the case cache-aware
   routing exists for: spread over both P's, every conversation needs room on both and the
   caches thrash; kept on one P, each P needs half); plus the rust router (sglang-router
   0.3.2) with cache_aware, which in PD mode keeps no affinity (docs/prefix-cache.md). This
   pair serves 9 conversations (`--pd-conversations`): with a count divisible by the number of
   P and every conversation's next turn sent as its answer arrives, the turns reach the router
   in nearly the same order each round, so round robin hands a conversation the same P turn
   after turn by accident (measured with 8: round robin's hit ratio 0.29-0.48 across runs,
   cache_aware's 0.73); real traffic has no such alignment, and an odd count removes it
   (it reduces but does not remove round robin's run-to-run spread: 0.28-0.44 with 9);
4. 1P1D, disaggregation.decode_prefix_cache false vs true (D's own cache: P sends only the
   pages D lacks).

It prints per configuration: TTFT p50/p99 per turn, the cached-token ratio (meta_info), prompt
tokens P (or the colocated server) computed, KV bytes D pulled per request and, for D's cache,
the ratio of pulled bytes to the bytes of each turn's new pages; then the ratios and goals:
turn >= 3 TTFT p50 cached <= 0.35x uncached (colocated) and <= 0.5x (1P1D); 2P2D cache_aware hit
ratio >= 1.8x round_robin; with D's cache, pulled bytes <= 1.2x the new pages' bytes.
`--router-metrics` also prints how the router's routing counters moved during each PD
measurement (the gateway's policy branches, per-worker requests).

The model is a random-initialised Llama of 8 layers and hidden size 256 (bigger than the test
model) so that a 1,000-token prefill costs what it would relative to the fixed HTTP and router
overheads on this CPU; the greedy tokens do not matter here, only the work. `--model smollm2`
serves SmolLM2-135M-Instruct instead (30 layers, real weights; the workload stays token ids).
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from pdtopo.bench.deployments import (
    ColocatedProcess,
    DetachedDeployment,
    port_overrides,
)
from pdtopo.bench.loadgen import run_conversations
from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.stats import percentile, summarize, ttft
from pdtopo.bench.workload import multiturn
from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.top import parse as parse_metrics
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.ports import free_port_block

PAGE = 16
RANDOM8 = ["model=tiny_llama", "model.hidden_size=256", "model.intermediate_size=512",
           "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=32"]
MODEL = list(RANDOM8)  # --model NAME: the model group instead (e.g. smollm2)
ENGINE = ["engine.max_model_len=2048", "engine.max_prefill_tokens=2048",
          "engine.num_pages=1024", "engine.max_running_requests=16"]


def page_bytes(model_overrides: list[str]) -> int:
    """Bytes of one KV page (K and V, every layer, float32) of the model served."""
    m = model_config_from_cfg(compose_config(model_overrides).model)
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * PAGE * 4


PAGE_BYTES = 2 * 8 * 4 * 32 * PAGE * 4  # RANDOM8's; main() sets it for --model
# the router's series printed by --router-metrics (which branch of the policy chose a worker,
# per-worker load and requests)
ROUTER_SERIES = ("policy", "branch", "worker_load", "worker_requests", "cache")
# The gateway's health heuristics assume GPU-speed prefill: on this CPU four 1,000-token prompts
# in flight on one P take longer than its 3 s "wedged" bound, and it would divert their
# conversations' next turns to the other P. Its warm-up slice also sends cache hits to a
# "thin" P. Both are switched off here so the routing measured is the cache-aware policy's.
GATEWAY_CPU = ['proxy.extra_args=["--worker-wedge-secs","120","--worker-warmup-secs","0",'
               '"--worker-warmup-divert-every","0"]']


def settings(args) -> BenchSettings:
    return BenchSettings.with_defaults({
        "workload": "multiturn", "output_len": 16, "warmup_requests": 0, "progress": False,
        "max_concurrency": args.conversations, "timeout_s": 300, "seed": 1,
        "multiturn": {"system_prompts": args.conversations, "system_len": args.context,
                      "conversations": args.conversations, "turns": args.turns,
                      "user_len": 32}})


def state(url: str) -> dict:
    return httpx.get(f"{url}/pdtopo/state", timeout=10).json()


def totals(urls: list[str], key: str) -> int:
    return sum(int(state(u).get(key, 0)) for u in urls)


def warm(url: str, args) -> None:
    """The same workload with other tokens, outside the measurement: every step shape the
    measured run uses is compiled by then (a first-use XLA compilation stalls the engine for
    seconds on this CPU and would land in one turn's TTFT)."""
    s = settings(args)
    s.seed += 1000
    run_conversations(url, multiturn(s), s, progress=False)


def router_counters(metrics_url: str | None) -> dict[str, float]:
    """The router's smg_* routing counters and gauges (its /metrics), by series."""
    if not metrics_url:
        return {}
    out: dict[str, float] = {}
    for name, samples in parse_metrics(httpx.get(metrics_url, timeout=10).text, 0.0).values.items():
        for labels, value in samples:
            series = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
            if name.startswith("smg_") and any(k in series for k in ROUTER_SERIES):
                out[series] = value
    return out


def measure(name: str, url: str, args, prefill_urls: list[str], decode_urls: list[str],
            metrics_url: str | None = None) -> dict:
    warm(url, args)
    for u in prefill_urls + decode_urls:  # start every configuration with empty caches
        httpx.post(f"{u}/flush_cache", timeout=30)
    s = settings(args)
    computed0 = [totals([u], "num_prefill_tokens") for u in prefill_urls]
    pulled0 = totals(decode_urls, "pd_pulled_bytes")
    metrics_url = metrics_url if args.router_metrics else None
    routed0 = router_counters(metrics_url)
    results, duration = run_conversations(url, multiturn(s), s, progress=False)
    routed = {k: v - routed0.get(k, 0.0) for k, v in router_counters(metrics_url).items()}
    st = summarize(results, duration, s.slo)
    if st["requests"]["failed"]:
        raise RuntimeError(f"{name}: {st['requests']['failed']} requests failed: {st['errors']} "
                           f"{st['error_examples']}")
    new_bytes = 0
    for i, r in enumerate(results):  # the turn's pages whose KV the conversation lacked
        turn = i % args.turns
        known = 0
        if turn:
            prev = results[i - 1]
            known = (prev.input_len + prev.output_tokens - 1) // PAGE
        new_bytes += (-(-r.input_len // PAGE) - known) * PAGE_BYTES
    pulled = totals(decode_urls, "pd_pulled_bytes") - pulled0
    out = {"name": name, "stats": st,
           "ttft_ms": [(i % args.turns + 1, ttft(r) * 1e3) for i, r in enumerate(results)],
           "computed_per_p": [totals([u], "num_prefill_tokens") - c0
                              for u, c0 in zip(prefill_urls, computed0, strict=True)],
           "pulled_per_req": pulled / len(results) if decode_urls else None,
           "pulled_vs_new": pulled / new_bytes if decode_urls else None}
    out["computed"] = sum(out["computed_per_p"])
    show(out, args.turns)
    if args.router_metrics:
        for series, delta in sorted(routed.items()):
            if delta:
                print(f"    router {series} {delta:+g}")
    return out


def show(r: dict, turns: int) -> None:
    st = r["stats"]
    per_turn = "  ".join(
        f"t{t}: {st['by_tag'][f'turn{t}']['ttft_ms']['p50']:.0f}/"
        f"{st['by_tag'][f'turn{t}']['ttft_ms']['p99']:.0f}" for t in range(1, turns + 1))
    pulled = "" if r["pulled_per_req"] is None else (
        f"  pulled/req {r['pulled_per_req'] / 1e6:.2f} MB ({r['pulled_vs_new']:.2f}x new pages)")
    per_p = r["computed_per_p"]
    split = f" ({' + '.join(f'{c:,}' for c in per_p)})" if len(per_p) > 1 else ""
    print(f"{r['name']:<28} TTFT p50/p99 ms {per_turn}  hit {st['cached_token_ratio']:.2f}  "
          f"P computed {r['computed']:,} tok{split}{pulled}", flush=True)


def turn_p50(r: dict, first: int) -> float:
    """TTFT p50 (ms) over every request of turn `first` or later."""
    return percentile([ms for turn, ms in r["ttft_ms"] if turn >= first], 50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=1000, help="tokens of each conversation's "
                    "context (its system prompt)")
    ap.add_argument("--pd-conversations", type=int, default=9,
                    help="conversations of the 2P2D routing pair (odd by default: see the "
                    "module docstring)")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="copy every deployment's logs/ to DIR/<configuration> after it stops")
    ap.add_argument("--router-metrics", action="store_true",
                    help="print how the router's counters moved during each PD measurement "
                    "(policy branches, per-worker requests and load)")
    ap.add_argument("--only", default=None, help="run only the configurations whose name "
                    "matches this regular expression (ratios print where both sides ran)")
    ap.add_argument("--model", default=None, help="serve this model group instead of the "
                    "random 8-layer Llama (e.g. smollm2: real weights, 30 layers)")
    args = ap.parse_args()
    global PAGE_BYTES
    if args.model:
        MODEL[:] = [f"model={args.model}"]
        PAGE_BYTES = page_bytes(MODEL)
    wanted = re.compile(args.only) if args.only else None

    def chosen(name: str) -> bool:
        return wanted is None or bool(wanted.search(name))

    print(f"multiturn: {args.conversations} conversations ({args.pd_conversations} for the 2P2D "
          f"routing pair) x {args.turns} turns, {args.context}-token contexts, 32-token "
          "messages, 16-token answers")
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pdtopo-bench-prefix-") as tmp:
        for cache in ("false", "true"):
            if not chosen(f"colocated cache={cache}"):
                continue
            colo = ColocatedProcess(free_port_block(1), [*MODEL, *ENGINE,
                                                         f"engine.prefix_cache={cache}"],
                                    log_path=Path(tmp) / f"colocated-{cache}.log")
            try:
                colo.start()
                res[f"colocated cache={cache}"] = measure(
                    f"colocated cache={cache}", colo.url, args, [colo.url], [])
            finally:
                colo.stop()

        def pd(name: str, extra: list[str], run_args: argparse.Namespace = args) -> None:
            if not chosen(name):
                return
            dep = DetachedDeployment(Path(tmp) / re.sub(r"[^A-Za-z0-9_]", "_", name),
                                     [*MODEL, *ENGINE, *extra,
                                      *port_overrides(free_port_block(40))])
            t0 = time.perf_counter()
            try:
                dep.launch()
                procs = dep.plan["processes"]
                urls = {role: [f"http://{p['address']}:{p['ports']['http']}" for p in procs
                               if p["role"] == role] for role in ("prefill", "decode")}
                print(f"  ({name}: launched and healthy in {time.perf_counter() - t0:.0f} s)")
                proxy = next(p for p in procs if p["role"] == "proxy")
                prom = proxy["ports"].get("prometheus")
                metrics = f"http://{proxy['address']}:{prom}/metrics" if prom else None
                res[name] = measure(name, dep.proxy_url, run_args, urls["prefill"],
                                    urls["decode"], metrics)
            finally:
                dep.stop()
                if args.keep_logs:
                    shutil.copytree(dep.run_dir / "logs", Path(args.keep_logs) / dep.run_dir.name,
                                    dirs_exist_ok=True)

        pd("1P1D cache=false", ["engine.prefix_cache=false"])
        pd("1P1D cache=true", [])
        routing = argparse.Namespace(**{**vars(args), "conversations": args.pd_conversations})
        # each P's pool holds its half of the conversations (rounded up) and 64 pages more
        half = (-(-routing.conversations // 2) * (-(-(args.context + args.turns * 48) // PAGE))
                + 64)
        for proxy, policy in (("gateway", "round_robin"), ("gateway", "cache_aware"),
                              ("rust", "cache_aware")):
            pd(f"2P2D {proxy} {policy}", ["topology=2p2d_cpu", f"proxy={proxy}",
                                          f"proxy.policy={policy}",
                                          f"topology.prefill.engine.num_pages={half}",
                                          *(GATEWAY_CPU if proxy == "gateway" else [])],
               routing)
        pd("1P1D decode_cache=true", ["disaggregation.decode_prefix_cache=true"])

    print("\nratios (baseline measured in this run):")
    for label, off, on, goal in (("colocated", "colocated cache=false", "colocated cache=true",
                                  0.35),
                                 ("1P1D", "1P1D cache=false", "1P1D cache=true", 0.5)):
        if off not in res or on not in res:
            continue
        ratio = turn_p50(res[on], 3) / turn_p50(res[off], 3)
        print(f"  {label:<10} turn>=3 TTFT p50 cache on / off: {ratio:.2f}x "
              f"(goal <= {goal}: {'met' if ratio <= goal else 'NOT met'})")
    if "2P2D gateway round_robin" in res and "2P2D gateway cache_aware" in res:
        rr = res["2P2D gateway round_robin"]["stats"]["cached_token_ratio"]
        ca = res["2P2D gateway cache_aware"]["stats"]["cached_token_ratio"]
        ratio = ca / rr if rr else float("inf")
        print(f"  2P2D gateway hit ratio cache_aware / round_robin: {ca:.2f} / {rr:.2f} = "
              f"{ratio:.2f}x (goal >= 1.8: {'met' if ratio >= 1.8 else 'NOT met'})")
        if "2P2D rust cache_aware" in res:
            rust = res["2P2D rust cache_aware"]["stats"]["cached_token_ratio"]
            print(f"  2P2D rust router cache_aware / gateway round_robin: {rust:.2f} / "
                  f"{rr:.2f} = {rust / rr if rr else float('inf'):.2f}x (sglang-router 0.3.2 "
                  "keeps no prefix affinity in PD mode: docs/prefix-cache.md)")
    if "1P1D cache=true" not in res or "1P1D decode_cache=true" not in res:
        return
    off, on = res["1P1D cache=true"], res["1P1D decode_cache=true"]
    print(f"  1P1D KV pulled per request, D cache on / off: "
          f"{on['pulled_per_req'] / off['pulled_per_req']:.2f}x; pulled / new pages' bytes with "
          f"D's cache: {on['pulled_vs_new']:.2f}x (goal <= 1.2: "
          f"{'met' if on['pulled_vs_new'] <= 1.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
