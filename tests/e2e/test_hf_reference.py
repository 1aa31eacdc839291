"""HF transformers is the reference: checkpoints written by transformers itself (tests.support.hf_checkpoints
CASES: Llama with default / linear / llama3 RoPE and attention biases, Qwen2, Qwen3; tied and
untied; GQA ratios of 3, 1 and 7 query heads per KV head; current and older config formats) give,
in pdtopo, HF's last-prompt-position logits within 1e-4 and HF's 32 greedy tokens, on the
colocated engine and through a P/D pair (real runners, transfer servers and ZMQ side channel,
no HTTP), and through a launched 1P1D deployment (bootstrap, Rust router, P and D processes),
whose chat completion (a tokenizer and chat template saved by transformers beside the weights)
is HF's `apply_chat_template` + `generate`. Every prompt's smallest top-1 margin over the
generated positions is asserted to exceed the tolerance first, so a near-tie cannot make a
token comparison flaky.
"""

from __future__ import annotations

import httpx
import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, SeqChunk
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.support.e2e import (
    Deployment,
    deployment_overrides,
    generate,
    port_block,
    wait_pools_baseline,
)
from tests.support.engine_greedy import (
    greedy_colocated,
    greedy_fresh_colocated,
    greedy_fresh_pd,
    scheduler_for,
)
from tests.support.hf_checkpoints import (
    CASE_IDS,
    CASES,
    Case,
    build,
    hf_chat_ids,
    hf_generate,
    hf_greedy,
    prompts,
    save_chat_tokenizer,
)

ATOL = 1e-4
NEW_TOKENS = 32
ENGINE = ["model.tokenizer=byte", "engine.page_size=8", "engine.num_pages=64", "engine.max_model_len=96",
          "engine.max_running_requests=4", "engine.max_prefill_tokens=64",
          "disaggregation.kv_timeout_s=30"]
pytestmark = pytest.mark.slow  # 9 checkpoints x 3 engines


@pytest.fixture(scope="module", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """The colocated, P and D runners of one checkpoint compile the same step programs: a
    persistent cache for this module compiles each once (restored to off afterwards)."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    before = {k: getattr(jax.config, k) for k in keys}
    compilation_cache.reset_cache()
    jax.config.update(keys[0], str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update(keys[1], 0.0)
    jax.config.update(keys[2], 0)
    yield
    for k, v in before.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_checkpoint_matches_hf_colocated_and_pd(tmp_path, case):
    directory, model = build(case, tmp_path)
    cfg = compose_config(["model=hf_local", f"model.path={directory}", *ENGINE])
    batch = prompts(seed=sum(map(ord, case.name)))
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in batch]
    for prompt, ref in zip(batch, refs, strict=True):
        assert ref.min_margin > ATOL, (len(prompt), ref.min_margin)  # no near-ties

    tok = load_tokenizer(cfg.model)
    colocated, runner = scheduler_for(cfg, "colocated", tok)
    loaded = runner.config
    assert (loaded.architecture, loaded.tie_word_embeddings, loaded.num_kv_heads,
            loaded.head_dim) == (case.arch, case.tied, case.kv_heads, case.head_dim)
    assert loaded.rope.kind == (case.rope or {}).get("rope_type", "default")
    for prompt, ref in zip(batch, refs, strict=True):
        pages = list(range(1, 1 + -(-len(prompt) // 8)))
        logits = np.asarray(runner.forward([SeqChunk(prompt, 0, pages)]))[0]
        np.testing.assert_allclose(logits, ref.last_logits, rtol=0, atol=ATOL)
    assert greedy_colocated(colocated, batch, NEW_TOKENS) == [r.tokens for r in refs]
    assert greedy_fresh_pd(cfg, tok, batch, NEW_TOKENS) == [r.tokens for r in refs]


def _hf_logprobs(ref) -> np.ndarray:
    """HF's log-softmax at each generated position (float64)."""
    shifted = ref.step_logits - ref.step_logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def assert_logprobs_match_hf(got, ref, top: int = 5) -> None:
    """Per greedy token: its logprob and the top `top` (ids in order, values) within ATOL of
    HF's log-softmax. `got`: TokenLogprob-like (logprob, top) per position."""
    want = _hf_logprobs(ref)
    assert len(got) == len(ref.tokens)
    for i, (lp, token) in enumerate(zip(got, ref.tokens, strict=True)):
        assert abs(lp[0] - want[i, token]) < ATOL, (i, lp[0], want[i, token])
        best = np.argsort(-want[i], kind="stable")[:top]
        assert [t for t, _ in lp[1]] == [int(t) for t in best], (i, lp[1], best)
        np.testing.assert_allclose([v for _, v in lp[1]], want[i, best], rtol=0, atol=ATOL)


def test_logprobs_match_hf_colocated_and_pd(tmp_path):
    """Logprobs (top 5) of 32 greedy tokens equal HF's log-softmax within 1e-4, colocated and
    through a P/D pair (the first token's logprob and alternatives ride P's ready message)."""
    case = next(c for c in CASES if c.name == "qwen3_head_dim")
    directory, model = build(case, tmp_path)
    cfg = compose_config(["model=hf_local", f"model.path={directory}", *ENGINE])
    batch = prompts(seed=21)
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in batch]
    tok = load_tokenizer(cfg.model)
    for reqs in (greedy_fresh_colocated(cfg, tok, batch, NEW_TOKENS, logprobs=5),
                 greedy_fresh_pd(cfg, tok, batch, NEW_TOKENS, logprobs=5)):
        for req, ref in zip(reqs, refs, strict=True):
            assert req.output_ids == ref.tokens
            assert_logprobs_match_hf([(lp.logprob, lp.top) for lp in req.output_logprobs], ref)


def test_tensor_parallel_qwen3_matches_hf(tmp_path):
    """tp=2 splits Qwen3's heads (and its per-head q/k norms stay whole per head)."""
    case = Case("qwen3_tp2", "qwen3", heads=6, kv_heads=2, head_dim=16, hidden=48)
    directory, model = build(case, tmp_path)
    cfg = compose_config(["model=hf_local", f"model.path={directory}", *ENGINE])
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(2))
    assert runner.tp == 2
    prompt = prompts(seed=7, lengths=(30,))[0]
    ref = hf_greedy(model, prompt, NEW_TOKENS)
    assert ref.min_margin > ATOL
    ids, pos = list(prompt), 0
    pages = list(range(1, 9))
    for _ in range(NEW_TOKENS):
        logits = np.asarray(runner.forward([SeqChunk(ids[pos:], pos, pages)]))[0]
        if pos == 0:
            np.testing.assert_allclose(logits, ref.last_logits, rtol=0, atol=ATOL)
        pos = len(ids)
        ids.append(int(np.argmax(logits)))
    assert ids[len(prompt):] == ref.tokens


def test_launched_1p1d_serves_hf_tokens(tmp_path):
    """`pdtopo launch` 1P1D with a current-format Qwen3 checkpoint (rope_parameters only: the
    format that gave wrong tokens from the first one on) and a tokenizer saved by transformers
    (chat_template.jinja with a default system prompt, as SmolLM2-Instruct's): HF's greedy
    tokens through the proxy, batch requests included; a chat completion answers HF's
    `generate` on `apply_chat_template`'s ids; every pool back at its baseline afterwards."""
    case = next(c for c in CASES if c.name == "qwen3_head_dim")
    directory, model = build(case, tmp_path)
    hf_tok = save_chat_tokenizer(directory)
    batch = prompts(seed=11)
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in batch]
    assert min(r.min_margin for r in refs) > ATOL
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = hf_chat_ids(hf_tok, chat)
    chat_tokens = hf_generate(model, chat_ids, NEW_TOKENS)
    chat_ref = hf_greedy(model, chat_ids, NEW_TOKENS)
    assert chat_ref.min_margin > ATOL
    engine = [o for o in ENGINE if o.split("=")[0] not in ("model.tokenizer",
                                                           "engine.max_model_len")]
    dep = Deployment(tmp_path / "run", ["model=hf_local", f"model.path={directory}", *engine,
                                        "model.tokenizer=hf", "engine.max_model_len=128",
                                        *deployment_overrides(port_block(40))])
    dep.launch()
    try:
        sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        for prompt, ref in zip(batch, refs, strict=True):
            out = generate(dep.proxy_url, {"input_ids": prompt, "sampling_params": sampling})
            assert out["output_ids"] == ref.tokens
        outs = generate(dep.proxy_url, {"input_ids": batch, "sampling_params": sampling})
        assert [o["output_ids"] for o in outs] == [r.tokens for r in refs]
        out = generate(dep.proxy_url, {"input_ids": chat_ids, "sampling_params": sampling})
        assert out["output_ids"] == chat_tokens
        resp = httpx.post(f"{dep.proxy_url}/v1/chat/completions", timeout=120, json={
            "messages": chat, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["prompt_tokens"] == len(chat_ids)  # HF's template, no extra BOS
        assert body["usage"]["completion_tokens"] == NEW_TOKENS
        assert body["choices"][0]["message"]["content"] == hf_tok.decode(
            chat_tokens, skip_special_tokens=True)
        check_pd_sampling_api(dep.proxy_url, batch[0], refs[0], chat, chat_ref)
        wait_pools_baseline(dep)
    finally:
        dep.stop_and_check()


def check_pd_sampling_api(proxy: str, prompt: list[int], ref, chat: list[dict], chat_ref) -> None:
    """Through the router and a P/D pair: /generate's logprobs (top 5) and a chat's typed
    logprobs equal HF's; n > 1 (the router sends one body, with a room per completion for
    chat and one room for /generate) gives seeded, distinct, reproducible completions."""
    from openai.types.chat import ChatCompletion

    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    meta = generate(proxy, {"input_ids": prompt, "sampling_params": sampling,
                            "return_logprob": True, "top_logprobs_num": 5})["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.tokens
    assert_logprobs_match_hf(
        [(lp, [(t, v) for v, t, _ in top]) for (lp, _, _), top in
         zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True)], ref)
    resp = httpx.post(f"{proxy}/v1/chat/completions", timeout=120, json={
        "messages": chat, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 5})
    content = ChatCompletion.model_validate(resp.json()).choices[0].logprobs.content
    want = _hf_logprobs(chat_ref)
    np.testing.assert_allclose([c.logprob for c in content],
                               [want[i, t] for i, t in enumerate(chat_ref.tokens)], atol=ATOL)
    assert all(len(c.top_logprobs) == 5 for c in content)
    for path, body in (("/v1/chat/completions", {"messages": chat, "max_tokens": 8}),
                       ("/generate", {"input_ids": prompt,
                                      "sampling_params": {"max_new_tokens": 8}})):
        seeded = {"temperature": 1.0, "ignore_eos": True, "n": 4}
        if path == "/generate":  # the router keeps sglang's name (it drops `seed` there)
            body["sampling_params"].update(seeded, sampling_seed=11)
        else:
            body.update(seeded, seed=11)
        runs = []
        for _ in range(2):
            r = httpx.post(proxy + path, json=body, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            runs.append([c["message"]["content"] for c in out["choices"]] if "choices" in out
                        else [o["output_ids"] for o in out])
        assert len(runs[0]) == 4 and runs[0] == runs[1], (path, runs)
        assert len({str(x) for x in runs[0]}) == 4, (path, runs[0])


BF16_ATOL = 0.15  # bf16 logits (8-bit mantissa) of two implementations: measured <= 0.093


def test_bfloat16_checkpoint_serves_hf_bfloat16_tokens(tmp_path):
    """A bfloat16 checkpoint saved by transformers loads (cast per block, no float32 copy of the
    model) and, with engine.dtype=bfloat16, follows HF's bfloat16 run: fed HF's tokens, every
    step's logits are within bf16 tolerance of HF's and pick HF's token wherever HF's top-1
    margin exceeds twice that tolerance; served greedily (colocated and through a P/D pair) it
    gives HF's tokens up to HF's first near-tie, where the two may part."""
    import torch

    case = Case("llama_bf16", "llama", heads=8, kv_heads=2, head_dim=16, hidden=128, layers=3,
                intermediate=192)
    _, model = build(case, tmp_path / "f32")
    model = model.to(torch.bfloat16)
    directory = tmp_path / "bf16"
    model.save_pretrained(str(directory))
    written = (directory / "config.json").read_text()
    assert '"bfloat16"' in written, written  # a bf16 checkpoint, as transformers writes one
    cfg = compose_config(["model=hf_local", f"model.path={directory}", *ENGINE,
                          "engine.dtype=bfloat16"])
    batch = prompts(seed=3)
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in batch]
    tok = load_tokenizer(cfg.model)
    colocated, runner = scheduler_for(cfg, "colocated", tok)
    assert runner.params["layers"][0]["wq"].dtype == jax.numpy.bfloat16
    compared = 0
    for prompt, ref in zip(batch, refs, strict=True):
        ids = list(prompt) + ref.tokens
        pages = list(range(1, 1 + -(-len(ids) // 8)))
        logits = np.asarray(runner.forward([SeqChunk(prompt, 0, pages)]))[0]
        for i in range(NEW_TOKENS):
            if i:
                pos = len(prompt) + i - 1
                logits = np.asarray(runner.forward([SeqChunk([ids[pos]], pos, pages)]))[0]
            np.testing.assert_allclose(logits, ref.step_logits[i], rtol=0, atol=BF16_ATOL)
            top2 = np.sort(ref.step_logits[i])[-2:]
            if top2[1] - top2[0] > 2 * BF16_ATOL:
                assert int(np.argmax(logits)) == ref.tokens[i], (i, top2)
                compared += 1
    assert compared >= NEW_TOKENS // 2, compared  # enough steps are clear of near-ties

    def sure(ref) -> int:
        """Tokens before HF's first near-tie: there both must agree."""
        top2 = np.sort(ref.step_logits, axis=-1)[:, -2:]
        close = np.nonzero(top2[:, 1] - top2[:, 0] < 2 * BF16_ATOL)[0]
        return int(close[0]) if close.size else NEW_TOKENS

    checked = [sure(r) for r in refs]
    got = greedy_colocated(colocated, batch, NEW_TOKENS)
    got_pd = greedy_fresh_pd(cfg, tok, batch, NEW_TOKENS)
    for ours, ours_pd, ref, n in zip(got, got_pd, refs, checked, strict=True):
        assert ours[:n] == ref.tokens[:n]
        assert ours_pd[:n] == ref.tokens[:n]
