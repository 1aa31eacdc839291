"""D2H staging on P (`disaggregation.d2h_staging`, the design's mode B) with real P and D
schedulers (model runners, transfer servers, ZMQ side channel): D's greedy tokens equal mode A's
for float32 and bfloat16 KV, P stages every copy in host memory and ends holding nothing."""

from __future__ import annotations

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.e2e.test_prefix_cache_models import _scheduler
from tests.support.prefix_engines import ENGINE, idle, pd_one_by_one, shared_prefix_prompts

pytestmark = pytest.mark.slow  # real runners


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_mode_b_gives_mode_a_tokens(kv_dtype):
    prompts = [p for _, p, _ in shared_prefix_prompts(vocab=256)][:5]
    got = {}
    for staging in ("false", "true"):
        cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                              f"engine.kv_dtype={kv_dtype}", *ENGINE,
                              f"disaggregation.d2h_staging={staging}"])
        tok = load_tokenizer(cfg.model)
        p, d = _scheduler(cfg, "prefill", tok), _scheduler(cfg, "decode", tok)
        for s in (p, d):
            s.start()
        try:
            got[staging] = [ids for ids, _ in pd_one_by_one(p, d, prompts, room0=4000)]
            idle(p, d)
            engine = p.kv_manager.engine
            assert engine.d2h_staging == (staging == "true")
            assert engine.staging_memory_kind == ("pinned_host" if staging == "true" else None)
            st = p.stats()
            assert st["pd_held_kv_bytes"] == st["pd_held_kv_device_bytes"] == 0, st
        finally:
            for s in (p, d):
                s.stop()
    assert got["true"] == got["false"]
