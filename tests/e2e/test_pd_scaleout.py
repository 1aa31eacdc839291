"""PD scale-out with real processes: 2P2D behind the Rust router under 32 concurrent requests,
and a tensor-parallel 1P1D (2 emulated devices per instance, KV sharded over kv heads). Both
must produce exactly the colocated server's greedy tokens; all four 2P2D servers must serve, and
sending the prompts again hits P's prefix caches (D reports the cached tokens) and, with
`disaggregation.decode_prefix_cache`, D's own caches (P skips the pages D holds), with the same
tokens."""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import pytest

from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
    Deployment,
    colocated_reference,
    deployment_overrides,
    generate,
    pool_state,
    port_block,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

GREEDY = greedy(8)
PROMPTS = [f"Request number {i}: " + "tell me a story about paged attention " * (i % 4)
           for i in range(32)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("colocated"), TWO_LAYERS, PROMPTS,
                             GREEDY) as ref:
        yield ref


def _launch(tmp_path_factory, name, extra):
    run_dir = tmp_path_factory.mktemp(name) / "run"
    return Deployment(run_dir, [*TWO_LAYERS, *extra, *deployment_overrides(port_block(40))]).launch()


def _counter(url, name):
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{.*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_2p2d_32_concurrent_requests(tmp_path_factory, reference):
    dep = _launch(tmp_path_factory, "2p2d", ["topology=2p2d_cpu",
                                             "disaggregation.decode_prefix_cache=true"])
    try:
        assert len(dep.names("prefill")) == 2 and len(dep.names("decode")) == 2
        with cf.ThreadPoolExecutor(32) as ex:
            outs = list(ex.map(
                lambda p: generate(dep.proxy_url, {"text": p, "sampling_params": GREEDY}, 300),
                PROMPTS))
        assert [o["output_ids"] for o in outs] == [reference[p] for p in PROMPTS]
        # again, now that P's prefix caches hold these prompts: same tokens, cached prefixes
        with cf.ThreadPoolExecutor(8) as ex:
            again = list(ex.map(
                lambda p: generate(dep.proxy_url, {"text": p, "sampling_params": GREEDY}, 300),
                PROMPTS))
        assert [o["output_ids"] for o in again] == [reference[p] for p in PROMPTS]
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        assert sum(c > 0 for c in cached) >= 16, cached  # reported by D, hit on P
        assert sum(_counter(dep.url(n), "pdtopo:prompt_tokens_cached_total")
                   for n in dep.names("prefill")) == sum(cached) + sum(
            o["meta_info"]["cached_tokens"] for o in outs)
        # D's own caches (decode_prefix_cache) held some of the second round's pages: P
        # skipped exactly those
        d_held = sum(pool_state(dep.url(n))["pd_decode_cached_pages"] for n in dep.names("decode"))
        p_skipped = sum(pool_state(dep.url(n))["pd_skipped_pages"] for n in dep.names("prefill"))
        assert d_held == p_skipped > 0
        for name in dep.names("prefill"):
            assert _counter(dep.url(name), "sglang:prompt_tokens_total") > 0, name
        for name in dep.names("decode"):
            assert _counter(dep.url(name), "sglang:generation_tokens_total") > 0, name
        wait_pools_baseline(dep)
    finally:
        dep.stop_and_check()


def test_tensor_parallel_1p1d_matches_colocated(tmp_path_factory, reference):
    tp = ["topology.accelerator=cpu-4"] + [
        f"topology.{role}.{key}" for role in ("prefill", "decode")
        for key in ("chips_per_instance=2", "mesh.tp=2")]
    dep = _launch(tmp_path_factory, "tp2", tp)
    try:
        assert dep.process("prefill_0")["chips"] == [0, 1]
        assert dep.process("decode_0")["chips"] == [2, 3]
        for prompt in PROMPTS[:6]:
            out = generate(dep.proxy_url, {"text": prompt, "sampling_params": GREEDY})
            assert out["output_ids"] == reference[prompt], prompt
        info = httpx.get(f"{dep.url('decode_0')}/get_server_info").json()
        assert info["tp_size"] == 2
        wait_pools_baseline(dep)
    finally:
        dep.stop_and_check()
