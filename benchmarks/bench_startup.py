"""Start-up time: `pdtopo launch` of 1P1D until every program is healthy, for the default tiny
model and for a 30-layer SmolLM2-135M-shaped random checkpoint, each with an empty JAX
compilation cache (cold) and then the same cache again (warm).

One command: `python benchmarks/bench_startup.py [hydra overrides for every launch]`.
The checkpoint (f32, about 540 MB, random weights of SmolLM2-135M's shapes:
pdtopo.model_config.random_checkpoint.SMOLLM2_135M) is written to a temporary directory first.
For each launch it prints launch -> healthy and where each server's time went, from the
servers' own log lines: process start -> "loading model" (imports, tokenizer), "loading model" ->
"model loaded ... warming up" (weights, mesh, KV pool) and "warming up" -> "warmed up" (tracing,
compiling and running every step shape). The baseline is the tiny model; the ratio is 30-layer
cold / tiny cold. Goals (issue: start in seconds): 30-layer cold <= 30 s, warm <= 10 s, ratio
<= 1.5. The last line is the result: `30-layer cold X s, warm Y s, ratio Z`.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from datetime import datetime
from pathlib import Path

from pdtopo.bench.deployments import DetachedDeployment, port_overrides
from pdtopo.model_config.random_checkpoint import SMOLLM2_135M, write_random_checkpoint
from pdtopo.ports import free_port_block

SERVERS = ("prefill_0", "decode_0")
# (phase, log line that ends it); a phase starts where the previous one ended
PHASES = (("start", re.compile(r"loading model ")),
          ("load", re.compile(r"model loaded \(")),
          ("warmup", re.compile(r"engine loaded and warmed up in")))
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamp(line: str) -> float | None:
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def phases(log: Path) -> dict[str, float]:
    """Seconds per phase of one server's start, from its log (phases it never reached: absent)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    stamped = [(t, line) for line in lines if (t := _stamp(line)) is not None]
    if not stamped:
        return {}
    out, prev = {}, stamped[0][0]
    for name, pattern in PHASES:
        hit = next((t for t, line in stamped if pattern.search(line)), None)
        if hit is None:
            break
        out[name], prev = hit - prev, hit
    return out


def launch_once(run_dir: Path, overrides: list[str]) -> tuple[float, dict[str, dict]]:
    """Launch 1P1D, stop it; (launch -> healthy s, {server: phases})."""
    dep = DetachedDeployment(run_dir, ["topology=1p1d_cpu", *overrides,
                                       *port_overrides(free_port_block(40))])
    t0 = time.perf_counter()
    try:
        dep.launch(timeout=1800)
        healthy = time.perf_counter() - t0
    finally:
        dep.stop()
    return healthy, {s: phases(run_dir / "logs" / f"{s}.log") for s in SERVERS}


def measure(name: str, tmp: Path, overrides: list[str]) -> dict[str, float]:
    cache = tmp / f"jax-cache-{name}"  # fresh: the first launch compiles everything
    out = {}
    for kind in ("cold", "warm"):
        healthy, servers = launch_once(tmp / f"run-{name}-{kind}",
                                       [*overrides, f"launcher.compilation_cache_dir={cache}"])
        out[kind] = healthy
        split = "; ".join(f"{s}: " + ", ".join(f"{p} {v:.1f}" for p, v in ph.items())
                          for s, ph in servers.items())
        print(f"{name:>9} {kind}: launch -> healthy {healthy:6.1f} s  ({split} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every launch")
    args = ap.parse_args()
    common = ["launcher.health_timeout_s=1200", *args.overrides]
    with tempfile.TemporaryDirectory(prefix="pdtopo-startup-") as tmp_s:
        tmp = Path(tmp_s)
        ckpt = tmp / "smollm2-shaped"
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, arch="llama", tied=True, shape=SMOLLM2_135M)
        print(f"wrote a {SMOLLM2_135M.layers}-layer SmolLM2-135M-shaped random checkpoint in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        tiny = measure("tiny", tmp, ["model=tiny_llama", *common])
        deep = measure("30-layer", tmp, ["model=hf_local", f"model.path={ckpt}", *common])
    ratio = deep["cold"] / tiny["cold"]
    print(f"\nbaseline (tiny model, {tiny['cold']:.1f} s cold, {tiny['warm']:.1f} s warm); "
          f"goals: 30-layer cold <= 30 s, warm <= 10 s, ratio <= 1.5")
    print(f"30-layer cold {deep['cold']:.1f} s, warm {deep['warm']:.1f} s, ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
