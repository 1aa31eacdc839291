"""Engine benchmark on the CPU (tiny model): prefill tokens/s, decode tokens/s at batch 1 and 16
(with the batch-16 / batch-1 ratio), decode with overlap scheduling against the synchronous loop
in the same run (`engine.overlap_schedule`; goal at batch 16: 1.2x), batch-1 decode against the
memory-read limit (the weights' bytes over the read bandwidth measured here; goal 0.9x), and
XLA compilations after warmup during a steady mixed workload (goal: 0).

    python benchmarks/bench_engine.py [hydra overrides, e.g. model.num_layers=2]

Runs the scheduler loop synchronously in this process (no HTTP), on the real ModelRunner.
"""

from __future__ import annotations

import os
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from pdtopo.config.compose import compose_config  # noqa: E402
from pdtopo.runtime.engine.mesh import build_mesh  # noqa: E402
from pdtopo.runtime.engine.model_runner import ModelRunner  # noqa: E402
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams  # noqa: E402
from pdtopo.runtime.engine.scheduler import Scheduler  # noqa: E402
from pdtopo.runtime.model.tokenizer import load_tokenizer  # noqa: E402
from pdtopo.runtime.settings import direct_process_context  # noqa: E402

DEFAULTS = ["model=tiny_llama", "engine.max_running_requests=16",
            "engine.max_prefill_tokens=256", "engine.max_model_len=256", "engine.num_pages=512"]

_compiles = [0]


def _on_event(event: str, duration: float, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


def run(s: Scheduler, reqs: list[Req], arrivals: list[int] | None = None) -> float:
    """Drive the loop until all requests finish; request i is submitted at step arrivals[i]."""
    pending = sorted(zip(arrivals or [0] * len(reqs), range(len(reqs)), strict=True),
                     reverse=True)
    t0 = time.perf_counter()
    step = 0
    while pending or s.has_work() or not s.inbox.empty():
        while pending and pending[-1][0] <= step:
            s.submit(reqs[pending.pop()[1]])
        s.drain_inbox()
        batch = s.schedule()
        if batch is not None:
            s.run_batch(batch)
        step += 1
    dt = time.perf_counter() - t0
    for r in reqs:
        _, last = r.sink.collect(timeout=5)
        assert last.finish_reason["type"] == "length", last.finish_reason
    return dt


def make(i: int, prompt_len: int, new: int, rng: random.Random) -> Req:
    prompt = [256] + [rng.randrange(1, 255) for _ in range(prompt_len - 1)]
    return Req(rid=f"b{i}-{rng.random()}", prompt_ids=prompt, sink=QueueSink(),
               sampling=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))


def decode_rate(s: Scheduler, batch: int, new: int, rng: random.Random,
                overlap: bool = False) -> float:
    """Decode tokens/s of `batch` requests through the serving loop's own `step()`, with or
    without overlap scheduling. The prefill runs first (max_new_tokens counts its token);
    only decode steps are timed."""
    s.overlap = overlap
    reqs = [make(i, 16, new, rng) for i in range(batch)]
    for r in reqs:
        s.submit(r)
    s.drain_inbox()
    while s.waiting:
        s.run_batch(s.schedule())
    t0 = time.perf_counter()
    while s.has_work():
        s.step()
    dt = time.perf_counter() - t0
    for r in reqs:
        r.sink.collect(timeout=5)
    return batch * (new - 1) / dt


def read_bandwidth() -> float:
    """Bytes/s a jitted reduction reads from a 256 MiB array (best of 5)."""
    x = jax.numpy.ones((64, 1 << 20), jax.numpy.float32)
    total = jax.jit(lambda a: a.sum())
    total(x).block_until_ready()
    best = min(_timed(lambda: total(x).block_until_ready()) for _ in range(5))
    return x.size * 4 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _nbytes(tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def decode_read_bytes(runner: ModelRunner) -> int:
    """Weight bytes one decode token reads: every matrix but the embedding table, of which it
    reads one row (unless the head is the tied table, read whole)."""
    p = runner.params
    if "lm_head" not in p:
        return _nbytes(p)
    return _nbytes(p) - _nbytes(p["embed"]) + p["embed"].shape[1] * p["embed"].dtype.itemsize


def gemv_chain_rate(runner: ModelRunner, fused: bool = False) -> float:
    """Tokens/s of one jitted program doing only a decode token's matrix-vector products over
    the runner's own weights (no attention, no per-layer calls): what XLA on this machine
    reaches for those bytes. `fused`: q/k/v and gate/up concatenated into one matrix each
    (fewer, wider products: the best layout tried here)."""
    p = runner.params
    head = p["lm_head"] if "lm_head" in p else p["embed"].T
    layers = p["layers"]
    if fused:
        cat = jax.numpy.concatenate
        layers = [{"qkv": cat([w["wq"], w["wk"], w["wv"]], 1), "wo": w["wo"],
                   "gate_up": cat([w["w_gate"], w["w_up"]], 1), "w_down": w["w_down"]}
                  for w in layers]

    @jax.jit
    def chain(x, layers, head):
        for w in layers:
            if fused:
                qkv = x @ w["qkv"]
                q, kv_sum = qkv[:, :w["wo"].shape[0]], qkv[:, w["wo"].shape[0]:].sum()
            else:
                q, k, v = x @ w["wq"], x @ w["wk"], x @ w["wv"]
                kv_sum = k.sum() + v.sum()
            x = x + (q + 0 * kv_sum) @ w["wo"]
            if fused:
                gate_up = x @ w["gate_up"]
                half = gate_up.shape[1] // 2
                x = x + (jax.nn.silu(gate_up[:, :half]) * gate_up[:, half:]) @ w["w_down"]
            else:
                x = x + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]
        return x @ head

    x = jax.numpy.ones((1, p["embed"].shape[1]), p["embed"].dtype)
    chain(x, layers, head).block_until_ready()
    return 1 / min(_timed(lambda: chain(x, layers, head).block_until_ready())
                   for _ in range(5))


def main(argv: list[str]) -> int:
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    cfg = compose_config(DEFAULTS + argv)
    ctx = direct_process_context(cfg)
    t0 = time.perf_counter()
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    s = Scheduler(ctx, runner, load_tokenizer(cfg.model))
    runner.warmup()
    s.warmup()
    rng = random.Random(0)
    # a first pass of every workload below compiles what warmup missed
    run(s, [make(i, 64, 1, rng) for i in range(16)])
    for overlap in (False, True):
        decode_rate(s, 1, 8, rng, overlap)
        decode_rate(s, 16, 8, rng, overlap)
    mixed = [make(i, rng.randrange(4, 120), rng.randrange(4, 40), rng) for i in range(32)]
    run(s, mixed, [rng.randrange(0, 60) for _ in mixed])
    limit = read_bandwidth() / decode_read_bytes(runner)  # before the count: these compile
    ceiling = gemv_chain_rate(runner)
    fused_ceiling = gemv_chain_rate(runner, fused=True)
    warm_s = time.perf_counter() - t0
    base_compiles, base_shapes = _compiles[0], runner.compile_count()

    prefill_reqs = [make(i, 64, 1, rng) for i in range(32)]
    dt = run(s, prefill_reqs)
    prefill_tps = sum(len(r.prompt_ids) for r in prefill_reqs) / dt
    d1 = decode_rate(s, 1, 64, rng)
    d16 = decode_rate(s, 16, 64, rng)
    o1 = decode_rate(s, 1, 64, rng, overlap=True)
    o16 = decode_rate(s, 16, 64, rng, overlap=True)
    s.overlap = bool(cfg.engine.overlap_schedule)

    mark = _compiles[0], runner.compile_count()
    mixed = [make(i, rng.randrange(4, 120), rng.randrange(4, 40), rng) for i in range(48)]
    mixed_dt = run(s, mixed, [rng.randrange(0, 80) for _ in mixed])
    mixed_tokens = sum(len(r.output_ids) for r in mixed)
    st = s.stats()
    assert st["free_pages"] + st["tree_pages"] == st["total_pages"], st  # nothing leaked

    m = cfg.model
    print(f"engine benchmark: {m.name} layers={m.num_layers} hidden={m.hidden_size} "
          f"backend={jax.default_backend()} pages={runner.num_pages}x{runner.page_size} "
          f"(setup+warmup {warm_s:.1f}s)")
    print(f"  prefill (32 x 64-token prompts) : {prefill_tps:10.1f} tokens/s")
    print(f"  decode batch 1   (baseline)     : {d1:10.1f} tokens/s")
    print(f"  decode batch 16                 : {d16:10.1f} tokens/s   "
          f"({d16 / d1:.1f}x batch 1)")
    print(f"  overlap scheduling, batch 1     : {o1:10.1f} tokens/s   ({o1 / d1:.2f}x the "
          f"synchronous loop)")
    print(f"  overlap scheduling, batch 16    : {o16:10.1f} tokens/s   ({o16 / d16:.2f}x the "
          f"synchronous loop; goal 1.2x)")
    best1 = max(d1, o1)
    print(f"  batch-1 decode vs memory-read limit: {best1:.1f} / {limit:.1f} tokens/s = "
          f"{best1 / limit:.2f}x (goal 0.9x; {decode_read_bytes(runner) / 2**20:.1f} MiB of "
          f"weights read per token)")
    print(f"    the same weights' products alone, one jitted program: {ceiling:.1f} tokens/s = "
          f"{ceiling / limit:.2f}x the limit (XLA's ceiling here); the engine "
          f"{best1 / ceiling:.2f}x of it")
    print(f"    with q/k/v and gate/up fused into one matrix each: {fused_ceiling:.1f} tokens/s = "
          f"{fused_ceiling / limit:.2f}x the limit")
    print(f"  mixed workload (48 reqs, staggered arrivals): {mixed_tokens} tokens in "
          f"{mixed_dt:.2f}s, {s.num_preemptions} preemptions")
    print(f"  compilations after warmup: {_compiles[0] - base_compiles} XLA programs "
          f"({runner.compile_count() - base_shapes} new step shapes); during the steady mixed "
          f"workload: {_compiles[0] - mark[0]} (goal 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
