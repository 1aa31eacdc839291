"""The KV pool each instance gets, shown before traffic: `engine.kv_memory_fraction=auto`
sizes TPU pools from device memory and keeps `engine.num_pages` on the CPU; `pdtopo render`
prints each P/D program's pool (configured, or estimated from the chip's memory)."""

from __future__ import annotations

import math

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.config.pool_reserve import reserved_pages
from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import (
    AUTO_KV_MEMORY_FRACTION,
    resolved_kv_memory_fraction,
    runtime_settings,
)
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.plan.kv_pool import pool_summaries
from pdtopo.model_config.spec import model_config_from_cfg
from tests.support.e2e import run_pdtopo


def _plan(overrides):
    cfg = compose_config(["model=tiny_llama", *overrides])
    return cfg, expand_plan(cfg, run_dir="/tmp/unused", cpus=[0, 1])


def test_auto_fraction_sizes_tpu_pools_from_memory_and_keeps_num_pages_elsewhere():
    assert compose_config([]).engine.kv_memory_fraction == "auto"
    assert resolved_kv_memory_fraction("auto", "tpu") == AUTO_KV_MEMORY_FRACTION == 0.9
    assert resolved_kv_memory_fraction("auto", "cpu") is None
    assert resolved_kv_memory_fraction(None, "tpu") is None
    assert resolved_kv_memory_fraction(0.5, "cpu") == 0.5
    with pytest.raises(TopologyError, match="engine.kv_memory_fraction"):
        runtime_settings(compose_config(["engine.kv_memory_fraction=most"]), "decode")


def test_cpu_pools_show_their_configured_pages_and_tokens():
    cfg, plan = _plan(["topology=1p1d_cpu", "engine.num_pages=300", "engine.page_size=8"])
    pools = pool_summaries(cfg, plan, model_config_from_cfg(cfg.model))
    assert pools == {"prefill_0": "2,400 tokens (300 pages x 8)",
                     "decode_0": "2,400 tokens (300 pages x 8)"}


def test_tpu_pools_are_estimated_from_the_chip_memory():
    """v6e: 32 GiB per chip, 0.9 of it, less the tiny model's bf16 weights over tp 4, in pages
    of its bf16 KV; P keeps max_held_kv_pages back (mode A)."""
    cfg, plan = _plan(["topology=1p1d_v6e8", "disaggregation.max_held_kv_pages=1000"])
    model = model_config_from_cfg(cfg.model)
    m = cfg.model
    params = (m.vocab_size * m.hidden_size * 2 + m.hidden_size + m.num_layers * (
        2 * m.hidden_size + m.hidden_size * m.num_heads * m.head_dim * 2
        + m.hidden_size * m.num_kv_heads * m.head_dim * 2
        + 3 * m.hidden_size * m.intermediate_size))
    page = 2 * m.num_layers * 16 * (m.num_kv_heads // 4) * m.head_dim * 2
    pages = math.floor((0.9 * 32 * 2**30 - params * 2 / 4) / page)
    pools = pool_summaries(cfg, plan, model)
    assert pools["decode_0"] == (f"~{pages * 16:,} tokens (~{pages:,} pages x 16; "
                                 "0.9 of 32 GiB per chip)")
    assert reserved_pages(runtime_settings(cfg, "prefill"), "prefill") == 1000
    held = pages - 1000
    assert pools["prefill_0"].startswith(f"~{held * 16:,} tokens (~{held:,} pages")
    # unknown model shapes (a checkpoint not fetched here): sized at start
    assert set(pool_summaries(cfg, plan, None).values()) == {
        "sized at start from 0.9 of device memory"}


def test_render_prints_each_instance_pool(tmp_path):
    res = run_pdtopo(["render", "model=tiny_llama", "topology=1p1d_v6e8",
                      f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    for name in ("prefill_0", "decode_0"):
        assert f"{name}: KV pool ~" in out and "0.9 of 32 GiB per chip" in out, out
