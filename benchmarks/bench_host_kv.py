"""KV in host memory: the prefix cache's host tier, and D2H staging on P (mode B).

One command, one run: `python benchmarks/bench_host_kv.py [--conversations C] [--turns T]`.
The model is SmolLM2-135M-shaped (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary
49,152) with random weights, so that a 1,024-token prefill dominates TTFT as it would with the
real checkpoint. Every configuration serves the same seeded multiturn workload: C conversations
of T turns, each with its own 1,024-token system prompt, a turn's prompt being the conversation
so far plus a 32-token message, 16-token answers, all conversations at once.

1. **Host tier**, off vs on (`engine.host_kv_pages`), colocated and 1P1D: the prefix cache's
   device pool (P's, in 1P1D) holds a quarter of the workload's pages (its working set is 4x the
   pool) and the host tier four times the pool. Printed: the prefix hit ratio (cached / prompt
   tokens), TTFT p50/p99 per turn and over turns >= 3, prompt tokens computed, pages loaded
   back from the host tier. Goals: hit ratio on/off >= 2x, turn >= 3 TTFT p50 on/off <= 0.6x.
2. **D2H staging** (`disaggregation.d2h_staging`), mode A vs B, 1P1D with D slowed: D's pool
   holds two requests at a time, so P keeps the copies of the others until D has room. Printed:
   the peak of P's device bytes held for waiting transfers (its /pdtopo/state, polled every 50
   ms), of all bytes held, and TTFT p50/p99. Goal: mode B's device bytes held stay 0.

The last line is `host tier: hit ratio X.XXx, turn>=3 TTFT p50 Y.YYx` (on / off, 1P1D).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdtopo.bench.deployments import ColocatedProcess, DetachedDeployment, port_overrides
from pdtopo.bench.loadgen import run_conversations
from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.stats import percentile, summarize, ttft
from pdtopo.bench.workload import multiturn
from pdtopo.ports import free_port_block

PAGE = 16
SMOLLM2_SHAPES = ["model=tiny_llama", "model.num_layers=30", "model.hidden_size=576",
                  "model.intermediate_size=1536", "model.num_heads=9", "model.num_kv_heads=3",
                  "model.head_dim=64", "model.vocab_size=49152"]
USER_LEN, OUTPUT_LEN = 32, 16
# P's small pool runs two of these prefills at a time (~4 s each on this CPU) and queues the
# rest: their KV comes later than the default 30 s, which is not what is measured here
PATIENT = ["disaggregation.kv_timeout_s=900", "disaggregation.sender_expiry_s=900",
           "disaggregation.held_kv_wait_s=600"]


def settings(args, seed: int = 1, conversations: int | None = None) -> BenchSettings:
    n = conversations or args.conversations
    return BenchSettings.with_defaults({
        "workload": "multiturn", "output_len": OUTPUT_LEN, "warmup_requests": 0,
        "progress": False, "max_concurrency": n, "timeout_s": 900, "seed": seed,
        "token_id_range": [2, 49000],
        "multiturn": {"system_prompts": n, "system_len": args.context, "conversations": n,
                      "turns": args.turns, "user_len": USER_LEN}})


def conversation_pages(args) -> int:
    """Pages one conversation's last turn holds (system prompt, every message and answer)."""
    return -(-(args.context + args.turns * (USER_LEN + OUTPUT_LEN)) // PAGE)


def state(url: str) -> dict:
    return httpx.get(f"{url}/pdtopo/state", timeout=30).json()


class PeakWatch:
    """Polls servers' /pdtopo/state every 50 ms and keeps the peak of some keys."""

    def __init__(self, url: str, keys: tuple[str, ...]):
        self.url, self.keys = url, keys
        self.peak = dict.fromkeys(keys, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                st = state(self.url)
            except httpx.HTTPError:
                continue
            for k in self.keys:
                self.peak[k] = max(self.peak[k], int(st.get(k, 0)))

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(name: str, url: str, args, prefill_url: str, watch: PeakWatch | None = None) -> dict:
    # outside the measurement: one short conversation of other tokens (the transfer path's and
    # the HTTP stack's first use), then empty caches
    s = settings(args, seed=1001, conversations=1)
    run_conversations(url, multiturn(s), s, progress=False)
    httpx.post(f"{prefill_url}/flush_cache", timeout=60)
    before = state(prefill_url)
    s = settings(args)
    t0 = time.perf_counter()
    if watch is not None:
        with watch:
            results, duration = run_conversations(url, multiturn(s), s, progress=False)
    else:
        results, duration = run_conversations(url, multiturn(s), s, progress=False)
    st = summarize(results, duration, s.slo)
    if st["requests"]["failed"]:
        raise RuntimeError(f"{name}: {st['requests']['failed']} requests failed: {st['errors']} "
                           f"{st['error_examples']}")
    after = state(prefill_url)
    prompt = sum(r.input_len for r in results)
    out = {"name": name, "stats": st, "seconds": time.perf_counter() - t0,
           "ttft_ms": [(i % args.turns + 1, ttft(r) * 1e3) for i, r in enumerate(results)],
           "hit": (after["cached_tokens"] - before["cached_tokens"]) / prompt,
           "computed": after["num_prefill_tokens"] - before["num_prefill_tokens"],
           "host_hits": after.get("host_hit_pages", 0) - before.get("host_hit_pages", 0),
           "peak": dict(watch.peak) if watch is not None else {}}
    show(out, args.turns)
    return out


def turn_ms(r: dict, first: int, q: float) -> float:
    return percentile([ms for turn, ms in r["ttft_ms"] if turn >= first], q)


def show(r: dict, turns: int) -> None:
    per_turn = "  ".join(f"t{t}: {percentile([ms for k, ms in r['ttft_ms'] if k == t], 50):.0f}/"
                         f"{percentile([ms for k, ms in r['ttft_ms'] if k == t], 99):.0f}"
                         for t in range(1, turns + 1))
    peak = "".join(f"  peak {k} {v / 1e6:.1f} MB" for k, v in r["peak"].items())
    print(f"{r['name']:<26} TTFT p50/p99 ms {per_turn}  turn>=3 {turn_ms(r, 3, 50):.0f}/"
          f"{turn_ms(r, 3, 99):.0f}  hit {r['hit']:.2f}  computed {r['computed']:,} tok  "
          f"host hits {r['host_hits']:,} pages{peak}  ({r['seconds']:.0f} s)", flush=True)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="tokens of each system prompt")
    ap.add_argument("--only", default=None, help="run only the configurations whose name "
                    "matches this regular expression")
    args = ap.parse_args()
    wanted = re.compile(args.only) if args.only else None
    conv = conversation_pages(args)
    working_set = args.conversations * conv
    pool = max(working_set // 4, conv + 1)       # the device pool P's cache works in
    host = 4 * pool
    big = working_set + 4 * conv                 # pools that never limit (D's)
    engine = ["engine.page_size=16", f"engine.max_model_len={args.context + 512}",
              f"engine.max_prefill_tokens={args.context + 512}",
              f"engine.max_running_requests={args.conversations}"]
    print(f"multiturn: {args.conversations} conversations x {args.turns} turns, "
          f"{args.context}-token system prompts, {USER_LEN}-token messages, {OUTPUT_LEN}-token "
          f"answers; SmolLM2-shaped model (30 layers, random weights)\n"
          f"working set {working_set} pages = {working_set / pool:.1f}x the device pool of "
          f"{pool} pages; host tier {host} pages ({host / pool:.0f}x the pool)")
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pdtopo-bench-host-kv-") as tmp:
        for tier in (0, host):
            name = f"colocated host={'on' if tier else 'off'}"
            if wanted and not wanted.search(name):
                continue
            colo = ColocatedProcess(free_port_block(1), [
                *SMOLLM2_SHAPES, *engine, f"engine.num_pages={pool + 1}",
                f"engine.host_kv_pages={tier}"], log_path=Path(tmp) / f"colocated-{tier}.log")
            try:
                colo.start()
                res[name] = measure(name, colo.url, args, colo.url)
            finally:
                colo.stop()

        def pd(name: str, extra: list[str], watch_keys: tuple[str, ...] = ()) -> None:
            if wanted and not wanted.search(name):
                return
            dep = DetachedDeployment(Path(tmp) / re.sub(r"[^A-Za-z0-9_]", "_", name), [
                *SMOLLM2_SHAPES, *engine, f"engine.num_pages={big}", *PATIENT, *extra,
                *port_overrides(free_port_block(40))])
            t0 = time.perf_counter()
            try:
                dep.launch()
                p = next(x for x in dep.plan["processes"] if x["role"] == "prefill")
                p_url = f"http://{p['address']}:{p['ports']['http']}"
                print(f"  ({name}: launched and healthy in {time.perf_counter() - t0:.0f} s)")
                watch = PeakWatch(p_url, watch_keys) if watch_keys else None
                res[name] = measure(name, dep.proxy_url, args, p_url, watch)
            finally:
                dep.stop()

        for tier in (0, host):
            pd(f"1P1D host={'on' if tier else 'off'}",
               [f"topology.prefill.engine.num_pages={pool + 1}", f"engine.host_kv_pages={tier}"])
        slow_d = [f"topology.decode.engine.num_pages={2 * conv + 1}"]
        held = ("pd_held_kv_device_bytes", "pd_held_kv_bytes")
        for mode, staging in (("A", "false"), ("B", "true")):
            pd(f"1P1D D slowed mode {mode}", [*slow_d, f"disaggregation.d2h_staging={staging}"],
               held)

    print("\nratios (baseline measured in this run):")
    a, b = res.get("1P1D D slowed mode A"), res.get("1P1D D slowed mode B")
    if a and b:
        dev = b["peak"]["pd_held_kv_device_bytes"]
        print(f"  mode B / A: P's peak device bytes held for transfers "
              f"{dev / 1e6:.1f} / {a['peak']['pd_held_kv_device_bytes'] / 1e6:.1f} MB "
              f"(goal 0: {'met' if dev == 0 else 'NOT met'}); TTFT p50 "
              f"{ratio(turn_ms(b, 1, 50), turn_ms(a, 1, 50)):.2f}x, p99 "
              f"{ratio(turn_ms(b, 1, 99), turn_ms(a, 1, 99)):.2f}x")
    last = None
    for label in ("colocated", "1P1D"):
        off, on = res.get(f"{label} host=off"), res.get(f"{label} host=on")
        if not (off and on):
            continue
        hit, p50 = ratio(on["hit"], off["hit"]), ratio(turn_ms(on, 3, 50), turn_ms(off, 3, 50))
        p99 = ratio(turn_ms(on, 3, 99), turn_ms(off, 3, 99))
        computed = ratio(on["computed"], off["computed"])
        print(f"  {label:<10} host tier on / off: hit ratio {on['hit']:.2f} / {off['hit']:.2f} = "
              f"{hit:.2f}x (goal >= 2: {'met' if hit >= 2 else 'NOT met'}); turn>=3 TTFT p50 "
              f"{p50:.2f}x (goal <= 0.6: {'met' if p50 <= 0.6 else 'NOT met'}), p99 {p99:.2f}x; "
              f"prompt tokens computed {computed:.2f}x")
        last = (hit, p50) if label == "1P1D" else last
    if last is not None:
        if last[0] == float("inf"):
            print("  (device only, nothing hit: least-recently-used eviction over a working set "
                  "larger than the pool drops every conversation before it returns)")
        print(f"host tier: hit ratio {last[0]:.2f}x, turn>=3 TTFT p50 {last[1]:.2f}x")


if __name__ == "__main__":
    main()
