"""The TPU attention kernel's SMEM/VMEM needs: the arithmetic, and the plan refusing a TPU
topology whose engine settings overflow them, naming the key (nothing is started)."""

from __future__ import annotations

import pytest

from pdtopo.config import tpu_kernel_budget as budget
from pdtopo.config.attention_blocks import blocks_for
from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import expand_plan


def test_smem_counts_page_tables_and_scalars():
    # 32 rows x 64 pages (1024 tokens of 16, already block-aligned) + kv_lens + cu +
    # kind_counts + 32 decode rows + (64 // 64 + 32) prefill blocks of 2 ints
    assert budget.smem_bytes(32, 1024, 16, 64) == 4 * (32 * 64 + 32 + 33 + 2 + 32 + 2 * 33)
    # rows are the batch bucket, widths block-aligned (4 pages of 16 per block)
    assert budget.smem_bytes(20, 1000, 16, 64) == 4 * (32 * 64 + 32 + 33 + 2 + 32 + 2 * 33)


def test_tiles_pad_lanes_and_sublanes():
    assert budget.tile_bytes(1, 1, 4) == 8 * 128 * 4      # a column takes a whole tile
    assert budget.tile_bytes(4, 128, 2) == 16 * 128 * 2   # bf16 packs 16 rows per tile
    assert budget.tile_bytes(64, 64, 4) == 64 * 128 * 4   # head_dim 64 pads to 128 lanes


def test_vmem_of_an_8b_layer_at_tp4():
    # 2 KV and 8 query heads of 128 per device, bf16: the table's anchors
    # (decode 8 sequences x 512 KV tokens, prefill 64 tokens x 4 heads = 256 rows x 1024)
    decode = blocks_for("decode", "bfloat16", "bfloat16", 8, 2, 128, 16, 8192)
    prefill = blocks_for("prefill", "bfloat16", "bfloat16", 8, 2, 128, 16, 8192)
    assert (decode.seqs, decode.kv_tokens, prefill.rows, prefill.kv_tokens) == (8, 512, 256,
                                                                                 1024)
    got = budget.vmem_bytes(prefill, 2, 128, 2, 2)
    kv = 2 * 2 * 2 * 1024 * 128 * 2
    q_out = 2 * 2 * 2 * 256 * 128 * 2
    state = 2 * (2 * 256 * 128 * 4 + 256 * 128 * 4)
    assert got == kv + q_out + state + 3 * 256 * 1024 * 4
    # decode: [4, 128] bf16 query tiles pad to 16 rows, [4, 1] columns to [8, 128]
    got = budget.vmem_bytes(decode, 2, 128, 2, 2)
    assert got == (2 * 2 * 2 * 512 * 128 * 2 + 2 * 2 * 8 * 2 * 16 * 128 * 2
                   + 2 * (2 * 8 * 128 * 4 + 8 * 128 * 4) + 3 * 8 * 512 * 4)
    assert max(got, budget.vmem_bytes(prefill, 2, 128, 2, 2)) < budget.VMEM_BUDGET


def _plan(*overrides):
    return expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_v6e8", *overrides]))


def test_plan_refuses_page_tables_over_smem():
    _plan("engine.max_running_requests=256", "engine.max_model_len=8192")  # 512 KiB: fits
    with pytest.raises(TopologyError, match="engine.max_running_requests") as err:
        _plan("engine.max_running_requests=256", "engine.max_model_len=32768")
    assert "SMEM" in str(err.value) and "engine.page_size" in str(err.value)
    # the XLA path has no such limit
    _plan("engine.max_running_requests=256", "engine.max_model_len=32768",
          "engine.attention_impl=gather")


def test_plan_refuses_pages_over_vmem():
    with pytest.raises(TopologyError, match="engine.page_size") as err:
        _plan("engine.page_size=4096", "model.num_kv_heads=8", "model.num_heads=64",
              "model.head_dim=256", "model.hidden_size=16384")
    assert "VMEM" in str(err.value)
