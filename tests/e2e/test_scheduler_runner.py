"""The scheduler with the real ModelRunner (tiny model): batching invariance of greedy and seeded
outputs, preemption + recompute giving identical streams, the pool back at baseline."""

from __future__ import annotations

import numpy as np
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.settings import direct_process_context
from tests.support.e2e import baseline_problems

pytestmark = pytest.mark.slow  # real model runners behind real schedulers

PROMPT_LENS = [3, 11, 1, 25, 7, 14, 2, 17]
NEW = 16


@pytest.fixture(scope="module")
def sched():
    # 29 usable pages of 4 tokens: the 8 requests together need 56 -> preemption in the batch run
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "engine.page_size=4", "engine.num_pages=30",
                          "engine.max_model_len=64", "engine.max_running_requests=8",
                          "engine.max_prefill_tokens=64"])
    ctx = direct_process_context(cfg)
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    return Scheduler(ctx, runner, load_tokenizer(cfg.model))


def prompts():
    return [[256] + [(7 * i + 3 * j) % 250 + 1 for j in range(n)]
            for i, n in enumerate(PROMPT_LENS)]


def run(s: Scheduler, reqs: list[Req]) -> dict[str, list[int]]:
    for r in reqs:
        s.submit(r)
    for _ in range(2000):
        s.drain_inbox()
        batch = s.schedule()
        if batch is None:
            break
        s.run_batch(batch)
    s.publish_stats()
    out = {}
    for r in reqs:
        ids, last = r.sink.collect(timeout=1)
        assert last.finish_reason["type"] == "length", last.finish_reason
        out[r.rid] = ids
    st = s.stats()
    assert not baseline_problems(st) and st["num_reqs"] == 0, baseline_problems(st)
    return out


def make(i, p, **sp):
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, **sp)
    return Req(rid=f"r{i}", prompt_ids=p, sampling=params, sink=QueueSink())


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_batching_invariance_with_preemption(sched, sp):
    alone = {}
    for i, p in enumerate(prompts()):
        alone.update(run(sched, [make(i, p, **sp)]))
    pre = sched.num_preemptions
    together = run(sched, [make(i, p, **sp) for i, p in enumerate(prompts())])
    assert sched.num_preemptions > pre  # the small pool forced recomputation
    assert together == alone


def run_stepped(s: Scheduler, reqs: list[Req], late: list[Req] = ()) -> dict[str, tuple]:
    """The serving loop's own `step()` (overlap scheduling when `s.overlap`); `late` requests
    arrive after 5 steps, while decode steps are in flight."""
    for r in reqs:
        s.submit(r)
    steps = 0
    while s.has_work() or not s.inbox.empty() or (late and steps <= 5):
        if steps == 5:
            for r in late:
                s.submit(r)
        s.step()
        steps += 1
        assert steps < 3000
    s.publish_stats()
    out = {}
    for r in [*reqs, *late]:
        ids, last = r.sink.collect(timeout=1)
        out[r.rid] = (ids, last.finish_reason, [(lp.logprob, lp.top) for lp in
                                                r.output_logprobs])
    st = s.stats()
    assert not baseline_problems(st) and st["num_reqs"] == 0, baseline_problems(st)
    return out


@pytest.mark.parametrize("sp", [dict(temperature=0.0, logprobs=3),
                                dict(temperature=1.0, top_k=20, seed=5, logprobs=0)],
                         ids=["greedy", "seeded"])
def test_overlap_schedule_gives_the_synchronous_outputs(sched, sp):
    """Steps dispatched ahead of landing the previous one: the same tokens, finish reasons and
    logprobs as the synchronous loop, with requests of different lengths, one that stops on a
    token mid-way (its extra token computed ahead is dropped), late arrivals, and a pool small
    enough to preempt (continuations give way to the synchronous path there)."""
    def batch(stop: dict[int, int] | None = None) -> tuple[list[Req], list[Req]]:
        reqs = []
        for i, p in enumerate(prompts()):
            params = SamplingParams(max_new_tokens=6 + i, ignore_eos=True, **sp)
            if stop and i in stop:
                params.stop_token_ids = [stop[i]]
            reqs.append(Req(rid=f"o{i}", prompt_ids=p, sampling=params, sink=QueueSink()))
        return reqs[:5], reqs[5:]

    sched.overlap = False
    first = run_stepped(sched, *batch())
    stop = {1: first["o1"][0][3], 4: first["o4"][0][2]}  # tokens each request emits mid-way
    sched.overlap = False
    sync = run_stepped(sched, *batch(stop))
    assert sync["o1"][1]["type"] == "stop" and len(sync["o1"][0]) <= 4
    sched.overlap = True
    ahead_before = sched.num_overlapped_steps
    overlapped = run_stepped(sched, *batch(stop))
    assert sched.num_overlapped_steps > ahead_before + 10  # the overlap really ran
    assert {k: v[:2] for k, v in overlapped.items()} == {k: v[:2] for k, v in sync.items()}
    for rid, (_, _, lps) in sync.items():  # batch sizes differ: float rounding, not choices
        got = overlapped[rid][2]
        assert [[t for t, _ in top] for _, top in got] == [[t for t, _ in top] for _, top in lps]
        np.testing.assert_allclose([lp for lp, _ in got], [lp for lp, _ in lps], atol=1e-5)
