"""Step inputs: every batch the scheduler can produce maps onto the warmed shape grid, the flat
layout's work items cover each (token, context block) pair exactly once, and a real engine
serving a mixed workload after warmup compiles nothing."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import jax
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, SeqChunk
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.engine.step_inputs import (
    WORK_FIELDS,
    StepGeometry,
    prepare_step,
    shape_grid,
)
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.settings import direct_process_context
from tests.support.e2e import baseline_problems


class Chunk(NamedTuple):
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]


def _chunk(rng: random.Random, n_tokens: int, start: int, ps: int) -> Chunk:
    pages = math.ceil((start + n_tokens) / ps)
    return Chunk([1] * n_tokens, start, rng.sample(range(1, 4096), pages))


def _scheduler_like_batches(g: StepGeometry, max_len: int, max_running: int, seed: int):
    """What Scheduler.schedule can emit: decode batches of running requests, and prefill
    batches within the token budget where only the first request may continue a chunk."""
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, max_running)
        yield [_chunk(rng, 1, rng.randint(0, max_len - 1), g.page_size) for _ in range(n)]
        budget, batch = g.max_prefill_tokens, []
        if rng.random() < 0.5:  # a long prompt continuing where the last step's budget ended
            start = rng.randint(1, max_len - 2)
            take = rng.randint(1, min(budget, max_len - start))
            batch.append(_chunk(rng, take, start, g.page_size))
            budget -= take
        while budget > 0 and len(batch) < max_running and rng.random() < 0.8:
            take = rng.randint(1, min(budget, max_len))
            batch.append(_chunk(rng, take, 0, g.page_size))
            budget -= take
        if batch and not all(len(c.token_ids) == 1 for c in batch):
            yield batch


@pytest.mark.parametrize("page_size,max_len,max_running,max_prefill", [
    (16, 1024, 32, 1024), (4, 64, 8, 64), (16, 256, 16, 256), (8, 512, 5, 100)])
def test_scheduler_batches_stay_inside_the_warmed_grid(page_size, max_len, max_running,
                                                       max_prefill):
    g = StepGeometry(page_size=page_size, max_pages=math.ceil(max_len / page_size),
                     max_rows=1 << (max_running - 1).bit_length(),
                     max_prefill_tokens=max_prefill)
    grid = shape_grid(g)
    # decode: one shape per batch bucket; prefill: one per token bucket
    assert len(grid) == (g.max_rows.bit_length()
                         + sum(1 for t in range(1, 12) if (1 << t) <= 2 * max_prefill - 1))
    seen = set()
    for batch in _scheduler_like_batches(g, max_len, max_running, seed=page_size):
        key = prepare_step(batch, g).key
        assert key in grid, (key, [(len(c.token_ids), c.start_pos) for c in batch])
        seen.add(key)
    assert len(seen) > len(grid) // 2  # the random batches exercised much of the grid


def test_oversized_batch_falls_back_to_a_bigger_shape():
    g = StepGeometry(page_size=4, max_pages=4, max_rows=2, max_prefill_tokens=8,
                     block_tokens=8)
    grid = shape_grid(g)
    long_ctx = [Chunk([1], 40, list(range(1, 12)))]  # beyond max_pages: still prepared
    step = prepare_step(long_ctx, g)
    assert step.key not in grid and step.md.page_table.shape == (1, 16)
    big_prefill = [Chunk([1] * 30, 0, list(range(1, 9))), Chunk([1] * 3, 0, [9])]
    step = prepare_step(big_prefill, g)  # over max_prefill_tokens
    assert step.key not in grid and step.key[:2] == ("flat", 64)


def test_flat_work_items_cover_each_visible_block_once():
    rng = random.Random(3)
    g = StepGeometry(page_size=4, max_pages=32, max_rows=8, max_prefill_tokens=64,
                     block_tokens=8)  # 2 pages per block, 8-row query tiles
    span = g.tile_tokens
    for _ in range(50):
        chunks = [_chunk(rng, rng.randint(2, 20), rng.choice([0, 0, rng.randint(1, 60)]), 4)
                  for _ in range(rng.randint(1, 4))]
        step = prepare_step(chunks, g)
        assert step.key[0] == "flat"
        work = step.md.work[:, :int(step.md.num_work[0])]
        covered = {}
        for block, row, rows, qpos, kpos in work.T:
            for r in range(rows):
                covered[(row + r, block)] = qpos + r >= kpos  # does the mask keep anything?
            assert kpos <= qpos + rows - 1  # no item is entirely in the causal future
        assert len(covered) == sum(int(x) for x in work[2])  # no (row, block) pair twice
        # each token must see exactly the blocks of its own sequence up to its own position
        expect, cu, at = set(), 0, 0
        for c in chunks:
            blocks = math.ceil(math.ceil((c.start_pos + len(c.token_ids)) / 4) / 2)
            for j in range(len(c.token_ids)):
                for b in range((c.start_pos + j) // span + 1):
                    expect.add((cu + j, at + b))
            cu += len(c.token_ids)
            at += blocks
        assert {pair for pair, visible in covered.items() if visible} == expect
        # the context list holds each sequence's pages from the start of its first block
        pages = step.md.ctx_pages
        at = 0
        for c in chunks:
            need = math.ceil((c.start_pos + len(c.token_ids)) / 4)
            assert list(pages[at * 2:at * 2 + need]) == list(c.page_ids[:need])
            at += math.ceil(need / 2)
    assert WORK_FIELDS == ("block", "row", "rows", "qpos", "kpos")


@pytest.mark.slow
def test_engine_compiles_nothing_while_serving_a_mixed_workload():
    """Warmup (runner + sampler) then staggered prompts of many lengths, chunked prefill and
    preemption: no step shape and no XLA program is compiled while serving."""
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "engine.page_size=8", "engine.num_pages=24",
                          "engine.max_model_len=128", "engine.max_running_requests=6",
                          "engine.max_prefill_tokens=48"])
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    sched = Scheduler(direct_process_context(cfg), runner, load_tokenizer(cfg.model))
    runner.warmup()
    sched.warmup()
    assert runner.compiled_keys() == runner.shape_grid()
    compiles = []

    def on_event(event: str, duration: float, **_kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    rng = random.Random(0)
    reqs = [Req(rid=f"m{i}", prompt_ids=[256] + [rng.randrange(1, 255)
                                                  for _ in range(rng.randrange(0, 68))],
                sink=QueueSink(),
                sampling=SamplingParams(max_new_tokens=rng.randrange(1, 60), ignore_eos=True,
                                        temperature=rng.choice([0.0, 0.8]), seed=i))
            for i in range(24)]
    arrivals = sorted((rng.randrange(0, 40), i) for i in range(len(reqs)))
    try:
        step = 0
        while arrivals or sched.has_work() or not sched.inbox.empty():
            while arrivals and arrivals[0][0] <= step:
                sched.submit(reqs[arrivals.pop(0)[1]])
            sched.drain_inbox()
            batch = sched.schedule()
            if batch is not None:
                sched.run_batch(batch)
            step += 1
            assert step < 5000
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    for r in reqs:
        ids, last = r.sink.collect(timeout=5)
        assert last.finish_reason["type"] == "length", last.finish_reason
        assert len(ids) == r.sampling.max_new_tokens
    assert sched.num_preemptions > 0  # the pool is small on purpose
    st = sched.stats()
    assert not baseline_problems(st), baseline_problems(st)
    assert runner.compiled_keys() == runner.shape_grid()
    assert compiles == [], f"{len(compiles)} XLA compilations while serving"


def test_a_runner_warmed_without_decode_runs_one_token_chunks_flat():
    """P warms no decode shapes, so a batch of one-token chunks (a prompt cached but for its
    last token, a one-token prompt) runs in the flat layout: nothing new compiles, and the
    logits equal the decode layout's."""
    g = StepGeometry(page_size=4, max_pages=8, max_rows=4, max_prefill_tokens=16)
    flat_only = StepGeometry(page_size=4, max_pages=8, max_rows=4, max_prefill_tokens=16,
                             decode_layout=False)
    chunks = [Chunk([5], 3, [1]), Chunk([6], 0, [2])]
    assert prepare_step(chunks, g).key[0] == "decode"
    assert prepare_step(chunks, flat_only).key[0] == "flat"
    one = prepare_step([Chunk([5], 3, [1])], flat_only).key  # a single one-token chunk
    assert one[:2] == ("flat", 1)
    assert shape_grid(flat_only, decode=False) == shape_grid(g, decode=False) | {one}

    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "engine.page_size=4", "engine.num_pages=16",
                          "engine.max_model_len=32", "engine.max_running_requests=4",
                          "engine.max_prefill_tokens=16"])
    both = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    prefill_only = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    prefill_only.warmup(decode=False)
    warmed = prefill_only.compiled_keys()
    prompt = [SeqChunk([7, 8, 9], 0, [1]), SeqChunk([10, 11], 0, [2])]
    step = [SeqChunk([12], 3, [1]), SeqChunk([13], 2, [2])]
    for runner in (both, prefill_only):
        runner.forward(prompt)
    want = both.forward(step)
    got = prefill_only.forward(step)
    want_one = both.forward([SeqChunk([14], 3, [3])])
    got_one = prefill_only.forward([SeqChunk([14], 3, [3])])
    assert prefill_only.compiled_keys() == warmed
    assert jax.numpy.allclose(got_one, want_one, atol=1e-5)
    assert all(k[0] == "flat" for k in warmed)
    assert jax.numpy.allclose(got, want, atol=1e-5)
