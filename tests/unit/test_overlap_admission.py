"""The overlapped loop's admission test (`Scheduler.can_admit`, `KVPages.admits`) against the
scheduler's own admission, with a fake runner: it says yes exactly when `schedule()` starts a
waiting request's prompt, and changes nothing (no page matched, evicted or taken). The
overlapped loop itself is tested with the real runner (tests/e2e/test_scheduler_runner.py)."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np

from pdtopo.runtime.engine.batch import sampler_row
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.sampling import Sampler
from pdtopo.runtime.engine.scheduler import Scheduler
from tests.support.e2e import baseline_problems
from tests.support.scheduler_fakes import FakeRunner, FakeTokenizer, make_ctx


def state(s: Scheduler) -> tuple:
    head = s.waiting[0] if s.waiting else None
    cache = s.prefix_cache
    return (s.allocator.version, s.allocator.num_free, s.allocator.used_pages(),
            cache.num_pages, cache.num_evicted,
            sorted((id(n), n.last_used) for n in cache._nodes()),
            head and (list(head.page_ids), head.num_computed), len(s.waiting), len(s.running))


def test_can_admit_is_schedules_answer_without_its_side_effects():
    """Rows (max_running_requests), pages with the reserve for the running requests, a cached
    prefix that makes a prompt fit, pages only the prefix cache holds counted as free: at every
    step of a workload on a small pool, can_admit() says whether schedule() starts a prompt."""
    rng = random.Random(4)
    s = Scheduler(make_ctx(max_running_requests=4, mixed_steps=False, max_prefill_tokens=64),
                  FakeRunner(num_pages=20, page_size=4), FakeTokenizer())
    assert s.prefix_cache is not None
    shared = [[2 + (7 * j + k) % 60 for j in range(12)] for k in range(3)]
    pending = []
    for i in range(24):  # prompts that share one of three 12-token prefixes, or not
        base = shared[i % 3] if i % 4 else []
        prompt = base + [2 + rng.randrange(60) for _ in range(rng.randrange(1, 10))]
        params = SamplingParams(max_new_tokens=rng.randrange(3, 24), temperature=0.0,
                                ignore_eos=True)
        pending.append(Req(rid=f"a{i}", prompt_ids=prompt, sampling=params, sink=QueueSink()))
    seen = {"yes": 0, "no rows": 0, "no pages": 0}
    for step in range(2000):
        if pending and step % 3 == 0:
            for _ in range(rng.randrange(1, 4)):
                if pending:
                    s.submit(pending.pop(0))
        s.drain_inbox()
        before = state(s)
        said = s.can_admit()
        assert state(s) == before  # nothing matched, evicted, taken or touched
        batch = s.schedule()
        assert said == (batch is not None and batch.kind == "prefill"), (step, said, batch)
        if said:
            seen["yes"] += 1
        elif s.waiting:
            seen["no rows" if len(s.running) >= s.max_running else "no pages"] += 1
        if batch is None:
            if not pending:
                break
            continue
        s.run_batch(batch)
    else:
        raise AssertionError("the workload did not finish")
    assert all(seen.values()), seen
    assert s.num_cached_tokens > 0 and s.prefix_cache.num_evicted > 0
    s.publish_stats()
    assert not baseline_problems(s.stats())


def test_can_admit_counts_the_requests_that_end_on_their_pending_token():
    s = Scheduler(make_ctx(max_running_requests=2, mixed_steps=False), FakeRunner(64, 4),
                  FakeTokenizer())
    for i in range(3):
        params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
        s.submit(Req(rid=f"b{i}", prompt_ids=[3 + i] * 5, sampling=params, sink=QueueSink()))
    s.drain_inbox()
    s.run_batch(s.schedule())  # two admitted, one waits for a row
    assert len(s.running) == 2 and len(s.waiting) == 1
    assert not s.can_admit() and s.can_admit(leaving=1)


def test_penalty_counts_on_the_device_are_known_to_the_sampler():
    """`Sampler.has_counts`: a penalised request's counts live on the device from its first
    sampled row until its slot is released (the overlapped loop continues only such rows)."""
    sampler = Sampler(penalty_slots=2)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
    req = Req(rid="p", prompt_ids=[3, 4], sampling=SamplingParams(
        max_new_tokens=4, temperature=0.0, presence_penalty=0.5), sink=QueueSink())
    assert not sampler.has_counts(req.serial)
    sampler.dispatch(logits, [sampler_row(req)]).result()
    assert sampler.has_counts(req.serial)
    sampler.release(req.serial)
    assert not sampler.has_counts(req.serial)
