"""The TPU kernel's block table and the per-kind work the step inputs build from it."""

from __future__ import annotations

import numpy as np
import pytest

from pdtopo.config.attention_blocks import TABLE, block_counts, blocks_for, rule_for
from pdtopo.runtime.engine.model_runner import SeqChunk
from pdtopo.runtime.engine.step_inputs import StepGeometry, prepare_step


def test_anchors_and_the_rule_for_a_missing_key():
    got = blocks_for("prefill", "bfloat16", "bfloat16", 8, 2, 128, 64, 4096)
    assert (got.q_tokens, got.kv_tokens, got.rows) == (64, 1024, 256)
    assert ("prefill", "bfloat16", "bfloat16", 4, 128) in TABLE
    # not in the table: float32, head_dim 64, MHA -> at least 128 rows, 512 KV tokens
    got = blocks_for("prefill", "float32", "float32", 2, 2, 64, 16, 4096)
    assert (got.q_tokens, got.rows, got.kv_tokens) == (128, 128, 512)
    assert rule_for("decode", 3, 16) == (1, 8, 256)
    # a KV block is whole pages, at least one page
    assert blocks_for("decode", "float32", "float32", 3, 1, 64, 384, 64).kv_tokens == 384
    # a query block never exceeds the step's token bucket
    assert blocks_for("prefill", "float32", "float32", 4, 1, 64, 16, 16).q_tokens == 16
    with pytest.raises(ValueError, match="kind"):
        blocks_for("mixed", "float32", "float32", 4, 1, 64, 16, 16)


def test_grid_bounds_hold_the_worst_step():
    decode = blocks_for("decode", "float32", "float32", 4, 1, 64, 16, 64)
    prefill = blocks_for("prefill", "float32", "float32", 4, 1, 64, 16, 64)
    dec, pf = block_counts(decode, prefill, 64, 16)
    assert dec == 16  # up to 16 one-token sequences
    # whole blocks of the step's tokens plus one partial block per prefill sequence (at most
    # 16 sequences, each of two tokens or more)
    assert pf == 64 // prefill.q_tokens + 16


def test_step_inputs_map_every_token_back():
    geometry = StepGeometry(page_size=16, max_pages=8, max_rows=8, max_prefill_tokens=64,
                            layout_kind="ragged", kernel_shape=("float32", "float32", 4, 1, 64))
    chunks = [SeqChunk([1], 30, [1, 2]), SeqChunk([2] * 20, 0, [3, 4]),
              SeqChunk([3], 5, [5]), SeqChunk([4] * 3, 16, [6, 7])]
    step = prepare_step(chunks, geometry)
    md = step.md
    t = step.tokens.shape[0]
    assert list(md.kind_counts) == [2, 2]
    assert list(md.dec_seqs.reshape(-1)[:2]) == [0, 2]
    tq = md.pf_q_rows.shape[1]
    assert [tuple(b) for b in md.pf_blocks[:2]] == [(1, 0), (3, 0)]
    # token rows: decode outputs first, then prefill blocks of tq rows, then one zero row
    dec_cap = md.dec_seqs.size
    zero = dec_cap + md.pf_q_rows.size
    assert md.out_rows[0] == 0 and md.out_rows[21] == 1  # the two decode tokens
    assert list(md.out_rows[1:21]) == [dec_cap + i for i in range(20)]
    assert list(md.out_rows[22:25]) == [dec_cap + tq + i for i in range(3)]
    assert np.all(md.out_rows[25:] == zero) and t > 25
    assert list(md.pf_q_rows[0, :20]) == list(range(1, 21)) and np.all(md.pf_q_rows[0, 20:] == t)
