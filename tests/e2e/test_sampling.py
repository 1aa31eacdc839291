"""Batched sampling: greedy, temperature 0, top-k=1, seeded reproducibility, per-request keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdtopo.runtime.engine.request import InvalidRequest, SamplingParams
from pdtopo.runtime.engine.sampling import RowParams, Sampler, request_key

VOCAB = 64


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.PRNGKey(7), (4, VOCAB), jnp.float32) * 2.0


def test_greedy_variants_match_argmax(logits):
    s = Sampler()
    want = np.asarray(jnp.argmax(logits, -1))
    greedy = s.sample(logits, [RowParams(0.0, -1, 1.0, i, 3) for i in range(4)]).tokens
    top1 = s.sample(logits, [RowParams(1.5, 1, 1.0, i, 3) for i in range(4)]).tokens
    # mixed batch: temperature-0 rows stay greedy next to sampled rows
    mixed = s.sample(logits, [RowParams(0.0, -1, 1.0, 0, 0), RowParams(1.0, -1, 1.0, 1, 0),
                              RowParams(0.0, -1, 0.5, 2, 0), RowParams(1.0, 1, 1.0, 3, 0)]).tokens
    np.testing.assert_array_equal(greedy, want)
    np.testing.assert_array_equal(top1, want)
    assert mixed[0] == want[0] and mixed[2] == want[2] and mixed[3] == want[3]


def test_seeded_sampling_is_reproducible_and_uses_the_request_key(logits):
    s = Sampler()
    rows = [RowParams(1.0, -1, 1.0, seed, step) for seed, step in
            [(1, 0), (1, 1), (2**40 + 5, 0), (123, 9)]]
    a = s.sample(logits, rows).tokens
    b = s.sample(logits, rows).tokens
    np.testing.assert_array_equal(a, b)
    # same request params in another row/batch size -> same token (no batch coupling)
    single = s.sample(logits[2:3], [rows[2]]).tokens
    assert single[0] == a[2]
    for j, r in enumerate(rows):  # inverse CDF in vocabulary order, the request key's uniform
        u = float(jax.random.uniform(request_key(r.seed, r.step), dtype=jnp.float32))
        cdf = np.cumsum(np.asarray(jax.nn.softmax(logits[j]), np.float64))
        assert int(np.searchsorted(cdf, u * cdf[-1], side="right")) == a[j]


def test_different_seeds_or_steps_give_different_streams():
    s = Sampler()
    flat = jnp.zeros((1, VOCAB))
    draws = {int(s.sample(flat, [RowParams(1.0, -1, 1.0, seed, 0)]).tokens[0]) for seed in range(20)}
    assert len(draws) > 5
    steps = {int(s.sample(flat, [RowParams(1.0, -1, 1.0, 3, i)]).tokens[0]) for i in range(20)}
    assert len(steps) > 5


def test_top_k_and_top_p_restrict_the_support():
    s = Sampler()
    logits = jnp.tile(jnp.linspace(0.0, 3.0, VOCAB)[None, :], (1, 1))  # best id = VOCAB-1
    topk = {int(s.sample(logits, [RowParams(5.0, 3, 1.0, i, 0)]).tokens[0]) for i in range(40)}
    assert topk <= {VOCAB - 1, VOCAB - 2, VOCAB - 3} and len(topk) > 1
    peaked = jnp.zeros((1, VOCAB)).at[0, 5].set(10.0).at[0, 9].set(9.0)
    topp = {int(s.sample(peaked, [RowParams(1.0, -1, 0.5, i, 0)]).tokens[0]) for i in range(30)}
    assert topp == {5}
    wide = {int(s.sample(peaked, [RowParams(1.0, -1, 0.99, i, 0)]).tokens[0]) for i in range(60)}
    assert wide == {5, 9}


def test_padding_rows_are_ignored(logits):
    out = Sampler().sample(logits, [RowParams(0.0, -1, 1.0, 0, 0)]).tokens
    assert out.shape == (1,)


def _sp(d):
    return SamplingParams.from_dict(d, default_max_new_tokens=16, max_new_tokens_limit=64,
                                    vocab_size=VOCAB)


def test_sampling_params_validation_names_the_field():
    p = _sp({"temperature": 0, "top_k": 0, "sampling_seed": 5, "stop": "x",
             "frequency_penalty": 0.0, "skip_special_tokens": True})
    assert p.is_greedy and p.top_k == -1 and p.seed == 5 and p.stop == ["x"]
    assert _sp({}).max_new_tokens == 16 and not _sp({}).max_new_tokens_given
    bad = [({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 65}, "max_new_tokens"),
           ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
           ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
           ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"),
           ({"stop": [""]}, "stop"), ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
           ({"ignore_eos": "yes"}, "ignore_eos"), ({"bogus": 1}, "bogus"),
           ({"presence_penalty": 2.5}, "presence_penalty"),
           ({"frequency_penalty": "x"}, "frequency_penalty"),
           ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
           ({"n": 0}, "n"), ({"n": 129}, "n")]
    for d, name in bad:
        with pytest.raises(InvalidRequest) as ei:
            _sp(d)
        assert ei.value.field == f"sampling_params.{name}", d
        assert name in ei.value.message
