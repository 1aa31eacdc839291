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


def run_loaded(s: Scheduler, reqs: list[Req], late: list[Req] = (),
               abort: str | None = None) -> tuple[dict[str, tuple], dict]:
    """`run_stepped` over a backlog, counting the steps: decode steps run, steps dispatched
    ahead, of which with a request waiting and with a penalised row, and per request the step
    that dispatched its first prompt chunk (`start`). `abort`: that request is aborted once it has
    emitted two tokens and a step dispatched ahead holds its row. Returns per request (ids,
    finish reason, every output) and the counts."""
    for r in reqs:
        s.submit(r)
    n = {"decode": s.num_decode_steps, "ahead": s.num_overlapped_steps, "waiting": 0,
         "penalised": 0, "aborted": 0, "start": {}}
    steps = 0
    while s.has_work() or not s.inbox.empty() or (late and steps <= 5):
        if steps == 5:
            for r in late:
                s.submit(r)
        ahead = s.num_overlapped_steps
        s.step()
        steps += 1
        assert steps < 3000
        for r in [*reqs, *late]:
            if r.prefill_start_time is not None and r.rid not in n["start"]:
                n["start"][r.rid] = steps
        if s.num_overlapped_steps > ahead:  # the step in flight was dispatched before landing
            n["waiting"] += bool(s.waiting)
            n["penalised"] += any(r.sampling.penalised for r in s.in_flight.reqs)
            victim = next((r for r in s.in_flight.reqs if r.rid == abort), None)
            if victim is not None and not n["aborted"] and victim.num_emitted >= 2:
                s.abort(abort)  # drained by the next step, its row in flight
                n["aborted"] = steps
    n["decode"] = s.num_decode_steps - n["decode"]
    n["ahead"] = s.num_overlapped_steps - n["ahead"]
    s.publish_stats()
    out = {}
    for r in [*reqs, *late]:
        outs = []
        while not r.sink.queue.empty():
            outs.append(r.sink.queue.get_nowait())
        out[r.rid] = ([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason, outs)
    st = s.stats()
    assert not baseline_problems(st) and st["num_reqs"] == 0, baseline_problems(st)
    return out, n


def stop_string(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A one-character stop string that first appears with output token k >= 2 (and k)."""
    for k in range(2, len(ids) - 1):
        before, text = tokenizer.decode(ids[:k]), tokenizer.decode(ids[:k + 1])
        new = text[len(before):] if text.startswith(before) else ""
        if new[:1].isprintable() and new[:1] and new[0] not in before:
            return new[0], k
    raise AssertionError(f"no stop string in {ids}")


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_overlap_under_load_gives_the_synchronous_outputs(sched, sp):
    """Under load: more requests than engine.max_running_requests (some always wait), every
    other one penalised, one ending on a stop string, one aborted mid-stream, late arrivals.
    The overlapped loop gives the synchronous loop's tokens and finish reasons, emits nothing
    of the aborted request after its abort, and keeps dispatching ahead while requests wait
    and with penalised rows in the step (before issue 48 it switched off for both)."""
    def batch(stop: dict[int, str] | None = None) -> tuple[list[Req], list[Req]]:
        reqs = []
        for i, p in enumerate(prompts()):
            params = SamplingParams(max_new_tokens=8 + i % 4, ignore_eos=True, **sp)
            if i % 2:
                params.presence_penalty, params.frequency_penalty = 0.5, 0.3
                params.repetition_penalty = 1.3
            if stop and i in stop:
                params.stop = [stop[i]]
            reqs.append(Req(rid=f"l{i}", prompt_ids=p, sampling=params, sink=QueueSink()))
        return reqs[:6], reqs[6:]

    max_running = sched.max_running
    sched.max_running = 3  # 8 requests: a backlog until the last ones are admitted
    try:
        sched.overlap = False
        first, _ = run_loaded(sched, *batch())
        stop, k = stop_string(sched.tokenizer, first["l3"][0])
        sync, sync_n = run_loaded(sched, *batch({3: stop}))
        assert sync["l3"][1] == {"type": "stop", "matched": stop}
        assert len(sync["l3"][0]) == k + 1 < len(first["l3"][0])
        sched.overlap = True
        ahead, n = run_loaded(sched, *batch({3: stop}), abort="l0")
    finally:
        sched.max_running = max_running
        sched.overlap = True
    assert {r: v[:2] for r, v in ahead.items() if r != "l0"} == {
        r: v[:2] for r, v in sync.items() if r != "l0"}
    ids, reason, outs = ahead["l0"]
    assert n["aborted"] and reason["type"] == "abort", (n, reason)
    assert 2 <= len(ids) < len(sync["l0"][0]) and ids == sync["l0"][0][:len(ids)]
    # the abort's output is the last, and carries no token: none emitted after the abort
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].new_token_ids == []
    # the overlap ran under the backlog and with penalised rows
    assert n["ahead"] >= 0.6 * n["decode"], n
    assert n["waiting"] >= 5 and n["penalised"] >= 5, n
    # and a waiting request starts as soon as it can: at most one step after the synchronous
    # loop starts it (the step in flight when a request ends on an unforeseen token lands first)
    late_by = {r: n["start"][r] - sync_n["start"][r] for r in sync_n["start"]}
    assert max(late_by.values()) <= 1, late_by


STREAM_LENS = [3, 11, 1, 25, 7, 14, 2, 17, 5, 20, 9, 4]


def run_stream(s: Scheduler, reqs: list[Req], every: int = 2,
               abort: str | None = None) -> tuple[dict[str, tuple], dict]:
    """The serving loop's `step()` over a steady arrival stream: request i arrives before step
    `every * i` (while earlier ones decode), from an empty prefix cache. `abort`: that request
    is aborted while the prefill step that ends its prompt is in flight. Returns per request
    (ids, finish reason, (the emitted stream as (new tokens, finished) per output, the prompt
    tokens served by the prefix cache), logprobs)
    and counts: decode steps run, steps dispatched ahead, of which continuing a prefill or
    mixed step (`after_prompt`; a mixed one: `after_mixed`), prefill/mixed steps left in
    flight (`launched`), mixed steps, and the step of the abort."""
    s._flush_cache()  # every run the same prompt steps: nothing cached from the last one
    n = {"decode": s.num_decode_steps, "ahead": s.num_overlapped_steps,
         "mixed": s.num_mixed_steps, "after_prompt": 0, "after_mixed": 0, "launched": 0,
         "aborted": 0}
    pending, steps = list(reqs), 0
    while pending or s.has_work() or not s.inbox.empty():
        if pending and steps % every == 0:
            s.submit(pending.pop(0))
        steps += 1
        assert steps < 3000
        if not (s.has_work() or not s.inbox.empty()):
            continue  # idle until the next arrival (step() would block in idle_wait)
        flight, ahead = s.in_flight, s.num_overlapped_steps
        s.step()
        if flight is not None and flight.batch.kind != "decode" and (
                s.num_overlapped_steps > ahead):
            n["after_prompt"] += 1
            n["after_mixed"] += flight.batch.kind == "mixed"
        now = s.in_flight
        if now is not None and now is not flight and now.batch.kind != "decode":
            n["launched"] += 1
            prompts = now.reqs[now.batch.num_decode:]
            if not n["aborted"] and any(r.rid == abort for r in prompts):
                s.abort(abort)  # drained by the next step, before its continuation is formed
                n["aborted"] = steps
    for k in ("decode", "ahead", "mixed"):
        n[k] = getattr(s, {"decode": "num_decode_steps", "ahead": "num_overlapped_steps",
                           "mixed": "num_mixed_steps"}[k]) - n[k]
    s.publish_stats()
    out = {}
    for r in reqs:
        outs = []
        while not r.sink.queue.empty():
            outs.append(r.sink.queue.get_nowait())
        out[r.rid] = ([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason,
                      ([(o.new_token_ids, o.finished) for o in outs], outs[-1].cached_tokens),
                      [(lp.logprob, lp.top) for lp in r.output_logprobs])
    st = s.stats()
    assert not baseline_problems(st) and st["num_reqs"] == 0, baseline_problems(st)
    return out, n


def first_char(tokenizer, token: int) -> str | None:
    """A stop string that a request's first token, `token`, holds (None: it decodes to no
    text). Any character will do: nothing precedes it."""
    return tokenizer.decode([token])[:1] or None


@pytest.mark.parametrize("mixed,budget", [(True, 16), (False, 16), (True, 64), (False, 64)],
                         ids=["mixed-chunked", "chunked", "mixed", "whole"])
@pytest.mark.parametrize("sp", [dict(temperature=0.0, logprobs=2),
                                dict(temperature=1.0, top_p=0.9, seed=3)],
                         ids=["greedy", "seeded"])
def test_overlap_after_prefill_gives_the_synchronous_outputs(sched, sp, mixed, budget):
    """Issue 48 item 3: a prefill or mixed step whose prompts all end in it is left in flight,
    and the decode step over the requests it gave a token to (and the running ones) is
    dispatched before it lands, their tokens fed on the device. Over a steady arrival stream
    (max_running_requests 4: a backlog), with chunked prompts (engine.max_prefill_tokens 16,
    below the longest prompts: a step with a chunk that does not end its prompt runs whole) or
    not, mixed steps on and off (with the small budget they run, and are continued ahead),
    penalised rows, a request whose
    first token is EOS, one whose first token holds its stop string, one stopping on a stop
    string later, an n > 1 pair (the second completion starts from its leader's cached prompt
    pages) and one aborted while its prefill is in flight: the overlapped loop gives
    the synchronous loop's tokens, finish reasons, emitted streams and logprobs (those within
    float rounding), and the share of decode steps dispatched ahead rises over the loop that
    overlaps decode steps only (before issue 48 item 3)."""
    def batch(eos: int | None = None, stops: dict[int, str] | None = None) -> list[Req]:
        reqs = []
        for i, n in enumerate(STREAM_LENS):
            prompt = [256] + [(5 * i + 3 * j + 1) % 250 + 1 for j in range(n)]
            params = SamplingParams(max_new_tokens=5 + i % 5, ignore_eos=True, **sp)
            if i % 3 == 1:
                params.presence_penalty, params.repetition_penalty = 0.5, 1.3
            if i == 4 and eos is not None:
                params.ignore_eos = False  # its first token is made an EOS id below
            if stops and i in stops:
                params.stop = [stops[i]]
            reqs.append(Req(rid=f"s{i}", prompt_ids=prompt, sampling=params, sink=QueueSink()))
        # n > 1: s11 is s10's second completion, waiting for its leader's prompt pages
        reqs[11].prompt_ids, reqs[11].leader = list(reqs[10].prompt_ids), reqs[10]
        reqs[10].num_followers = 1
        return reqs

    saved = (sched.max_running, sched.mixed_steps, sched.max_prefill_tokens, sched.eos_ids)
    sched.max_running, sched.mixed_steps, sched.max_prefill_tokens = 4, mixed, budget
    try:
        sched.overlap = False
        ref, _ = run_stream(sched, batch())
        eos = ref["s4"][0][0]
        first = next(i for i in (6, 7, 8, 9, 10, 11, 3, 1, 0)
                     if first_char(sched.tokenizer, ref[f"s{i}"][0][0]))
        later, k = stop_string(sched.tokenizer, ref["s2"][0])
        stops = {first: first_char(sched.tokenizer, ref[f"s{first}"][0][0]), 2: later}
        sched.eos_ids = {*saved[3], eos}
        sync, _ = run_stream(sched, batch(eos, stops))
        sched.overlap, sched.overlap_prefill = True, False  # decode steps only: the old loop
        old, old_n = run_stream(sched, batch(eos, stops))
        sched.overlap_prefill = True
        new, new_n = run_stream(sched, batch(eos, stops))
        aborted, ab_n = run_stream(sched, batch(eos, stops), abort="s5")
    finally:
        sched.max_running, sched.mixed_steps, sched.max_prefill_tokens, sched.eos_ids = saved
        sched.overlap = sched.overlap_prefill = True
    assert sync["s4"][1] == {"type": "stop", "matched": eos} and len(sync["s4"][0]) == 1
    assert sync[f"s{first}"][1]["type"] == "stop" and len(sync[f"s{first}"][0]) == 1
    assert sync["s2"][1]["type"] == "stop" and len(sync["s2"][0]) == k + 1
    assert sync["s11"][2][1] == 8  # the follower's prompt from its leader's pages
    for got in (old, new):
        assert {r: v[:3] for r, v in got.items()} == {r: v[:3] for r, v in sync.items()}
        for rid, (*_, lps) in sync.items():  # batch sizes differ: float rounding, not choices
            assert [[t for t, _ in top] for _, top in got[rid][3]] == [
                [t for t, _ in top] for _, top in lps]
            np.testing.assert_allclose([lp for lp, _ in got[rid][3]], [lp for lp, _ in lps],
                                       atol=1e-5)
    # the abort lands while s5's prefill is in flight: nothing of s5 is ever emitted, the
    # others are unchanged
    assert ab_n["aborted"], ab_n
    assert aborted["s5"][1]["type"] == "abort" and aborted["s5"][2][0] == [([], True)]
    assert {r: v[:3] for r, v in aborted.items() if r != "s5"} == {
        r: v[:3] for r, v in sync.items() if r != "s5"}
    # prompt steps were left in flight and continued ahead; mixed steps where asked for
    assert old_n["launched"] == old_n["after_prompt"] == 0, old_n
    assert new_n["launched"] >= 3 and new_n["after_prompt"] >= 3, new_n
    if not mixed:
        assert new_n["mixed"] == 0, new_n
    elif budget < 64:
        assert new_n["mixed"] > 0 and new_n["after_mixed"] > 0, new_n
    assert new_n["ahead"] / new_n["decode"] > old_n["ahead"] / old_n["decode"], (old_n, new_n)
    print(f"\noverlapped decode steps {sp} mixed={mixed} budget={budget}: "
          f"before {old_n['ahead']}/{old_n['decode']}, after {new_n['ahead']}/{new_n['decode']}"
          f" (after a prompt step: {new_n['after_prompt']}, prompt steps launched: "
          f"{new_n['launched']})")
