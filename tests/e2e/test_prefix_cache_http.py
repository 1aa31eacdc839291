"""The prefix cache as a client and an operator see it, on a real colocated server process:
meta_info.cached_tokens, OpenAI usage.prompt_tokens_details.cached_tokens, the Prometheus
metrics, the tree in /pdtopo/state, POST /flush_cache, and `pdtopo bench`'s multiturn workload
(TTFT per turn, the cached-token ratio, turns built from the previous answers); with a host tier
(`engine.host_kv_pages`), a prefix pushed out of the pool hits from host memory and shows on
/pdtopo/state, /metrics and in the flush's answer."""

from __future__ import annotations

import re

import httpx
import pytest

from pdtopo.bench.run import run_bench
from pdtopo.bench.settings import BenchSettings
from tests.support.api_server import direct_server
from tests.support.e2e import generate, pool_state, wait_pools_baseline

pytestmark = pytest.mark.slow  # one server process

PAGE = 8  # tests.support.constants.TINY_OVERRIDES
SYSTEM = [256] + [40 + i % 60 for i in range(6 * PAGE)]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # a host tier of 400 pages under the 200-page pool (used only once the pool overflows)
    with direct_server(tmp_path_factory.mktemp("prefix_http"), ["engine.host_kv_pages=400"]) as u:
        yield u


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(rf"^{re.escape(name)}(\{{.*\}})? ", line))


def test_cached_tokens_are_reported_on_every_surface(url):
    httpx.post(f"{url}/flush_cache", timeout=10).raise_for_status()
    greedy = {"max_new_tokens": 4, "temperature": 0}
    first = generate(url, {"input_ids": SYSTEM + [7, 8], "sampling_params": greedy})
    assert first["meta_info"]["cached_tokens"] == 0
    second = generate(url, {"input_ids": SYSTEM + [9, 10, 11], "sampling_params": greedy})
    assert second["meta_info"]["cached_tokens"] == len(SYSTEM) // PAGE * PAGE
    comp = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": SYSTEM + [12], "max_tokens": 3, "temperature": 0})
    comp.raise_for_status()
    usage = comp.json()["usage"]
    assert usage["prompt_tokens"] == len(SYSTEM) + 1
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(SYSTEM) // PAGE * PAGE
    state = wait_pools_baseline(url)[1][url]
    assert state["prefix_cache"] is True and state["tree_pages"] >= len(SYSTEM) // PAGE
    assert state["cached_tokens"] >= 2 * (len(SYSTEM) // PAGE * PAGE)
    assert state["page_problems"] == []
    assert _metric(url, "pdtopo:prompt_tokens_cached_total") == state["cached_tokens"]
    assert _metric(url, "pdtopo:prefix_cache_pages") == state["tree_pages"]
    assert 0 < _metric(url, "sglang:cache_hit_rate") < 1


def test_flush_cache_empties_the_tree_and_says_so(url):
    generate(url, {"input_ids": SYSTEM + [3], "sampling_params": {"max_new_tokens": 2}})
    wait_pools_baseline(url)
    before = pool_state(url)["tree_pages"]
    assert before > 0
    resp = httpx.post(f"{url}/flush_cache", timeout=10)
    assert resp.status_code == 200
    assert f"{before} pages freed, 0 still held" in resp.text
    st = pool_state(url)
    assert st["tree_pages"] == 0 and st["free_pages"] == st["total_pages"]
    again = generate(url, {"input_ids": SYSTEM + [3], "sampling_params": {"max_new_tokens": 2}})
    assert again["meta_info"]["cached_tokens"] == 0  # nothing left to hit


def test_a_prefix_pushed_out_of_the_pool_hits_from_the_host_tier(url):
    httpx.post(f"{url}/flush_cache", timeout=10).raise_for_status()
    greedy = {"max_new_tokens": 2, "temperature": 0}
    long = [[256] + [(k * 37 + i) % 250 + 1 for i in range(79 * PAGE)] for k in range(3)]
    firsts = [generate(url, {"input_ids": p, "sampling_params": greedy}) for p in long]
    wait_pools_baseline(url)
    st = pool_state(url)
    assert st["host_spilled_pages"] > 0 and st["host_kv_pages"] > 0, st  # 3 x 80 > 200 pages
    again = generate(url, {"input_ids": long[0], "sampling_params": greedy})
    assert again["meta_info"]["cached_tokens"] == 79 * PAGE   # all of it: its last page recomputes
    assert again["output_ids"] == firsts[0]["output_ids"]
    st = wait_pools_baseline(url)[1][url]
    assert st["host_hit_pages"] > 0 and st["page_problems"] == [], st
    assert _metric(url, "pdtopo:host_kv_hit_pages_total") == st["host_hit_pages"]
    assert _metric(url, "pdtopo:host_kv_capacity_pages") == 400
    resp = httpx.post(f"{url}/flush_cache", timeout=10)
    assert f"{st['host_kv_pages']} host-tier pages dropped" in resp.text, resp.text
    assert pool_state(url)["host_kv_pages"] == 0


def test_bench_multiturn_reports_ttft_per_turn_and_cached_ratio(url):
    httpx.post(f"{url}/flush_cache", timeout=10).raise_for_status()
    settings = BenchSettings.with_defaults({
        "workload": "multiturn", "output_len": 6, "warmup_requests": 0, "progress": False,
        "max_concurrency": 4, "token_id_range": [32, 127],
        "multiturn": {"system_prompts": 2, "system_len": 64, "conversations": 4, "turns": 3,
                      "user_len": 10}})
    metrics = run_bench(url, settings)
    st = metrics["stats"]
    assert st["requests"] == {"total": 12, "completed": 12, "failed": 0}
    assert set(st["by_tag"]) == {"turn1", "turn2", "turn3"}
    assert all(st["by_tag"][t]["requests"]["completed"] == 4 for t in st["by_tag"])
    # each turn's prompt is the previous one + its 6-token answer + a 10-token message
    t1 = st["by_tag"]["turn1"]["input_tokens"] / 4
    t2 = st["by_tag"]["turn2"]["input_tokens"] / 4
    assert (t1, t2) == (64 + 10, 64 + 10 + 6 + 10)
    # later turns reuse the whole conversation so far; two conversations share each system
    assert st["by_tag"]["turn3"]["cached_token_ratio"] > 0.7
    assert st["by_tag"]["turn1"]["cached_token_ratio"] < st["by_tag"]["turn3"]["cached_token_ratio"]
    assert 0 < st["cached_token_ratio"] < 1 and st["cached_tokens"] > 0
