"""Mixed steps on the real engine: while a long prompt prefills in chunks, the running requests
keep decoding in the same steps (engine.mixed_steps), their greedy tokens equal a scheduler's
without mixed steps, and no step shape compiles after warmup (the flat layout's bounds hold
every running context beside the chunks)."""

from __future__ import annotations

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.support.engine_greedy import greedy_req, scheduler_for

SHORT = [[1, 5, 9, 12, 40, 7], [3] * 21, [8, 8]]
LONG = [11, 2, 2, 90, 41, 17] * 30  # 180 tokens: 6 chunks of at most 32


def _run(mixed: bool, impl: str):
    cfg = compose_config(["model=tiny_llama", f"engine.mixed_steps={str(mixed).lower()}",
                          f"engine.attention_impl={impl}", "engine.max_prefill_tokens=32",
                          "engine.max_running_requests=4", "engine.max_model_len=256"])
    sched, runner = scheduler_for(cfg, "colocated", load_tokenizer(cfg.model))
    runner.warmup()
    sched.warmup()
    warmed = runner.compiled_keys()
    sched.start()
    try:
        short = [greedy_req(p, 24) for p in SHORT]
        for r in short:
            sched.submit(r)
        first = [list(r.sink.get(120).new_token_ids) for r in short]  # all decoding now
        long = greedy_req(LONG, 4)
        sched.submit(long)
        out = [head + list(r.sink.collect(120)[0])
               for head, r in zip([*first, []], [*short, long], strict=True)]
        assert [len(ids) for ids in out] == [24, 24, 24, 4]
    finally:
        sched.stop()
    assert runner.compiled_keys() == warmed, "a step shape compiled while serving"
    return out, sched.stats()["num_mixed_steps"]


@pytest.mark.parametrize("impl", ["gather"])
def test_mixed_steps_equal_separate_steps(impl):
    mixed, n_mixed = _run(True, impl)
    separate, n_separate = _run(False, impl)
    assert n_separate == 0
    assert n_mixed >= 5  # the long prompt's chunks rode with the decodes
    assert mixed == separate
