"""Inter-token latency of running decodes while a long prompt prefills (colocated engine).

    python benchmarks/bench_mixed_steps.py [hydra overrides]

Eight requests decode; then a 2,048-token prompt arrives and prefills in chunks of
`engine.max_prefill_tokens`. Measured for `engine.mixed_steps=false` (the baseline: prefill
steps run alone, the decodes wait for the whole prompt) and `true` (every step carries the
running decodes plus a chunk), in the same run, on the same warmed engine: the decodes'
inter-token latency (ITL) p50/p99/max of the gaps that overlap the prompt's prefill (from its
arrival to its first token), and the
prompt's time to first token. The scheduler loop runs synchronously in this process (no HTTP)
on the real ModelRunner; tokens are time-stamped as each step returns. The last line is
`ITL p99 while a 2K prompt prefills: mixed X ms, separate Y ms (Z.ZZx)`.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from pdtopo.config.compose import compose_config  # noqa: E402
from pdtopo.runtime.engine.mesh import build_mesh  # noqa: E402
from pdtopo.runtime.engine.model_runner import ModelRunner  # noqa: E402
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams  # noqa: E402
from pdtopo.runtime.engine.scheduler import Scheduler  # noqa: E402
from pdtopo.runtime.model.tokenizer import load_tokenizer  # noqa: E402
from pdtopo.runtime.settings import direct_process_context  # noqa: E402

DEFAULTS = ["model=tiny_llama", "engine.max_running_requests=16",
            "engine.max_prefill_tokens=256", "engine.max_model_len=2304", "engine.num_pages=512"]
PROMPT = 2048
DECODERS = 8


def _req(i: int, prompt_len: int, new: int, rng: random.Random) -> Req:
    prompt = [rng.randrange(1, 255) for _ in range(prompt_len)]
    return Req(rid=f"m{i}-{rng.random()}", prompt_ids=prompt, sink=QueueSink(),
               sampling=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))


def _step(s: Scheduler, stamps: dict[str, list[float]]) -> None:
    s.drain_inbox()
    batch = s.schedule()
    if batch is None:
        return
    s.run_batch(batch)
    now = time.perf_counter()
    for r in batch.reqs:
        if r.output_ids and len(stamps.setdefault(r.rid, [])) < len(r.output_ids):
            stamps[r.rid].append(now)


def measure(s: Scheduler, mixed: bool, rng: random.Random) -> tuple[np.ndarray, float]:
    """(ITLs in ms of the decodes while the long prompt prefilled, the prompt's TTFT in ms)."""
    s.mixed_steps = mixed
    stamps: dict[str, list[float]] = {}
    decoders = [_req(i, 16, 400, rng) for i in range(DECODERS)]
    for r in decoders:
        s.submit(r)
    while any(not r.output_ids or len(r.output_ids) < 4 for r in decoders):
        _step(s, stamps)
    long = _req(99, PROMPT, 2, rng)
    t0 = time.perf_counter()
    s.submit(long)
    while not long.output_ids:
        _step(s, stamps)
    t_first = time.perf_counter()
    while any(stamps[r.rid][-1] < t_first for r in decoders):  # each decode's next token
        _step(s, stamps)
    # the gaps that overlap the prompt's prefill (from its arrival to its first token)
    itl = [b - a for r in decoders for a, b in itertools.pairwise(stamps[r.rid])
           if b > t0 and a < t_first]
    ttft = t_first - t0
    for r in [*decoders, long]:
        s.abort(r.rid)
    while s.has_work() or not s.inbox.empty():
        _step(s, stamps)
    return np.array(itl) * 1e3, ttft * 1e3


def main(argv: list[str]) -> int:
    cfg = compose_config(DEFAULTS + argv)
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    s = Scheduler(direct_process_context(cfg), runner, load_tokenizer(cfg.model))
    runner.warmup()
    s.warmup()
    rng = random.Random(0)
    measure(s, True, rng)  # a first pass runs every program once
    measure(s, False, rng)
    shapes = runner.compile_count()
    results = {mixed: measure(s, mixed, rng) for mixed in (False, True)}
    m = cfg.model
    print(f"mixed steps: {m.name} layers={m.num_layers}, {DECODERS} decodes running, a "
          f"{PROMPT}-token prompt in chunks of {cfg.engine.max_prefill_tokens}; "
          f"new step shapes while measuring: {runner.compile_count() - shapes}")
    for mixed, (itl, ttft) in results.items():
        name = "mixed (engine.mixed_steps=true)" if mixed else "separate (baseline, false)"
        print(f"  {name:32s}: decode ITL p50 {np.percentile(itl, 50):7.1f} ms, p99 "
              f"{np.percentile(itl, 99):7.1f} ms, max {itl.max():7.1f} ms over {len(itl)} "
              f"gaps; prompt TTFT {ttft:7.1f} ms")
    p99 = {k: float(np.percentile(v[0], 99)) for k, v in results.items()}
    print(f"ITL p99 while a 2K prompt prefills: mixed {p99[True]:.1f} ms, separate "
          f"{p99[False]:.1f} ms ({p99[True] / p99[False]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
