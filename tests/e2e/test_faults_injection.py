"""Injected transfer faults (`disaggregation.fault_injection_prob=0.05`) over real processes:
200 greedy requests through the proxy; each either succeeds with exactly the tokens of a
colocated reference server or fails cleanly with an error body; P's and D's /health_generate
stay 200 throughout; every pool returns to its baseline and P holds no registered KV."""

from __future__ import annotations

import collections
import threading
import time

import httpx
import pytest

from tests.support.constants import greedy
from tests.support.e2e import (
    colocated_reference,
    leaked_pages,
    processes_of_run,
    wait_pools_baseline,
)
from tests.support.faults import (
    FAULT_OVERRIDES,
    launch_fault_deployment,
    post_generate,
    run_concurrently,
    wait_until,
)

pytestmark = pytest.mark.slow

PROB = 0.05
PROMPTS = [f"Prompt {i}: " + "the quick brown fox " * (1 + i % 7) for i in range(20)]
GREEDY = greedy(6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = [o for o in FAULT_OVERRIDES if o.startswith(("model=", "model.", "engine."))]
    with colocated_reference(tmp_path_factory.mktemp("faultref"), model, PROMPTS,
                             GREEDY) as ids:
        yield ids


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faultinj") / "run"
    d = None
    try:
        d = launch_fault_deployment(run_dir, [f"disaggregation.fault_injection_prob={PROB}"])
        yield d
    finally:
        if d is not None:
            d.stop()
        wait_until(lambda: not processes_of_run(run_dir), 30, what="run's processes gone")


def test_injected_faults_fail_cleanly_or_match_reference(dep, reference):
    p_url, d_url = dep.url("prefill_0"), dep.url("decode_0")
    health: list[tuple[str, int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            for url in (p_url, d_url):
                try:
                    code = httpx.get(f"{url}/health_generate", timeout=30).status_code
                except httpx.HTTPError:
                    code = 0
                health.append((url, code))
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(200)]
    t0 = time.monotonic()
    try:
        outs = run_concurrently([lambda p=p: post_generate(
            dep.proxy_url, {"text": p, "sampling_params": GREEDY}) for p in prompts], workers=16)
    finally:
        stop.set()
        watcher.join(40)
    took = time.monotonic() - t0
    ok = failed = 0
    for prompt, o in zip(prompts, outs, strict=True):
        if o.status == 200:
            assert o.output_ids == reference[prompt], (prompt, o)
            ok += 1
        else:
            assert o.status is not None and o.status >= 500, o
            assert "injected transfer fault" in o.body, o
            failed += 1
    assert failed > 0, "p=0.05 over 200 requests injected no fault"
    assert ok >= 150, collections.Counter(o.status for o in outs)
    assert health and all(code == 200 for _, code in health), collections.Counter(health)
    baseline_s, states = wait_pools_baseline(dep, timeout=60)
    assert leaked_pages(states) == 0 and states["prefill_0"]["pd_registered_kv"] == 0
    print(f"\n[reliability] fault injection p={PROB}: requests=200 ok={ok} failed={failed} "
          f"seconds={took:.1f} health_generate_probes={len(health)} all 200, "
          f"baseline_after_s={baseline_s:.2f}, pages_leaked={leaked_pages(states)}")
