"""The scheduler's prefix cache against the fake runner (which reads every sequence back through
the page table, and here refuses any write into a page the cache shares): hits for shared
prefixes of 0 / less than one / one / many pages, a fully cached prompt still computing its last
token, two requests with the same new prefix in one batch, eviction before preemption, aborts and
failures never caching or freeing a shared page, /flush_cache's semantics, the cache off, and a
1,000-request soak checking every page's references after every step."""

from __future__ import annotations

import random

from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.engine.stats import token_usage
from tests.support.e2e import baseline_problems
from tests.support.scheduler_fakes import (
    FakeRunner,
    FakeTokenizer,
    make_ctx,
    reference,
    run_until_idle,
)

PS = 4


def make(num_pages=64, fail_on=None, **engine):
    holder = {}
    runner = FakeRunner(num_pages=num_pages, page_size=PS, fail_on=fail_on,
                        read_only=lambda page: page in holder["s"].prefix_cache.pages())
    s = Scheduler(make_ctx(page_size=PS, **engine), runner, FakeTokenizer())
    holder["s"] = s
    return s, runner


def mk(rid, prompt, n=6):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, prompt_ids=list(prompt), sampling=sp, sink=QueueSink())


def _consistent(s: Scheduler) -> None:
    assert s.page_problems() == []


def step_until_idle(s: Scheduler, max_steps=20000) -> None:
    run_until_idle(s, max_steps, after_step=_consistent)


def outputs(req: Req):
    ids, last = [], None
    while not req.sink.queue.empty():
        out = req.sink.queue.get_nowait()
        ids.extend(out.new_token_ids)
        last = out
    return ids, last


def serve(s: Scheduler, reqs: list[Req]):
    for r in reqs:
        s.submit(r)
    step_until_idle(s)
    return [outputs(r) for r in reqs]


def assert_baseline(s: Scheduler) -> None:
    st = s.stats()
    assert not baseline_problems(st), baseline_problems(st)
    assert s.page_problems() == []


SYSTEM = [10 + (i * 7) % 50 for i in range(40)]  # 10 full pages of shared context


def test_shared_prefixes_of_every_size_hit_and_give_the_uncached_tokens():
    # (first prompt, second prompt, cached tokens expected for the second)
    cases = {
        "none": ([5, 6, 7, 8, 9], [11, 6, 7, 8, 9], 0),
        "under a page": ([5, 6, 7, 8, 9], [5, 6, 7, 30, 31], 0),
        "one page": ([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 40, 41, 42], 4),
        "many pages": (SYSTEM + [3, 4], SYSTEM + [5, 6, 7, 8, 9], 40),
    }
    for name, (first, second, cached) in cases.items():
        s, runner = make()
        (ids1, last1), = serve(s, [mk("a", first)])
        (ids2, last2), = serve(s, [mk("b", second)])
        assert ids1 == reference(first, 6) and ids2 == reference(second, 6), name
        assert last1.cached_tokens == 0 and last2.cached_tokens == cached, name
        # the second prefill computed only what was not cached
        prefill = [c for c in runner.calls if any(len(x.token_ids) > 1 for x in c)][-1]
        assert prefill[0].start_pos == cached, name
        assert s.stats()["cached_tokens"] == cached, name
        assert_baseline(s)


def test_a_prompt_made_of_cached_pages_recomputes_its_last_token():
    s, runner = make()
    prompt = SYSTEM[:16]  # exactly 4 full pages
    (ids1, _), = serve(s, [mk("a", prompt)])
    n_calls = len(runner.calls)
    (ids2, last2), = serve(s, [mk("b", prompt)])
    assert ids1 == ids2 == reference(prompt, 6)
    # 3 pages reused; the 4th (with the last token) recomputed into a private page
    assert last2.cached_tokens == 12
    first_chunk = runner.calls[n_calls][0]
    assert first_chunk.start_pos == 12 and first_chunk.token_ids == prompt[12:]
    assert_baseline(s)


def test_two_requests_with_the_same_new_prefix_in_one_batch_compute_it_twice():
    s, runner = make(max_prefill_tokens=128)
    a, b = mk("a", SYSTEM + [1, 2]), mk("b", SYSTEM + [3, 4])
    (ids_a, last_a), (ids_b, last_b) = serve(s, [a, b])
    assert ids_a == reference(a.prompt_ids, 6) and ids_b == reference(b.prompt_ids, 6)
    assert last_a.cached_tokens == last_b.cached_tokens == 0
    assert len(runner.calls[0]) == 2  # one prefill batch held both
    # the first to finish gave the tree its pages; the second's duplicates were freed
    # (each computed 42 + 5 tokens: 11 full pages; the first 10 are the shared system prompt)
    assert s.prefix_cache.num_pages == 10 + 1 + 1
    assert_baseline(s)
    (ids_c, last_c), = serve(s, [mk("c", SYSTEM + [3, 4, 9])])
    assert last_c.cached_tokens == len(SYSTEM) and ids_c == reference(SYSTEM + [3, 4, 9], 6)


def test_the_cache_gives_way_before_any_request_is_preempted():
    s, _ = make(num_pages=17, max_running_requests=2)  # 16 usable pages
    for i in range(6):  # distinct prompts: the tree fills the pool with old pages
        (ids, _), = serve(s, [mk(f"w{i}", [20 + i] * 13, n=3)])
        assert ids == reference([20 + i] * 13, 3)
    assert s.prefix_cache.num_pages > 8
    # 7 pages each, 14 of the 16: they fit once the tree gives its pages back
    reqs = [mk("x", [50] * 16, n=12), mk("y", [51] * 16, n=12)]
    results = serve(s, reqs)
    assert [r[0] for r in results] == [reference(r.prompt_ids, 12) for r in reqs]
    assert s.num_preemptions == 0
    assert_baseline(s)


def test_preemption_keeps_shared_pages_and_recompute_reuses_the_victims_own_pages():
    s, _ = make(num_pages=13, max_running_requests=3)  # 12 usable pages
    shared = SYSTEM[:8]
    reqs = [mk(f"r{i}", shared + [30 + i], n=14) for i in range(3)]
    results = serve(s, reqs)
    assert s.num_preemptions > 0
    assert [r[0] for r in results] == [reference(r.prompt_ids, 14) for r in reqs]
    # what a client is told was cached stays within its prompt (a recompute after preemption
    # may reuse the request's own output pages too)
    assert all(last.cached_tokens <= len(r.prompt_ids) for r, (_, last) in zip(
        reqs, results, strict=True))
    assert_baseline(s)


def test_aborts_and_failures_neither_cache_nor_free_shared_pages():
    s, _ = make(fail_on=0)  # token 0: never an output of the fake model
    serve(s, [mk("warm", SYSTEM + [1])])
    tree_before = s.prefix_cache.pages()
    doomed = mk("bad", SYSTEM + [0, 2, 3, 4, 5])  # matches 10 pages, then its forward fails
    (_, last_bad), = serve(s, [doomed])
    aborted = mk("gone", SYSTEM + [7, 8, 9, 10, 11, 12], n=12)
    s.submit(aborted)
    for _ in range(3):  # prefill, decode a little, then the client leaves
        s.drain_inbox()
        s.run_batch(s.schedule())
        assert s.page_problems() == []
    s.abort("gone")
    step_until_idle(s)
    _, last_gone = outputs(aborted)
    assert last_bad.finish_reason["type"] == "abort" and "injected" in last_bad.finish_reason["message"]
    assert last_gone.finish_reason["status_code"] == 499
    assert s.prefix_cache.pages() == tree_before  # shared pages kept, nothing new cached
    assert_baseline(s)
    (ids, last), = serve(s, [mk("after", SYSTEM + [1, 5])])
    assert ids == reference(SYSTEM + [1, 5], 6) and last.cached_tokens == len(SYSTEM)


def test_flush_frees_what_no_request_holds_and_the_rest_after_it_finishes():
    s, _ = make()
    serve(s, [mk("a", SYSTEM + [1])])
    held = mk("b", SYSTEM + [2], n=12)
    s.submit(held)
    for _ in range(2):
        s.drain_inbox()
        s.run_batch(s.schedule())
    s.flush_cache()
    s.drain_inbox()
    result = s._flush_cache()  # the inbox message above ran the same flush already
    assert result["flushed_pages"] == 0 and result["tree_pages"] == len(SYSTEM) // PS
    step_until_idle(s)
    fut = s.flush_cache()
    s.drain_inbox()
    out = fut.result(timeout=1)
    assert out["flushed_pages"] > 0 and out["tree_pages"] == 0
    st = s.stats() if s.publish_stats() is None else None
    assert st["free_pages"] == st["total_pages"] and st["tree_pages"] == 0
    assert_baseline(s)


def test_token_usage_counts_what_requests_hold_not_the_cache():
    """sglang:token_usage (what routers compare with their overload ceilings) leaves out the
    pages only the cache holds; pages a running request shares with the cache count."""
    s, _ = make()
    serve(s, [mk("a", SYSTEM + [1])])
    s.publish_stats()
    st = s.stats()
    assert st["tree_pages"] > 0 and st["evictable_pages"] == st["tree_pages"]
    assert token_usage(st) == 0.0
    assert s.metrics.token_usage._value.get() == 0.0
    held = mk("b", SYSTEM + [2], n=12)
    s.submit(held)
    s.drain_inbox()
    s.run_batch(s.schedule())
    s._evictable = (-1e9, 0)  # recount now, not EVICTABLE_REFRESH_S later
    s.publish_stats()
    st = s.stats()
    shared = len(SYSTEM) // PS  # b matched every full page of the system prompt
    assert st["evictable_pages"] == st["tree_pages"] - shared
    used = st["total_pages"] - st["free_pages"] - st["evictable_pages"]
    assert used == len(held.page_ids) and token_usage(st) == used / st["total_pages"]
    step_until_idle(s)
    assert_baseline(s)


def test_cache_off_is_todays_engine():
    s, runner = make(prefix_cache=False)
    assert s.prefix_cache is None
    results = serve(s, [mk("a", SYSTEM + [1])])
    results += serve(s, [mk("b", SYSTEM + [2])])
    assert [r[1].cached_tokens for r in results] == [0, 0]
    st = s.stats()
    assert st["free_pages"] == st["total_pages"] and st["tree_pages"] == 0
    assert s.page_problems() == []


def test_soak_1000_requests_with_eviction_aborts_and_failures():
    rng = random.Random(7)
    s, _ = make(num_pages=25, max_running_requests=6, max_prefill_tokens=48, fail_on=0)
    systems = [[12 + (k * 13 + i) % 45 for i in range(rng.choice([4, 9, 16, 24]))]
               for k in range(5)]
    reqs, aborted = [], set()
    for i in range(1000):
        prompt = rng.choice(systems) + [rng.randrange(2, 61) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.03:
            prompt.insert(rng.randrange(len(prompt)), 0)  # a failing forward
        reqs.append(mk(f"q{i}", prompt, n=rng.randrange(1, 20)))
    pending = list(reqs)
    steps = 0
    while pending or s.has_work():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                s.submit(pending.pop(0))
        if rng.random() < 0.05 and s.reqs:
            rid = rng.choice(sorted(s.reqs))
            aborted.add(rid)
            s.abort(rid)
        s.drain_inbox()
        batch = s.schedule()
        if batch is not None:
            s.run_batch(batch)
        problems = s.page_problems()
        assert problems == [], (steps, problems)
        steps += 1
        assert steps < 50000
    s.publish_stats()
    ok = failed = 0
    for r in reqs:
        ids, last = outputs(r)
        assert last is not None and last.finished, r
        reason = last.finish_reason
        if 0 in r.prompt_ids:
            assert reason["type"] == "abort", r
        if reason["type"] == "abort":  # the client's abort, or a failed batch (all its requests)
            assert ((r.rid in aborted and reason["status_code"] == 499)
                    or "injected forward failure" in reason["message"]), (r, reason)
            failed += 1
        else:
            assert ids == reference(r.prompt_ids, r.sampling.max_new_tokens), r
            ok += 1
    st = s.stats()
    print(f"soak: ok={ok} failed={failed} preemptions={s.num_preemptions} "
          f"cached_tokens={st['cached_tokens']} evicted_pages={st['evicted_pages']}")
    assert ok > 800 and failed > 10
    assert s.num_preemptions > 0 and st["evicted_pages"] > 100  # real pressure
    assert s.stats()["cached_tokens"] > 0 and s.prefix_cache.num_pages > 0
    assert_baseline(s)
    fut = s.flush_cache()
    s.drain_inbox()
    fut.result(timeout=1)
    s.publish_stats()
    st = s.stats()
    assert st["free_pages"] == st["total_pages"] and st["tree_pages"] == 0  # 0 leaked
