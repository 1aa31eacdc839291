"""The device sampler against HF transformers' logits processors on the same logits: top-k,
top-p and min_p masks, the repetition penalty, OpenAI's frequency/presence penalties (a NumPy
reference), logprobs, and the device-side penalty counts as a request goes on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pdtopo.runtime.engine.penalties import PenaltyHistory
from pdtopo.runtime.engine.sampling import RowParams, Sampler, _filters, _row_params

VOCAB = 500


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (rows, VOCAB)).astype(np.float32)


def _hf_kept(logits: np.ndarray, r: RowParams) -> np.ndarray:
    """HF's warpers in generate()'s order; the tokens left finite."""
    scores = torch.tensor(logits[None])
    ids = torch.zeros((1, 1), dtype=torch.long)
    warpers = [TemperatureLogitsWarper(r.temperature)]
    if r.top_k > 0:
        warpers.append(TopKLogitsWarper(r.top_k))
    if r.top_p < 1.0:
        warpers.append(TopPLogitsWarper(r.top_p))
    if r.min_p > 0:
        warpers.append(MinPLogitsWarper(r.min_p))
    for w in warpers:
        scores = w(ids, scores)
    return np.isfinite(scores[0].numpy())


CASES = [RowParams(1.0, 5, 1.0, 0, 0), RowParams(0.7, -1, 0.8, 0, 0),
         RowParams(1.3, 50, 0.9, 0, 0), RowParams(1.0, -1, 1.0, 0, 0, min_p=0.05),
         RowParams(0.5, 40, 0.95, 0, 0, min_p=0.1), RowParams(2.0, -1, 0.3, 0, 0),
         RowParams(1.0, 1000, 0.999, 0, 0), RowParams(1.0, -1, 1.0, 0, 0, min_p=0.9)]


def test_filters_keep_what_hf_warpers_keep():
    logits = _logits(len(CASES))
    p = {k: jnp.asarray(v) for k, v in _row_params(CASES, len(CASES)).items()}
    scaled = jnp.asarray(logits) / p["temperature"][:, None]
    kept = np.asarray(jax.jit(_filters)(scaled, p))
    for i, r in enumerate(CASES):
        want = _hf_kept(logits[i], r)
        np.testing.assert_array_equal(kept[i], want, err_msg=f"row {i}: {r}")
        assert 0 < want.sum() < VOCAB or (r.top_k > VOCAB and r.top_p > 0.99)


def test_sampled_tokens_stay_in_the_kept_set():
    logits = _logits(1, seed=3)
    r = RowParams(1.0, 20, 0.7, 0, 0, min_p=0.02)
    kept = _hf_kept(logits[0], r)
    s = Sampler()
    draws = {int(s.sample(jnp.asarray(logits), [RowParams(1.0, 20, 0.7, seed, 0, min_p=0.02)])
                 .tokens[0]) for seed in range(60)}
    assert len(draws) > 1 and all(kept[t] for t in draws)


def test_draw_frequencies_follow_the_probabilities():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 4], np.float32))
    s = Sampler()
    rows = [RowParams(1.0, -1, 1.0, seed, 0) for seed in range(64)]
    counts = np.zeros(8)
    for step in range(16):  # 1024 draws: 64 seeds x 16 steps in one batch each
        toks = s.sample(jnp.asarray(np.repeat(logits, 64, 0)),
                        [RowParams(1.0, -1, 1.0, r.seed, step) for r in rows]).tokens
        counts += np.bincount(toks, minlength=8)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq[:4], [0.5, 0.3, 0.15, 0.05], atol=0.05)
    assert counts[4:].sum() == 0


def _greedy_logprobs(s: Sampler, logits: np.ndarray, r: RowParams) -> tuple[float, list]:
    res = s.sample(jnp.asarray(logits[None]), [r])
    return res.token_logprob(0, 20)


def test_repetition_penalty_matches_hf_and_counts_follow_the_request():
    logits = _logits(1, seed=5)[0]
    prompt, outputs = [3, 7, 7, 11], [42, 3]
    ids = torch.tensor([prompt + outputs])
    hf = RepetitionPenaltyLogitsProcessor(1.3)(ids, torch.tensor(logits[None]))[0].numpy()
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(hf)))
    hist = PenaltyHistory(1, prompt, outputs)
    r = RowParams(0.0, -1, 1.0, 0, len(outputs), repetition_penalty=1.3, logprobs=20,
                  history=hist)
    s = Sampler()
    lp, top = _greedy_logprobs(s, logits, r)
    token = int(np.argmax(hf))
    assert top[0][0] == token
    assert lp == pytest.approx(float(want[token]), abs=1e-5)
    np.testing.assert_allclose([v for _, v in top], np.sort(want)[::-1][:20], atol=1e-5)


def test_frequency_and_presence_penalties_match_openais_formula():
    logits = _logits(1, seed=6)[0]
    prompt, outputs = [1, 2], [5, 5, 9, 2]
    counts = np.bincount(outputs, minlength=VOCAB)
    ref = logits - 0.7 * counts - 0.4 * (counts > 0)          # prompt tokens are not counted
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(ref)))
    r = RowParams(0.0, -1, 1.0, 0, 4, presence_penalty=0.4, frequency_penalty=0.7,
                  logprobs=20, history=PenaltyHistory(2, prompt, outputs))
    _, top = _greedy_logprobs(Sampler(), logits, r)
    np.testing.assert_allclose([v for _, v in top], np.sort(want)[::-1][:20], atol=1e-5)
    assert [t for t, _ in top][:5] == list(np.argsort(-want, kind="stable")[:5])


def test_device_counts_equal_counts_rebuilt_from_ids():
    """Each step the program adds the sampled token on the device; a fresh sampler (a slot
    built from the ids, as on D after P) gives the same logprobs at every step."""
    logits = _logits(1, seed=8)
    prompt, outputs = [4, 4, 9], []
    s = Sampler(penalty_slots=2)
    for step in range(6):
        row = RowParams(0.0, -1, 1.0, 0, step, presence_penalty=1.5, frequency_penalty=1.0,
                        repetition_penalty=1.2, logprobs=5,
                        history=PenaltyHistory(7, prompt, outputs))
        lp, top = _greedy_logprobs(s, logits[0], row)
        lp_fresh, top_fresh = _greedy_logprobs(Sampler(), logits[0], row)
        assert top == top_fresh and lp == lp_fresh
        outputs.append(top[0][0])
    assert len(set(outputs)) > 1  # the penalties moved the argmax off its first choice


def test_slots_are_reused_least_recent_first_and_rebuilt():
    logits = jnp.asarray(_logits(2, seed=9))
    s = Sampler(penalty_slots=2)

    def row(serial, outputs):
        return RowParams(0.0, -1, 1.0, 0, len(outputs), frequency_penalty=2.0, logprobs=0,
                         history=PenaltyHistory(serial, [], outputs))

    first = s.sample(logits, [row(1, [0]), row(2, [1])])
    s.sample(logits, [row(3, []), row(4, [])])      # evicts 1 and 2
    again = s.sample(logits, [row(1, [0]), row(2, [1])])  # rebuilt from ids
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_allclose(first.logprobs, again.logprobs)
    with pytest.raises(ValueError, match="2 slots"):
        s.sample(jnp.asarray(_logits(3)), [row(5, []), row(6, []), row(7, [])])


def test_logprobs_are_the_sampled_distribution():
    logits = _logits(2, seed=10)
    s = Sampler()
    res = s.sample(jnp.asarray(logits), [RowParams(0.0, -1, 1.0, 0, 0, logprobs=3),
                                         RowParams(0.8, -1, 1.0, 4, 0, logprobs=0)])
    ref0 = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[0])))
    ref1 = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[1] / 0.8)))
    lp0, top0 = res.token_logprob(0, 3)
    assert [t for t, _ in top0] == list(np.argsort(-ref0)[:3]) and top0[0][0] == res.tokens[0]
    assert lp0 == pytest.approx(ref0[res.tokens[0]], abs=1e-5)
    lp1, top1 = res.token_logprob(1, 0)
    assert top1 == [] and lp1 == pytest.approx(ref1[res.tokens[1]], abs=1e-5)


def _numpy_penalised(logits: np.ndarray, prompt: list[int], outputs: list[int],
                     presence: float, frequency: float, repetition: float) -> np.ndarray:
    """HF's repetition rule over prompt + outputs, then OpenAI's terms over outputs (NumPy)."""
    x = logits.astype(np.float64).copy()
    seen = np.zeros(x.shape[0], bool)
    seen[prompt + outputs] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=x.shape[0])
    return x - frequency * counts - presence * (counts > 0)


PENALTIES = {"repetition": dict(repetition_penalty=1.3),
             "frequency_presence": dict(frequency_penalty=0.6, presence_penalty=0.4)}


@pytest.mark.parametrize("position", [0, 3, 7])
@pytest.mark.parametrize("kind", list(PENALTIES))
def test_penalised_row_keeps_its_counts_beside_unpenalised_rows(kind, position):
    """A penalised greedy request decoded step by step in a batch of 8 whose other rows
    (unpenalised requests and padding) pick the same tokens it does: its device-side counts
    must see every token it generated (no dummy-slot write may race its own), so its tokens
    equal a NumPy reference over its own history and the same request sampled alone."""
    kw = PENALTIES[kind]
    rng = np.random.default_rng(11)
    base = rng.normal(0, 1, VOCAB).astype(np.float32)
    base[rng.choice(VOCAB, 6, replace=False)] += 8.0  # a few strong tokens: repeats likely
    prompt, steps = [1, 2, 3], 16

    def run(rows_in_batch: int) -> list[int]:
        s, outputs = Sampler(penalty_slots=4), []
        for step in range(steps):
            logits = base + rng_step[step]
            rows = [RowParams(0.0, -1, 1.0, 0, step) for _ in range(rows_in_batch)]
            at = position if rows_in_batch > 1 else 0
            rows[at] = RowParams(0.0, -1, 1.0, 0, step, history=PenaltyHistory(
                1, prompt, outputs), **kw)
            # every row (and the 2 padding rows) sees the same logits
            batch = np.tile(logits, (rows_in_batch + 2, 1))
            outputs.append(int(s.sample(jnp.asarray(batch), rows).tokens[at]))
        return outputs

    rng_step = rng.normal(0, 0.01, (steps, VOCAB)).astype(np.float32)
    ref: list[int] = []
    for step in range(steps):
        x = _numpy_penalised(base + rng_step[step], prompt, ref,
                             kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0),
                             kw.get("repetition_penalty", 1.0))
        ref.append(int(np.argmax(x)))
    assert len(set(ref)) > 3  # the penalty moves the argmax around
    assert run(1) == ref
    assert run(8) == ref
