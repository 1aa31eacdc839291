"""The TPU attention kernel's SMEM/VMEM needs: the arithmetic, and the plan refusing a TPU
topology whose engine settings overflow them, naming the key (nothing is started)."""

from __future__ import annotations

import pytest

from pdtopo.config import tpu_kernel_budget as budget
from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import expand_plan


def test_smem_counts_page_tables_and_scalars():
    # 32 rows x 64 pages (1024 tokens of 16, already block-aligned) + kv_lens + cu + num_seqs
    assert budget.smem_bytes(32, 1024, 16) == 4 * (32 * 64 + 32 + 33 + 1)
    # rows are the batch bucket, widths block-aligned (4 pages of 16 per block)
    assert budget.smem_bytes(20, 1000, 16) == 4 * (32 * 64 + 32 + 33 + 1)


def test_vmem_of_an_8b_layer_at_tp4():
    # 2 KV and 8 query heads of 128 per device, bf16 pages of 16 (4 per block)
    got = budget.vmem_bytes(16, 2, 8, 128, 2)
    assert got == 2 * 2 * 4 * 16 * 2 * 128 * 2 + 2 * 2 * 16 * 8 * 128 * 4 + 8 * 16 * 130 * 4
    assert got < budget.VMEM_BUDGET


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
