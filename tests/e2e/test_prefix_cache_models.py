"""The prefix cache with real model runners: greedy tokens with the cache on equal the cache off
(tiny model) and HF transformers' own greedy tokens (checkpoints written by transformers), for
shared prefixes of 0 pages, less than a page, one page and many pages, a prompt made only of
cached pages, colocated and through a P/D pair (real transfer servers and ZMQ side channel) where
P's hits reach D's reported `cached_tokens`; with D's own cache
(`disaggregation.decode_prefix_cache`), a conversation pulls only each turn's new pages, and a
claim of cached pages that does not match the prompt fails the room cleanly."""

from __future__ import annotations

import numpy as np
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.ports import free_port
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.base import wire_rows
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.scheduler_factory import make_scheduler
from pdtopo.runtime.settings import direct_process_context
from tests.support.hf_checkpoints import CASES, build, hf_greedy
from tests.support.prefix_engines import (
    ENGINE,
    NEW,
    PS,
    idle,
    make_req,
    one_by_one,
    pd_one_by_one,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.slow  # real runners


def _scheduler(cfg, role: str, tok):
    ports = {"http": free_port(), "transfer": free_port(), "zmq": free_port()}
    ctx = direct_process_context(cfg, role=role, name=f"{role}_0", extra={"ports": ports})
    return make_scheduler(ctx, ModelRunner(cfg.model, cfg.engine, build_mesh(1)), tok)


def test_tiny_model_cache_on_equals_cache_off_colocated_and_pd():
    cfg_on = compose_config(["model=tiny_llama", "model.num_layers=2", *ENGINE])
    cfg_off = compose_config(["model=tiny_llama", "model.num_layers=2",
                              "engine.prefix_cache=false", *ENGINE])
    tok = load_tokenizer(cfg_on.model)
    cases = shared_prefix_prompts(vocab=256)
    prompts = [p for _, p, _ in cases]
    on, off = _scheduler(cfg_on, "colocated", tok), _scheduler(cfg_off, "colocated", tok)
    p, d = _scheduler(cfg_on, "prefill", tok), _scheduler(cfg_on, "decode", tok)
    for s in (on, off, p, d):
        s.start()
    try:
        got_off = one_by_one(off, prompts)
        got_on = one_by_one(on, prompts)
        got_pd = pd_one_by_one(p, d, prompts, room0=7000)
        for (name, _, cached), (ids_off, c_off), (ids_on, c_on), (ids_pd, c_pd) in zip(
                cases, got_off, got_on, got_pd, strict=True):
            assert ids_on == ids_off, name
            assert ids_pd == ids_off, name
            assert (c_off, c_on, c_pd) == (0, cached, cached), name
        assert d.prefix_cache is None  # D keeps the RFC's chunk cache by default
        idle(on, p, d)
        assert on.page_problems() == [] and p.page_problems() == []
        assert on.stats()["tree_pages"] > 0 and p.stats()["tree_pages"] > 0
    finally:
        for s in (on, off, p, d):
            s.stop()


@pytest.mark.parametrize("name", ["llama_gqa3", "qwen3_head_dim"])
def test_hf_checkpoint_with_cache_gives_transformers_greedy_tokens(tmp_path, name):
    case = next(c for c in CASES if c.name == name)
    directory, model = build(case, tmp_path)
    cfg = compose_config(["model=hf_local", f"model.path={directory}", "model.tokenizer=byte",
                          *ENGINE])
    tok = load_tokenizer(cfg.model)
    cases = shared_prefix_prompts(vocab=int(model.config.vocab_size), seed=5)
    refs = [hf_greedy(model, p, NEW) for _, p, _ in cases]
    assert min(r.min_margin for r in refs) > 1e-4  # no near-ties to make this flaky
    colocated = _scheduler(cfg, "colocated", tok)
    p, d = _scheduler(cfg, "prefill", tok), _scheduler(cfg, "decode", tok)
    for s in (colocated, p, d):
        s.start()
    try:
        prompts = [pr for _, pr, _ in cases]
        got = one_by_one(colocated, prompts)
        got_pd = pd_one_by_one(p, d, prompts, room0=8000)
        for (label, _, cached), ref, (ids, c), (ids_pd, c_pd) in zip(
                cases, refs, got, got_pd, strict=True):
            assert ids == ref.tokens and ids_pd == ref.tokens, label
            assert c == c_pd == cached, label
        idle(colocated, p, d)
    finally:
        for s in (colocated, p, d):
            s.stop()


def test_decode_prefix_cache_pulls_only_new_pages_and_matches_colocated():
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "disaggregation.decode_prefix_cache=true",
                          *ENGINE])
    tok = load_tokenizer(cfg.model)
    colocated = _scheduler(cfg, "colocated", tok)
    p, d = _scheduler(cfg, "prefill", tok), _scheduler(cfg, "decode", tok)
    assert d.prefix_cache is not None
    for s in (colocated, p, d):
        s.start()
    try:
        rng = np.random.default_rng(11)
        history = [int(t) for t in rng.integers(2, 256, size=4 * PS + 3)]
        row_bytes = None
        for turn in range(4):
            prompt = history + [int(t) for t in rng.integers(2, 256, size=6)]
            before = d.stats()
            (ids_ref, _), = one_by_one(colocated, [prompt])
            (ids, _), = pd_one_by_one(p, d, [prompt], room0=9000 + turn)
            assert ids == ids_ref, turn
            after = d.stats()
            pulled = after["pd_pulled_pages"] - before["pd_pulled_pages"]
            held = after["pd_decode_cached_pages"] - before["pd_decode_cached_pages"]
            pages = -(-len(prompt) // PS)
            assert pulled + held == pages, (turn, pulled, held, pages)
            if turn == 0:
                assert held == 0
                row_bytes = (after["pd_pulled_bytes"] - before["pd_pulled_bytes"]) / \
                    wire_rows(pulled)
            else:  # D kept the conversation so far (every full page with KV): P sends the rest
                assert held == (len(history) - 1) // PS, (turn, held, len(history))
                got = after["pd_pulled_bytes"] - before["pd_pulled_bytes"]
                assert got == wire_rows(pages - held) * row_bytes, (turn, got, pages, held)
            history = prompt + ids
        idle(colocated, p, d)
        assert d.page_problems() == [] and d.stats()["tree_pages"] > 0
        assert p.stats()["pd_skipped_pages"] == d.stats()["pd_decode_cached_pages"] > 0
    finally:
        for s in (colocated, p, d):
            s.stop()


def test_a_claim_of_cached_pages_that_does_not_match_fails_the_room_cleanly():
    cfg = compose_config(["model=tiny_llama", "model.num_layers=2",
                          "disaggregation.decode_prefix_cache=true",
                          *ENGINE])
    tok = load_tokenizer(cfg.model)
    p = _scheduler(cfg, "prefill", tok)
    p.start()
    fake_d = SideChannel(bind=None, max_bytes=65536, name="fake-d")
    try:
        endpoint = f"127.0.0.1:{p.kv_manager.channel.port}"
        room = 4242
        prompt = list(range(10, 10 + 3 * PS + 2))
        fake_d.send_to(endpoint, m.Want(room=room, cached_pages=2, prefix_hash="0" * 32))
        req = make_req(prompt, room, p)
        p.submit(req)
        _, final = req.sink.collect(60)
        assert final.finish_reason["type"] == "abort", final.finish_reason
        assert "prefix hash mismatch" in final.finish_reason["message"]
        failed = fake_d.events.get(timeout=10).msg
        assert isinstance(failed, m.Failed) and failed.room == room
        assert "prefix hash mismatch" in failed.reason
        # the server goes on: the same prompt with an honest claim of 0 pages is served
        honest = SideChannel(bind=None, max_bytes=65536, name="honest-d")
        try:
            honest.send_to(endpoint, m.Want(room=room + 1))
            ok = make_req(prompt, room + 1, p)
            p.submit(ok)
            _, final = ok.sink.collect(60)
            assert final.finish_reason["type"] == "length"
            ready = honest.events.get(timeout=10).msg
            assert isinstance(ready, m.Ready) and ready.skip_pages == 0
            honest.send_to(endpoint, m.Failed(room=room + 1, reason="this test D pulls nothing"))
        finally:
            honest.close()
        idle(p)
    finally:
        fake_d.close()
        p.stop()
