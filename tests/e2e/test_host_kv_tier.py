"""The prefix cache's host tier with real model runners (tiny model, a pool of 23 pages): six
conversations whose prefixes do not fit the pool come back and hit pages loaded from host memory;
greedy tokens equal the cache-off engine's, colocated and through a P/D pair whose P and D
(`decode_prefix_cache`) both keep a host tier; a soak of concurrent requests with aborts ends with
every device page and host row accounted for; /metrics and /flush_cache see both tiers. (The
tier's copies on a bare pool: tests/unit/test_host_kv_churn.py.)"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.e2e.test_prefix_cache_models import _scheduler
from tests.support.prefix_engines import PS, idle, one_by_one, pd_one_by_one

pytestmark = pytest.mark.slow  # real runners

SMALL_POOL = [f"engine.page_size={PS}", "engine.num_pages=24", "engine.max_model_len=128",
              "engine.max_running_requests=4", "engine.max_prefill_tokens=128",
              "disaggregation.kv_timeout_s=30"]
HOST = "engine.host_kv_pages=64"
SYSTEM_PAGES = 5


def conversations(n: int = 6, seed: int = 0) -> list[list[int]]:
    """n prompts of a 5-page system prompt each and a short question, sent twice: the second
    round finds its prefixes evicted from the 23-page pool by the others."""
    rng = np.random.default_rng(seed)
    systems = [[int(t) for t in rng.integers(2, 256, size=SYSTEM_PAGES * PS)] for _ in range(n)]
    return [s + [int(t) for t in rng.integers(2, 256, size=6)] for s in systems] * 2


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text,
                                             re.M))


def test_host_hits_give_cache_off_tokens_colocated_and_pd():
    prompts = conversations()
    cfg_off = compose_config(["model=tiny_llama", "model.num_layers=2",
                              "engine.prefix_cache=false", *SMALL_POOL])
    cfg_dev = compose_config(["model=tiny_llama", "model.num_layers=2", *SMALL_POOL])
    cfg_host = compose_config(["model=tiny_llama", "model.num_layers=2", HOST, *SMALL_POOL,
                               "disaggregation.decode_prefix_cache=true"])
    tok = load_tokenizer(cfg_off.model)
    off, dev = _scheduler(cfg_off, "colocated", tok), _scheduler(cfg_dev, "colocated", tok)
    host = _scheduler(cfg_host, "colocated", tok)
    p, d = _scheduler(cfg_host, "prefill", tok), _scheduler(cfg_host, "decode", tok)
    scheds = (off, dev, host, p, d)
    for s in scheds:
        s.warmup()
        s.start()
    try:
        ref = one_by_one(off, prompts)
        got_dev = one_by_one(dev, prompts)
        got_host = one_by_one(host, prompts)
        got_pd = pd_one_by_one(p, d, prompts, room0=6000)
        assert [ids for ids, _ in got_host] == [ids for ids, _ in ref]
        assert [ids for ids, _ in got_pd] == [ids for ids, _ in ref]
        assert [ids for ids, _ in got_dev] == [ids for ids, _ in ref]
        half = len(prompts) // 2
        # device only: the second round's prefixes were evicted; with the host tier every
        # second-round prompt hits its whole system prompt (loaded back from host memory)
        assert sum(c for _, c in got_dev[half:]) < SYSTEM_PAGES * PS * half
        assert [c for _, c in got_host[half:]] == [SYSTEM_PAGES * PS] * half
        assert [c for _, c in got_pd[half:]] == [SYSTEM_PAGES * PS] * half
        idle(host, p, d)
        for s in (host, p, d):
            st = s.stats()
            assert st["host_hit_pages"] >= SYSTEM_PAGES and st["host_spilled_pages"] > 0, st
            assert st["host_kv_pages"] > 0 and st["page_problems"] == [], st
            assert s.prefix_cache.problems([]) == []
        st = host.stats()
        row = host.prefix_cache.host.page_bytes
        assert st["host_bytes_to_host"] == st["host_spilled_pages"] * row
        assert st["host_bytes_to_device"] >= st["host_hit_pages"] * row
        text = host.metrics.render().decode()
        assert metric(text, "pdtopo:host_kv_hit_pages_total") == st["host_hit_pages"]
        assert metric(text, "pdtopo:host_kv_pages") == st["host_kv_pages"]
        assert metric(text, "pdtopo:host_kv_bytes_total") == (st["host_bytes_to_host"]
                                                             + st["host_bytes_to_device"])
        flushed = host.flush_cache().result(10)
        assert flushed["flushed_host_pages"] == st["host_kv_pages"] > 0
        after = host.stats()
        assert host.prefix_cache.num_host_pages == 0 and host.prefix_cache.host.used_rows == 0
        assert after["free_pages"] == after["total_pages"]
    finally:
        for s in scheds:
            s.stop()


def test_soak_with_aborts_accounts_for_every_page_and_host_row():
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "engine.host_kv_pages=24", *SMALL_POOL])
    tok = load_tokenizer(cfg.model)
    s = _scheduler(cfg, "colocated", tok)
    s.warmup()
    s.start()
    rng = random.Random(4)
    systems = [[rng.randrange(2, 256) for _ in range(rng.randint(2, 5) * PS)] for _ in range(10)]
    try:
        for wave in range(8):
            reqs = []
            for _ in range(6):
                prompt = rng.choice(systems) + [rng.randrange(2, 256) for _ in range(5)]
                r = Req(rid=new_rid(), prompt_ids=prompt, sink=QueueSink(),
                        sampling=SamplingParams(max_new_tokens=rng.randint(1, 10),
                                                temperature=0.0, ignore_eos=True))
                s.submit(r)
                reqs.append(r)
            for r in rng.sample(reqs, 2):
                s.abort(r.rid)
            for r in reqs:
                _, final = r.sink.collect(120)
                assert final.finish_reason["type"] in ("length", "abort"), final.finish_reason
            idle(s)
            assert s.prefix_cache.problems([]) == [], wave
        st = s.stats()
        assert st["host_hit_pages"] > 0 and st["host_spilled_pages"] > 0
        assert s.prefix_cache.num_host_dropped > 0   # the 24-row tier filled and gave way
        s.flush_cache().result(10)
        st = s.stats()
        assert st["free_pages"] == st["total_pages"] and st["host_kv_pages"] == 0
    finally:
        s.stop()

