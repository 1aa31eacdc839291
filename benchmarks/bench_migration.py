"""Draining a D with long answers running: moving them (issue 50) against waiting for them.

One command: `python benchmarks/bench_migration.py [--tokens 2000] [--clients 16]` (about 6 min
here: most of it is the waiting drain).

Twice, on the same 1P2D deployment shape (the tiny model, 12 layers: a long answer lasts
tens of seconds here; the Rust router; `disaggregation.migration=true`):
1. **waiting** (`launcher.migrate_after_s=null`, how a drain worked before): CLIENTS clients
   stream TOKENS-token greedy answers over /generate through the router; once decode_0 runs
   several of them it is drained (the launcher's own drain code, in this process: no CLI
   start-up in the time) and the drain lasts until its longest answer ends;
2. **migration** (`launcher.migrate_after_s=0`): the same, and decode_0's requests move to
   decode_1, KV and connection.

Printed per run: the drain's time (router exclusion + waiting or moving), the requests
decode_0 ran, and for the requests that moved (decode_0's log names them) the inter-token
latency p50/p99 before the drain and in the window from the drain's start to 0.5 s after its
end (the move's stall shows there). Every client must get its whole answer.

Last line: `drain with migration / without = X.XXx; ITL p99 during the move = Y ms`
(goal: X <= 0.1).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdtopo.bench.deployments import DetachedDeployment, log_tails, port_overrides
from pdtopo.launcher.operate.deployment import Deployment
from pdtopo.launcher.operate.rolling import Operator
from pdtopo.ports import free_port_block

MODEL = ["model=tiny_llama", "model.num_layers=12"]


def line(text: str = "") -> None:
    print(text, flush=True)


class Stream:
    """One client: a /generate stream, the arrival time of every output token."""

    def __init__(self, url: str, i: int, tokens: int) -> None:
        self.rid = f"bench-migration-{i}-{time.monotonic_ns()}"
        self.times: list[float] = []
        self.error: str | None = None
        body = {"text": f"stream {i}: a long story", "rid": self.rid, "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                    "ignore_eos": True}}
        self.thread = threading.Thread(target=self._run, args=(url, body, tokens))
        self.thread.start()

    def _run(self, url: str, body: dict, tokens: int) -> None:
        seen = 0
        try:
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                    return
                for text in r.iter_lines():
                    if not text.startswith("data: ") or text == "data: [DONE]":
                        continue
                    n = len(json.loads(text[6:])["output_ids"])
                    now = time.monotonic()
                    self.times += [now] * (n - seen)
                    seen = n
        except Exception as exc:  # noqa: BLE001 - reported
            self.error = f"{type(exc).__name__}: {exc}"
        if self.error is None and seen != tokens:
            self.error = f"{seen} of {tokens} tokens"

    def gaps(self, lo: float, hi: float) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)
                if lo <= b <= hi and b > a]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def engine_reqs(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/pdtopo/state", timeout=5).json().get("num_reqs", 0))
    except httpx.HTTPError:
        return 0


def run(root: Path, migrate: bool, tokens: int, clients: int) -> dict:
    name = "migration" if migrate else "waiting"
    run_dir = root / name
    dep = DetachedDeployment(run_dir, [
        *MODEL, "topology=2p2d_cpu", "topology.prefill.instances=1",
        "disaggregation.migration=true",
        f"launcher.migrate_after_s={0 if migrate else 'null'}",
        f"engine.max_model_len={tokens + 256}", f"engine.max_new_tokens_limit={tokens + 64}",
        "engine.page_size=16", f"engine.num_pages={clients * (tokens + 300) // 16 + 64}",
        f"engine.max_running_requests={clients}", "launcher.drain_timeout_s=600",
        "proxy.health_check_interval_s=1", "proxy.health_failure_threshold=1",
        *port_overrides(free_port_block(40))])
    dep.launch()
    try:
        d0 = next(f"http://{p['address']}:{p['ports']['http']}" for p in dep.plan["processes"]
                  if p["name"] == "decode_0")
        streams = [Stream(dep.proxy_url, i, tokens) for i in range(clients)]
        deadline = time.monotonic() + 60
        while engine_reqs(d0) < clients // 2 - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a second of steady decoding before the drain
        ran = engine_reqs(d0)
        said: list[str] = []
        op = Operator(Deployment.load(run_dir), said.append)
        leader = next(p for p in op.dep.leaders("decode") if p.name == "decode_0")
        t0 = time.monotonic()
        left = op.drain(leader)
        t1 = time.monotonic()
        for s in streams:
            s.thread.join(timeout=900)
        errors = [s.error for s in streams if s.error]
        log = (run_dir / "logs" / "decode_0.log").read_text(errors="replace")
        moved_ids = set(re.findall(r"(\S+) moved to another D in", log))
        moved = [s for s in streams if s.rid in moved_ids]
        watched = moved or streams
        before = [g for s in watched for g in s.gaps(t0 - 5.0, t0)]
        during = [g for s in watched for g in s.gaps(t0, t1 + 0.5)]
        for text in said:
            line(f"  | {text}")
        line(f"{name}: decode_0 ran {ran} of {clients} requests; drain {t1 - t0:.2f} s "
             f"({left} left); moved {len(moved)}; failed {len(errors)}"
             + (f" ({errors[0]})" if errors else ""))
        line(f"  ITL of {'the moved' if moved else 'all'} requests, ms: before the drain p50 "
             f"{pct(before, 50) * 1e3:.2f} p99 {pct(before, 99) * 1e3:.2f}; from the drain's "
             f"start to 0.5 s after its end p50 {pct(during, 50) * 1e3:.2f} p99 "
             f"{pct(during, 99) * 1e3:.2f} (max {max(during, default=0) * 1e3:.1f})")
        if errors:
            raise RuntimeError(f"{name}: {len(errors)} clients failed: {errors[:3]}")
        return {"drain_s": t1 - t0, "moved": len(moved), "itl_p99_ms": pct(during, 99) * 1e3,
                "answer_s": statistics.median(s.times[-1] - s.times[0] for s in streams)}
    except Exception:
        line(log_tails(run_dir, 30))
        raise
    finally:
        dep.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    line(f"1P2D, tiny model (12 layers), {args.clients} clients x {args.tokens}-token greedy "
         "answers over /generate SSE through the Rust router; decode_0 drained mid-answer")
    with tempfile.TemporaryDirectory(prefix="bench_migration_") as tmp:
        root = Path(tmp)
        wait = run(root, migrate=False, tokens=args.tokens, clients=args.clients)
        move = run(root, migrate=True, tokens=args.tokens, clients=args.clients)
    if move["moved"] == 0:
        raise SystemExit("no request moved: decode_0 had finished them before the drain")
    line(f"median answer {wait['answer_s']:.1f} s; drain waiting {wait['drain_s']:.2f} s, "
         f"moving {move['drain_s']:.2f} s ({move['moved']} moved): "
         f"{move['drain_s'] / wait['drain_s']:.4f}x")
    line(f"drain with migration / without = {move['drain_s'] / wait['drain_s']:.2f}x; "
         f"ITL p99 during the move = {move['itl_p99_ms']:.1f} ms")


if __name__ == "__main__":
    main()
