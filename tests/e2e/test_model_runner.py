"""ModelRunner: paged forward vs the dense reference, chunking, batching invariance, TP."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, SeqChunk, bucket
from pdtopo.runtime.model import llama

PAGE = 4  # small pages: short prompts still span several pages


def _cfg(**engine):
    cfg = compose_config(["model=tiny_llama"])
    eng = OmegaConf.merge(cfg.engine, {"page_size": PAGE, "num_pages": 96,
                                       "max_model_len": 64, **engine})
    return cfg.model, eng


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    model, eng = _cfg()
    return ModelRunner(model, eng, build_mesh(1))


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


class PageAlloc:
    """Hands out distinct pages (never 0) for the tests."""

    def __init__(self, start: int = 1):
        self.next = start

    def take(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // PAGE)
        pages = list(range(self.next, self.next + n))
        self.next += n
        return pages


def _dense(runner: ModelRunner, tokens: list[int]) -> np.ndarray:
    return np.asarray(llama.dense_forward(runner.params, runner.config, np.array(tokens)))


def test_prefill_then_decode_matches_dense(runner):
    prompt = _prompt(0, 13)  # 4 pages of 4
    pages = PageAlloc().take(24)
    logits = np.asarray(runner.forward([SeqChunk(prompt, 0, pages)]))
    assert logits.shape == (1, runner.config.vocab_size) and logits.dtype == np.float32
    ref = _dense(runner, prompt)
    np.testing.assert_allclose(logits[0], ref[-1], rtol=1e-4, atol=1e-4)

    # Greedy decode through the paged pool; one dense pass over the final sequence then checks
    # every step's logits and that dense greedy picks the same token at every position.
    seq, steps = list(prompt), [logits[0]]
    for _ in range(8):
        tok = int(np.argmax(steps[-1]))
        steps.append(np.asarray(runner.forward([SeqChunk([tok], len(seq), pages)]))[0])
        seq.append(tok)
    dense = _dense(runner, seq)
    for i, out in enumerate(steps):
        pos = len(prompt) - 1 + i
        np.testing.assert_allclose(out, dense[pos], rtol=1e-4, atol=1e-4)
        if pos + 1 < len(seq):
            assert int(np.argmax(dense[pos])) == seq[pos + 1]  # greedy tokens identical


def test_chunked_prefill_and_token_by_token_equal_one_chunk(runner):
    prompt = _prompt(1, 11)
    alloc = PageAlloc(40)
    whole = np.asarray(runner.forward([SeqChunk(prompt, 0, alloc.take(11))]))[0]

    pages = alloc.take(11)
    for i, t in enumerate(prompt):  # token by token: each step reads what the last wrote
        step = np.asarray(runner.forward([SeqChunk([t], i, pages)]))[0]
    np.testing.assert_allclose(step, whole, rtol=1e-4, atol=1e-4)

    pages = alloc.take(11)
    runner.forward([SeqChunk(prompt[:6], 0, pages)])  # chunk boundary inside a page
    chunked = np.asarray(runner.forward([SeqChunk(prompt[6:], 6, pages)]))[0]
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)


def test_batching_invariance(runner):
    lens = [1, 3, 5, 8, 9, 12, 2, 7]
    prompts = [_prompt(10 + i, n) for i, n in enumerate(lens)]
    alloc = PageAlloc(1)
    alone = []
    for p in prompts:
        alone.append(np.asarray(runner.forward([SeqChunk(p, 0, alloc.take(len(p)))]))[0])
    pages = [alloc.take(len(p) + 1) for p in prompts]
    batch = np.asarray(runner.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages, strict=True)]))
    assert batch.shape == (8, runner.config.vocab_size)
    for i in range(8):
        np.testing.assert_allclose(batch[i], alone[i], rtol=1e-4, atol=1e-4)

    # A mixed step: decode chunks for half the sequences, prefill continuations for the rest.
    nxt = [int(np.argmax(b)) for b in batch]
    chunks = [SeqChunk([nxt[i]], lens[i], pages[i]) for i in range(8)]
    mixed = np.asarray(runner.forward(chunks))
    for i in (0, 3, 5):
        ref = _dense(runner, prompts[i] + [nxt[i]])[-1]
        np.testing.assert_allclose(mixed[i], ref, rtol=1e-4, atol=1e-4)


def test_buckets_limit_recompiles(runner):
    alloc = PageAlloc(1)
    before = runner.compile_count()
    pages = [alloc.take(8) for _ in range(3)]
    for step in range(4):  # decode steps of a batch of 3 stay in one bucket (B=4, T=4, P=2)
        runner.forward([SeqChunk([1], 4 + step, pg) for pg in pages])
    assert runner.compile_count() - before <= 1
    assert bucket(1) == 1 and bucket(3) == 4 and bucket(8) == 8 and bucket(9) == 16


def test_bad_chunks_raise_clear_errors(runner):
    with pytest.raises(ValueError, match="page 0 is reserved"):
        runner.forward([SeqChunk([1, 2], 0, [0])])
    with pytest.raises(ValueError, match="need 2"):
        runner.forward([SeqChunk([1] * 5, 0, [1])])
    with pytest.raises(ValueError, match="token id out of range"):
        runner.forward([SeqChunk([runner.config.vocab_size], 0, [1])])
    with pytest.raises(ValueError, match="empty"):
        runner.forward([])


def test_kv_layout_and_pool_format(runner):
    layout = runner.kv_layout()
    cfg = runner.config
    assert layout["num_entries"] == 2 * cfg.num_layers == len(runner.kv_caches)
    assert layout["page_size"] == PAGE and layout["tp"] == 1
    assert layout["dtype"] == "float32"
    for arr in runner.kv_caches:
        assert arr.shape == (runner.num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_device(runner, tp):
    model, eng = _cfg()
    sharded = ModelRunner(model, eng, build_mesh(tp))
    spec = sharded.kv_caches[0].sharding.spec
    assert tuple(spec) == (None, None, "tp", None)
    lens = [9, 3, 14]
    prompts = [_prompt(30 + i, n) for i, n in enumerate(lens)]
    alloc = PageAlloc(1)
    pages = [alloc.take(n + 4) for n in lens]
    outs = {}
    for name, r in (("one", runner), ("tp", sharded)):
        logits = np.asarray(r.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages, strict=True)]))
        toks = [int(np.argmax(x)) for x in logits]
        seqs = [[t] for t in toks]
        for _ in range(3):
            step = np.asarray(r.forward([SeqChunk([s[-1]], n + len(s) - 1, pg)
                                         for s, n, pg in zip(seqs, lens, pages, strict=True)]))
            for s, x in zip(seqs, step, strict=True):
                s.append(int(np.argmax(x)))
        outs[name] = (logits, step, seqs)
    np.testing.assert_allclose(outs["tp"][0], outs["one"][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs["tp"][1], outs["one"][1], rtol=1e-4, atol=1e-4)
    assert outs["tp"][2] == outs["one"][2]


def test_tp_must_divide_kv_heads_or_be_a_multiple_of_them():
    model, eng = _cfg()
    model = OmegaConf.merge(model, {"num_kv_heads": 2, "num_heads": 6})  # 3 devices: neither
    with pytest.raises(ValueError, match=r"num_kv_heads % tp == 0 .* or tp % model.num_kv_heads"):
        ModelRunner(model, eng, build_mesh(3))


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 4), (1, 2), (1, 4)])
def test_fewer_kv_heads_than_tp_repeat_them_with_the_same_tokens(kv_heads, tp):
    """kv_heads < tp: every KV head is repeated on tp / kv_heads devices; the logits and greedy
    tokens equal the one-device runner of the same checkpoint (same seed)."""
    model, eng = _cfg()
    model = OmegaConf.merge(model, {"num_kv_heads": kv_heads, "num_heads": 8})
    one = ModelRunner(model, eng, build_mesh(1))
    wide = ModelRunner(model, eng, build_mesh(tp))
    assert wide.kv_replication == tp // kv_heads and wide.model_config.num_kv_heads == kv_heads
    assert wide.config.num_kv_heads == tp and wide.kv_layout()["kv_heads"] == tp
    assert wide.kv_caches[0].shape[2] == tp  # one KV head per device
    lens = [11, 5]
    prompts = [_prompt(70 + i, n) for i, n in enumerate(lens)]
    alloc = PageAlloc(1)
    pages = [alloc.take(n + 4) for n in lens]
    outs = {}
    for name, r in (("one", one), ("wide", wide)):
        logits = np.asarray(r.forward([SeqChunk(p, 0, pg)
                                       for p, pg in zip(prompts, pages, strict=True)]))
        seqs = [[int(np.argmax(x))] for x in logits]
        for _ in range(4):
            step = np.asarray(r.forward([SeqChunk([s[-1]], n + len(s) - 1, pg)
                                         for s, n, pg in zip(seqs, lens, pages, strict=True)]))
            for s, x in zip(seqs, step, strict=True):
                s.append(int(np.argmax(x)))
        outs[name] = (logits, seqs)
    np.testing.assert_allclose(outs["wide"][0], outs["one"][0], rtol=1e-4, atol=1e-4)
    assert outs["wide"][1] == outs["one"][1]


def test_bfloat16_runner_close_to_float32(runner):
    model, eng = _cfg(dtype="bfloat16", kv_dtype="bfloat16")
    r16 = ModelRunner(model, eng, build_mesh(1))
    assert r16.kv_layout()["dtype"] == "bfloat16"
    prompt = _prompt(5, 10)
    a = np.asarray(r16.forward([SeqChunk(prompt, 0, [1, 2, 3])]))[0]
    b = np.asarray(runner.forward([SeqChunk(prompt, 0, [60, 61, 62])]))[0]
    assert a.dtype == np.float32
    # bf16 has ~3 significant digits; logits are O(1-10)
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()
    assert np.corrcoef(a, b)[0, 1] > 0.99


def test_warmup_compiles_buckets_without_touching_pool_pages():
    model, eng = _cfg(max_running_requests=4, max_prefill_tokens=16)
    r = ModelRunner(model, eng, build_mesh(1))
    prompt = _prompt(7, 6)
    before = np.asarray(r.forward([SeqChunk(prompt, 0, [5, 6])]))[0]
    snapshot = [np.asarray(c)[1:] for c in r.kv_caches]
    count = r.compile_count()
    r.warmup()
    # decode at B = 1, 2, 4 and prefill at T = 2, 4, 8, 16 (T=8, B=1 was compiled above)
    assert r.compile_count() == count + 6
    for old, new in zip(snapshot, r.kv_caches, strict=True):
        np.testing.assert_array_equal(np.asarray(new)[1:], old)
    again = np.asarray(r.forward([SeqChunk(prompt, 0, [7, 8])]))[0]
    np.testing.assert_allclose(again, before, rtol=1e-5, atol=1e-5)
