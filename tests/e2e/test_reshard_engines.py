"""P and D engines with different tensor parallelism, in one process on 4 emulated devices:
real model runners, real transfer servers and ZMQ side channels, KV resharded on the way.

Greedy tokens through every P -> D pair equal a colocated tp=1 engine (tiny model) or HF
transformers' own (a Qwen2 checkpoint with 2 KV heads, replicated on tp=4), for prompts sent one by
one (prefix-cache hits on P) and all at once (many rooms in flight, scattered pages, prompts
across up to 15 pages); D pulls exactly its pool's share of the bytes. With D's own prefix cache,
later turns pull only their new pages through the reshard.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.ports import free_port
from pdtopo.runtime.disagg.transport.base import wire_rows
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.scheduler_factory import make_scheduler
from pdtopo.runtime.settings import direct_process_context
from tests.support.hf_checkpoints import Case, build, hf_greedy
from tests.support.prefix_engines import (
    ENGINE,
    PS,
    idle,
    make_req,
    one_by_one,
    pd_one_by_one,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.slow  # real runners


def _scheduler(cfg, role: str, tok, tp: int):
    ports = {"http": free_port(), "transfer": free_port(), "zmq": free_port()}
    ctx = direct_process_context(cfg, role=role, name=f"{role}_tp{tp}",
                                 extra={"ports": ports, "mesh": {"tp": tp}})
    return make_scheduler(ctx, ModelRunner(cfg.model, cfg.engine, build_mesh(tp)), tok)


def pd_all_at_once(p, d, prompts, room0: int) -> list[list[int]]:
    reqs = []
    for room, prompt in enumerate(prompts, start=room0):
        rp, rd = make_req(prompt, room, p), make_req(prompt, room, p)
        d.submit(rd)
        p.submit(rp)
        reqs.append((rp, rd))
    out = []
    for rp, rd in reqs:
        rp.sink.collect(120)
        ids, final = rd.sink.collect(120)
        assert final.finish_reason["type"] == "length", final.finish_reason
        out.append(list(ids))
    return out


def _pool_share(d, transfers: list[int]) -> int:
    """Bytes moved by transfers of these page counts into D's whole pool (every entry, every
    pool head): each carries the wire's rows (pages and padding, base.wire_rows)."""
    rows = sum(wire_rows(n) for n in transfers)
    return rows * sum(int(a.nbytes) // int(a.shape[0]) for a in d.runner.kv_caches)


def _start(*scheds):
    for s in scheds:
        s.start()


def _stop(*scheds):
    for s in scheds:
        s.stop()


def test_tiny_model_pairs_of_different_tp_match_colocated():
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2", *ENGINE])
    tok = load_tokenizer(cfg.model)
    cases = shared_prefix_prompts(vocab=256)
    prompts = [p for _, p, _ in cases]
    rng = np.random.default_rng(4)
    burst = [[int(t) for t in rng.integers(2, 256, size=n)] for n in (3, 110, 40, 9, 64, 100)]
    ref_sched = _scheduler(cfg, "colocated", tok, 1)
    ps = {tp: _scheduler(cfg, "prefill", tok, tp) for tp in (1, 2, 4)}
    ds = {tp: _scheduler(cfg, "decode", tok, tp) for tp in (1, 2)}
    everyone = (ref_sched, *ps.values(), *ds.values())
    _start(*everyone)
    try:
        ref = [ids for ids, _ in one_by_one(ref_sched, prompts)]
        ref_burst = [ids for ids, _ in one_by_one(ref_sched, burst)]
        for k, (p_tp, d_tp) in enumerate([(2, 1), (1, 2), (4, 2), (4, 1)]):
            p, d = ps[p_tp], ds[d_tp]
            got = pd_one_by_one(p, d, prompts, room0=1000 * (k + 1))
            assert [ids for ids, _ in got] == ref, (p_tp, d_tp)
            before = d.stats()["pd_pulled_bytes"]
            assert pd_all_at_once(p, d, burst, room0=1000 * (k + 1) + 500) == ref_burst, \
                (p_tp, d_tp)
            pulled = d.stats()["pd_pulled_bytes"] - before
            assert pulled == _pool_share(d, [-(-len(b) // PS) for b in burst]), (p_tp, d_tp)
            idle(p, d)
        for s in everyone:
            assert s.page_problems() == [], s
    finally:
        _stop(*everyone)


def test_hf_checkpoint_replicated_kv_heads_across_a_reshard(tmp_path):
    # 2 KV heads (with the q/k/v biases of Qwen2), 8 attention heads: splits over tp=4
    case = Case("qwen2_kv2_heads8", "qwen2", heads=8, kv_heads=2, head_dim=8, hidden=64)
    directory, model = build(case, tmp_path)
    cfg = compose_config(["model=hf_local", f"model.path={directory}", "model.tokenizer=byte",
                          *ENGINE])
    tok = load_tokenizer(cfg.model)
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(2, int(model.config.vocab_size), size=n)]
               for n in (5, 23, 70)]
    refs = [hf_greedy(model, pr, 12) for pr in prompts]
    assert min(r.min_margin for r in refs) > 1e-4  # no near-ties to make this flaky
    p4, d1, d4 = (_scheduler(cfg, "prefill", tok, 4), _scheduler(cfg, "decode", tok, 1),
                  _scheduler(cfg, "decode", tok, 4))
    assert p4.runner.kv_replication == 2 and d4.runner.kv_replication == 2
    _start(p4, d1, d4)
    try:
        # P repeats each KV head on 2 devices, D1 holds each once: only first copies travel
        got = pd_one_by_one(p4, d1, prompts, room0=100)
        assert [ids for ids, _ in got] == [r.tokens for r in refs]
        # both replicate (same layout): today's pairing, no cut
        got = pd_one_by_one(p4, d4, prompts, room0=200)
        assert [ids for ids, _ in got] == [r.tokens for r in refs]
        idle(p4, d1, d4)
        assert d1.stats()["pd_pulled_bytes"] == \
            _pool_share(d1, [-(-len(pr) // PS) for pr in prompts])
    finally:
        _stop(p4, d1, d4)


def test_decode_prefix_cache_pulls_only_new_pages_through_a_reshard():
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "disaggregation.decode_prefix_cache=true",
                          *ENGINE])
    tok = load_tokenizer(cfg.model)
    colocated = _scheduler(cfg, "colocated", tok, 1)
    p, d = _scheduler(cfg, "prefill", tok, 2), _scheduler(cfg, "decode", tok, 1)
    _start(colocated, p, d)
    try:
        rng = np.random.default_rng(12)
        history = [int(t) for t in rng.integers(2, 256, size=4 * PS + 3)]
        for turn in range(3):
            prompt = history + [int(t) for t in rng.integers(2, 256, size=6)]
            before = d.stats()
            (ids_ref, _), = one_by_one(colocated, [prompt])
            (ids, _), = pd_one_by_one(p, d, [prompt], room0=9100 + turn)
            assert ids == ids_ref, turn
            after = d.stats()
            pulled = after["pd_pulled_pages"] - before["pd_pulled_pages"]
            held = after["pd_decode_cached_pages"] - before["pd_decode_cached_pages"]
            assert pulled + held == -(-len(prompt) // PS), turn
            assert after["pd_pulled_bytes"] - before["pd_pulled_bytes"] == \
                _pool_share(d, [pulled]), turn
            if turn:
                assert held == (len(history) - 1) // PS, turn  # only the new pages moved
            history = prompt + ids
        idle(colocated, p, d)
        assert d.page_problems() == [] and p.stats()["pd_skipped_pages"] > 0
    finally:
        _stop(colocated, p, d)
