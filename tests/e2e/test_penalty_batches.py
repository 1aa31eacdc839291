"""A penalised greedy request through pdtopo's schedulers on the tiny model: its tokens are the
same alone, in a batch of 8 beside unpenalised requests on the same prompt (it first, and in the
middle), and through a P/D pair; and they equal a NumPy reference of the penalty over its own
history applied to the runner's logits (teacher-forced, one forward per step)."""

from __future__ import annotations

import numpy as np
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.model_runner import SeqChunk
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.support.engine_greedy import scheduler_for

NEW_TOKENS = 20
PAGE = 8
ENGINE = ["model=tiny_llama", f"engine.page_size={PAGE}", "engine.num_pages=96",
          "engine.max_model_len=96", "engine.max_running_requests=8",
          "engine.max_prefill_tokens=128", "disaggregation.kv_timeout_s=30"]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
PENALTIES = {"repetition": {"repetition_penalty": 1.3},
             "frequency_presence": {"frequency_penalty": 0.5, "presence_penalty": 0.5}}
pytestmark = pytest.mark.slow


def _req(penalty: dict) -> Req:
    return Req(rid=new_rid(), prompt_ids=list(PROMPT), sink=QueueSink(),
               sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                       ignore_eos=True, **penalty))


def _reference(runner, penalty: dict) -> list[int]:
    """Greedy over the runner's last-position logits of prompt + tokens so far, penalised in
    NumPy (HF's repetition rule over prompt and outputs, OpenAI's terms over outputs)."""
    rep = penalty.get("repetition_penalty", 1.0)
    freq, pres = penalty.get("frequency_penalty", 0.0), penalty.get("presence_penalty", 0.0)
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        seq = PROMPT + out
        pages = list(range(1, 1 + -(-len(seq) // PAGE)))
        x = np.asarray(runner.forward([SeqChunk(seq, 0, pages)]))[0].astype(np.float64)
        seen = np.zeros(x.shape[0], bool)
        seen[seq] = True
        x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        counts = np.bincount(np.asarray(out, np.int64), minlength=x.shape[0])
        x = x - freq * counts - pres * (counts > 0)
        best = np.sort(x)[-2:]
        assert best[1] - best[0] > 1e-4, (len(out), best)  # no near-tie to flip a token
        out.append(int(np.argmax(x)))
    return out


def _colocated_batch(sched, penalty: dict, size: int, at: int) -> list[int]:
    """The penalised request's tokens when submitted as row `at` of `size` requests."""
    reqs = [_req(penalty if i == at else {}) for i in range(size)]
    for r in reqs:
        sched.submit(r)
    outs = [list(r.sink.collect(120)[0]) for r in reqs]
    return outs[at]


def _pd(p_sched, d_sched, penalty: dict) -> list[int]:
    rp, rd = _req(penalty), _req(penalty)
    for r in (rp, rd):
        r.bootstrap_room = 900
        r.bootstrap_host, r.bootstrap_port = "127.0.0.1", p_sched.kv_manager.channel.port
    d_sched.submit(rd)
    p_sched.submit(rp)
    rp.sink.collect(120)
    return list(rd.sink.collect(120)[0])


@pytest.fixture(scope="module")
def cfg():
    return compose_config(ENGINE)


@pytest.mark.parametrize("kind", list(PENALTIES))
def test_penalised_tokens_do_not_depend_on_the_batch(cfg, kind):
    penalty = PENALTIES[kind]
    tok = load_tokenizer(cfg.model)
    sched, runner = scheduler_for(cfg, "colocated", tok)
    sched.start()
    try:
        alone = _colocated_batch(sched, penalty, 1, 0)
        first = _colocated_batch(sched, penalty, 8, 0)
        middle = _colocated_batch(sched, penalty, 8, 5)
    finally:
        sched.stop()
    p_sched, _ = scheduler_for(cfg, "prefill", tok)
    d_sched, _ = scheduler_for(cfg, "decode", tok)
    p_sched.start()
    d_sched.start()
    try:
        pd = _pd(p_sched, d_sched, penalty)
    finally:
        p_sched.stop()
        d_sched.stop()
    ref = _reference(runner, penalty)
    plain = _reference(runner, {})
    assert ref != plain  # the penalty changes the output
    assert alone == ref
    assert first == ref
    assert middle == ref
    assert pd == ref
