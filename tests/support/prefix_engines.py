"""Prefix-cache prompts and drivers for in-process schedulers with real model runners: the
engine overrides (ENGINE, page size PS, NEW greedy tokens per request), prompts that share 0,
<1, 1 and many pages (`shared_prefix_prompts`), requests sent one by one to a colocated server
(`one_by_one`) or a P/D pair (`pd_one_by_one`, D's cached_tokens checked against P's), and
`idle`, which waits until schedulers hold no requests or pages. Used by
tests/e2e/test_prefix_cache_models.py and tests/e2e/test_reshard_engines.py."""

from __future__ import annotations

import time

import numpy as np

from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from tests.support.e2e import baseline_problems

PS = 8
NEW = 12
ENGINE = [f"engine.page_size={PS}", "engine.num_pages=96", "engine.max_model_len=128",
          "engine.max_running_requests=4", "engine.max_prefill_tokens=128",
          "disaggregation.kv_timeout_s=30"]


def shared_prefix_prompts(vocab: int, seed: int = 3) -> list[tuple[str, list[int], int]]:
    """(name, prompt, expected cached tokens) in the order they are sent to one server."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return [int(t) for t in rng.integers(2, vocab, size=n)]

    system, first = toks(5 * PS), toks(11)
    return [
        ("first", first, 0),
        ("shares 0 pages", toks(1) + first[1:], 0),
        ("shares less than a page", first[:5] + toks(9), 0),
        ("shares one page", first[:PS + 2] + toks(7), PS),
        ("system prompt", system + toks(6), 0),
        ("shares many pages", system + toks(9), 5 * PS),
        ("only cached pages", system, 4 * PS),   # the last page is recomputed
        ("a later turn", system + toks(6) + toks(20), 5 * PS),
    ]


def make_req(prompt, room=None, p=None) -> Req:
    req = Req(rid=new_rid(), prompt_ids=list(prompt), sink=QueueSink(),
              sampling=SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    if room is not None:
        req.bootstrap_room = room
        req.bootstrap_host, req.bootstrap_port = "127.0.0.1", p.kv_manager.channel.port
    return req


def one_by_one(sched, prompts) -> list[tuple[list[int], int]]:
    """Each prompt after the previous answer (so that it can hit): (tokens, cached_tokens)."""
    out = []
    for prompt in prompts:
        r = make_req(prompt)
        sched.submit(r)
        ids, final = r.sink.collect(120)
        assert final.finish_reason["type"] == "length", final.finish_reason
        out.append((list(ids), final.cached_tokens))
    return out


def pd_one_by_one(p, d, prompts, room0: int) -> list[tuple[list[int], int]]:
    out = []
    for room, prompt in enumerate(prompts, start=room0):
        rp, rd = make_req(prompt, room, p), make_req(prompt, room, p)
        d.submit(rd)
        p.submit(rp)
        _, p_final = rp.sink.collect(120)
        ids, final = rd.sink.collect(120)
        assert final.finish_reason["type"] == "length", final.finish_reason
        assert final.cached_tokens == p_final.cached_tokens  # P's hit, reported by D
        out.append((list(ids), final.cached_tokens))
    return out


def idle(*scheds, timeout=10.0):
    deadline = time.monotonic() + timeout
    for s in scheds:
        while baseline_problems(s.stats()) or s.stats()["num_reqs"]:
            assert time.monotonic() < deadline, baseline_problems(s.stats())
            time.sleep(0.02)
