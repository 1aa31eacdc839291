"""The scheduler with the real ModelRunner (tiny model): batching invariance of greedy and seeded
outputs, preemption + recompute giving identical streams, the pool back at baseline."""

from __future__ import annotations

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
    cfg = compose_config(["model.num_layers=2", "engine.page_size=4", "engine.num_pages=30",
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
