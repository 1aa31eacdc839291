"""Scheduler unit tests against a fake runner: admission, budgets, rejection, preemption,
abort, stop conditions, failures, and the pool returning to its baseline."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.scheduler_factory import make_scheduler
from tests.support.e2e import baseline_problems
from tests.support.scheduler_fakes import (
    EOS,
    FakeRunner,
    FakeTokenizer,
    make_ctx,
    reference,
    run_until_idle,
)


def mk(rid, prompt, n=8, **sp):
    sink = QueueSink()
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    for k, v in sp.items():
        setattr(params, k, v)
    return Req(rid=rid, prompt_ids=list(prompt), sampling=params, sink=sink), sink


def assert_baseline(s: Scheduler):
    st = s.stats()
    assert st["total_pages"] == s.allocator.num_total
    assert not baseline_problems(st), baseline_problems(st)
    assert st["num_running"] == st["num_waiting"] == st["num_reqs"] == 0
    assert s.page_problems() == []


def collect(sink):
    ids, last = [], None
    while not sink.queue.empty():
        out = sink.queue.get_nowait()
        ids.extend(out.new_token_ids)
        last = out
    return ids, last


def test_batched_outputs_match_reference_and_pool_returns():
    runner = FakeRunner(num_pages=64, page_size=4)
    s = Scheduler(make_ctx(), runner, FakeTokenizer())
    prompts = [[2 + (i * 7 + j) % 60 for j in range(3 + 2 * i)] for i in range(6)]
    sinks = []
    for i, p in enumerate(prompts):
        req, sink = mk(f"r{i}", p, n=5 + i)
        s.submit(req)
        sinks.append(sink)
    run_until_idle(s)
    for i, (p, sink) in enumerate(zip(prompts, sinks, strict=True)):
        ids, last = collect(sink)
        assert ids == reference(p, 5 + i)
        assert last.finished and last.finish_reason == {"type": "length", "length": 5 + i}
    # running capped at 4: the first prefill batch admits 4, decode batches never exceed 4
    assert max(len(c) for c in runner.calls) <= 4
    assert_baseline(s)


def test_prefill_token_budget_and_chunked_long_prompt():
    runner = FakeRunner(num_pages=64, page_size=4)
    s = Scheduler(make_ctx(max_prefill_tokens=8), runner, FakeTokenizer())
    long_prompt = [2 + (j % 50) for j in range(20)]
    req, sink = mk("long", long_prompt, n=3)
    s.submit(req)
    run_until_idle(s)
    assert collect(sink)[0] == reference(long_prompt, 3)
    prefill_sizes = [len(c[0].token_ids) for c in runner.calls[:3]]
    assert prefill_sizes == [8, 8, 4]
    assert [c[0].start_pos for c in runner.calls[:3]] == [0, 8, 16]
    assert all(sum(len(x.token_ids) for x in c) <= 8 for c in runner.calls)
    assert_baseline(s)


def test_a_chunk_that_does_not_end_its_prompt_samples_nothing_that_counts():
    """A penalised prompt in chunks: the chunks before its last sample a token nobody reads;
    it must not land in the request's penalty counts on the device (they hold its outputs
    only), nor build its slot from a half-computed prompt (Scheduler.batch_rows)."""
    runner = FakeRunner(num_pages=64, page_size=4)
    s = Scheduler(make_ctx(max_prefill_tokens=4), runner, FakeTokenizer())
    req, _ = mk("pen", [2 + (j % 50) for j in range(13)], n=5, frequency_penalty=0.5)
    s.submit(req)
    s.drain_inbox()
    while not req.output_ids:
        s.run_batch(s.schedule())
    assert len(runner.calls) == 4  # 4 + 4 + 4 + 1 prompt tokens
    tables = s.sampler.tables
    counts = np.asarray(tables.counts[tables._slot_of[req.serial]])
    assert counts.sum() == 1 and counts[req.output_ids[0]] == 1
    run_until_idle(s)
    assert_baseline(s)


def test_requests_that_can_never_fit_are_rejected_cleanly():
    s = Scheduler(make_ctx(max_model_len=64), FakeRunner(num_pages=5, page_size=4),
                  FakeTokenizer())  # 4 usable pages = 16 tokens
    assert "pool has 4" in s.check_fits(10, 10)
    assert "max_model_len=64" in s.check_fits(60, 10)
    assert "empty" in s.check_fits(0, 1)
    assert s.check_fits(8, 8) is None
    req, sink = mk("big", [3] * 10, n=10)
    s.submit(req)
    run_until_idle(s)
    _, last = collect(sink)
    assert last.finished and last.finish_reason["type"] == "abort"
    assert last.finish_reason["status_code"] == 400 and "pool has 4" in last.finish_reason["message"]
    assert_baseline(s)


def test_preemption_recomputes_and_keeps_outputs_identical():
    # 8 usable pages of 4 tokens; two requests of 4 + 12 tokens need 4 pages each at the end,
    # plus a third: the pool cannot hold all of them -> preemption + recompute.
    runner = FakeRunner(num_pages=9, page_size=4)
    s = Scheduler(make_ctx(), runner, FakeTokenizer())
    prompts = [[2 + i, 5, 7, 9 + i] for i in range(3)]
    sinks = []
    for i, p in enumerate(prompts):
        req, sink = mk(f"p{i}", p, n=12)
        s.submit(req)
        sinks.append(sink)
    run_until_idle(s)
    for p, sink in zip(prompts, sinks, strict=True):
        ids, last = collect(sink)
        assert ids == reference(p, 12)
        assert last.finish_reason["type"] == "length"
    assert s.num_preemptions > 0
    assert_baseline(s)


def test_out_of_pages_mid_decode_fails_cleanly_when_nothing_can_be_preempted():
    runner = FakeRunner(num_pages=9, page_size=4)
    s = Scheduler(make_ctx(), runner, FakeTokenizer())
    hog = s.allocator.alloc(6)  # pages held outside the scheduler's queues (e.g. a PD transfer)
    req, sink = mk("r", [3, 4, 5], n=10)
    s.submit(req)
    run_until_idle(s)
    ids, last = collect(sink)
    assert last.finish_reason["type"] == "abort" and "out of KV pages" in last.finish_reason["message"]
    assert ids == reference([3, 4, 5], len(ids)) and 0 < len(ids) < 10
    s.allocator.free(hog)
    s.publish_stats()
    assert_baseline(s)


def test_abort_frees_pages_of_waiting_and_running_requests():
    s = Scheduler(make_ctx(max_running_requests=1), FakeRunner(64, 4), FakeTokenizer())
    a, sa = mk("a", [3] * 6, n=50)
    b, sb = mk("b", [4] * 6, n=50)
    s.submit(a)
    s.submit(b)
    for _ in range(3):
        s.step()
    assert s.stats()["num_running"] == 1 and s.stats()["num_waiting"] == 1
    assert s.allocator.num_used > 0
    s.abort("a")
    s.abort("b")
    s.abort("unknown-rid")  # ignored
    s.step()
    for sink in (sa, sb):
        _, last = collect(sink)
        assert last.finish_reason["type"] == "abort" and last.finish_reason["status_code"] == 499
    s.publish_stats()
    assert_baseline(s)


def test_stop_conditions():
    s = Scheduler(make_ctx(), FakeRunner(64, 4), FakeTokenizer())
    prompt = [5, 6, 7]
    ref = reference(prompt, 10)
    cases = {
        "tok": dict(stop_token_ids=[ref[3]]),
        "eos": dict(ignore_eos=False),
        "str": dict(stop=[FakeTokenizer().decode(ref[4:6])]),
    }
    sinks = {}
    for name, sp in cases.items():
        req, sink = mk(name, prompt, n=10, **sp)
        s.submit(req)
        sinks[name] = sink
    run_until_idle(s)
    ids, last = collect(sinks["tok"])
    assert ids == ref[:ref.index(ref[3]) + 1]
    assert last.finish_reason == {"type": "stop", "matched": ref[3]}
    stop = FakeTokenizer().decode(ref[4:6])
    n = next(k for k in range(1, 11) if stop in FakeTokenizer().decode(ref[:k]))
    ids, last = collect(sinks["str"])
    assert ids == ref[:n] and last.finish_reason == {"type": "stop", "matched": stop}
    ids, last = collect(sinks["eos"])  # the fake model never emits EOS: runs to length
    assert EOS not in ids and last.finish_reason["type"] == "length"
    s.eos_ids = {ref[1]}
    req, sink = mk("eos2", prompt, n=10, ignore_eos=False)
    s.submit(req)
    run_until_idle(s)
    ids, last = collect(sink)
    assert ids == ref[:2] and last.finish_reason == {"type": "stop", "matched": ref[1]}
    assert_baseline(s)


def test_engine_error_fails_only_that_batch_and_loop_survives():
    runner = FakeRunner(64, 4, fail_on=63)
    s = Scheduler(make_ctx(), runner, FakeTokenizer())
    s.start()
    try:
        bad, sbad = mk("bad", [63, 3], n=4)
        s.submit(bad)
        _, last = sbad.collect(timeout=30)
        assert last.finish_reason["type"] == "abort" and "injected" in last.finish_reason["message"]
        good, sgood = mk("good", [3, 4], n=4)
        s.submit(good)
        ids, last = sgood.collect(timeout=30)
        assert ids == reference([3, 4], 4)
    finally:
        s.stop()
    assert not s._thread.is_alive()
    deadline = time.monotonic() + 5
    while s.stats()["num_reqs"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_baseline(s)


def test_duplicate_rid_is_refused_and_the_original_is_untouched():
    """A second request with a live rid gets a 400 naming the rid; the original stays the
    scheduler's: it completes with all its tokens, and its rid still aborts it."""
    s = Scheduler(make_ctx(max_running_requests=2), FakeRunner(64, 4), FakeTokenizer())
    a, sa = mk("same", [3, 4], n=20)
    b, sb = mk("same", [5, 6], n=20)
    s.submit(a)
    s.step()  # a is admitted and prefilled
    s.submit(b)
    s.abort("same", only=b)  # the duplicate's client leaves before it is refused
    s.step()
    _, last = collect(sb)
    assert last.finish_reason["status_code"] == 400
    assert "duplicate request id rid='same'" in last.finish_reason["message"]
    assert s.reqs.get("same") is a and not a.finished
    run_until_idle(s)
    ids, last = collect(sa)
    assert ids == reference([3, 4], 20) and last.finish_reason["type"] == "length"
    assert_baseline(s)
    # a later abort of the original (its client gone) still reaches it
    c, sc = mk("again", [3, 4], n=40)
    s.submit(c)
    s.step()
    d, sd = mk("again", [7], n=5)
    s.submit(d)
    s.step()
    assert collect(sd)[1].finish_reason["status_code"] == 400
    s.abort("again", only=c)
    s.step()
    ids, last = collect(sc)
    assert last.finish_reason["status_code"] == 499 and len(ids) < 40
    run_until_idle(s)
    assert_baseline(s)


def test_factory_roles():
    ctx = make_ctx()
    assert type(make_scheduler(ctx, FakeRunner(), FakeTokenizer())) is Scheduler
    from dataclasses import replace
    with pytest.raises(ValueError, match="role 'router'"):
        make_scheduler(replace(ctx, process={**ctx.process, "role": "router"}), FakeRunner(),
                       FakeTokenizer())


@pytest.mark.parametrize("mixed", [True, False])
def test_mixed_steps_keep_decodes_running_while_a_long_prompt_prefills(mixed):
    """With engine.mixed_steps, while more prompt tokens wait than one step's budget, every
    step carries the running decodes plus prompt chunks in the budget left (decodes count
    against engine.max_prefill_tokens); without, the prompt's chunks run alone and the decodes
    wait. Tokens equal the reference either way."""
    runner = FakeRunner(num_pages=64, page_size=4)
    s = Scheduler(make_ctx(max_prefill_tokens=8, mixed_steps=mixed), runner, FakeTokenizer())
    short = [[3, 4, 5], [6, 7]]
    long_prompt = [2 + (j % 50) for j in range(30)]
    sinks = []
    for i, p in enumerate(short):
        req, sink = mk(f"s{i}", p, n=12)
        s.submit(req)
        sinks.append(sink)
    s.drain_inbox()
    s.run_batch(s.schedule())  # both short prompts prefill together and start decoding
    assert len(s.running) == 2
    req, long_sink = mk("long", long_prompt, n=3)
    s.submit(req)
    run_until_idle(s)
    for p, sink in zip(short, sinks, strict=True):
        assert collect(sink)[0] == reference(p, 12)
    assert collect(long_sink)[0] == reference(long_prompt, 3)
    steps = runner.calls[1:]
    while_prefilling = steps[:next(i for i, c in enumerate(steps)
                                   if any(x.start_pos + len(x.token_ids) == 30 for x in c)) + 1]
    assert all(sum(len(x.token_ids) for x in c) <= 8 for c in runner.calls)
    if mixed:
        # the two decodes (one token each) and a 6-token chunk while more than one step's
        # budget of prompt is left; the last 6 tokens fit one step and run alone
        assert [sorted(len(x.token_ids) for x in c) for c in while_prefilling] == \
            [[1, 1, 6]] * 4 + [[6]]
        assert s.stats()["num_mixed_steps"] == 4
    else:
        assert [[len(x.token_ids) for x in c] for c in while_prefilling] == [[8]] * 3 + [[6]]
        assert s.stats()["num_mixed_steps"] == 0
    assert_baseline(s)


def test_the_loop_hands_a_steps_outputs_over_before_its_next_device_wait():
    """With the loop's outbox (Scheduler.event_loop), a landing's outputs are held while the
    next step is formed and dispatched, and reach their sinks, in order and complete, before
    the scheduler waits for that step (or goes idle): the HTTP side streams them while the
    device works, not while the scheduler packs."""
    from pdtopo.runtime.engine.sampling import PendingSample

    s = Scheduler(make_ctx(), FakeRunner(num_pages=64, page_size=4), FakeTokenizer())
    s.outbox = []
    reqs = [mk(f"r{i}", [2 + i, 3, 4], n=4) for i in range(3)]
    for req, _ in reqs:
        s.submit(req)
    seen_at_wait = []
    result = PendingSample.result

    def waiting(pending):
        seen_at_wait.append([sink.queue.qsize() for _, sink in reqs])
        return result(pending)

    PendingSample.result = waiting
    try:
        s.step()  # the prefill: its first tokens are held after it lands
        held = len(s.outbox)
        assert held == 3 and all(sink.queue.empty() for _, sink in reqs)
        s.step()  # the first decode step: the held outputs go out before its wait
        assert seen_at_wait[-1] == [1, 1, 1]
        while s.has_work():
            s.step()
        s.step()  # idle: what the last landing emitted goes out before the idle wait
    finally:
        PendingSample.result = result
    assert not s.outbox
    for i, (_, sink) in enumerate(reqs):
        ids, last = collect(sink)
        assert ids == reference([2 + i, 3, 4], 4) and last.finished
    assert_baseline(s)
