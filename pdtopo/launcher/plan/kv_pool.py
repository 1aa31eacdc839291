"""Each serving instance's KV pool as a user should see it before traffic does: configured
(`engine.num_pages`) or sized from device memory (`engine.kv_memory_fraction`, `auto` on TPU),
for `pdtopo render` and the launch table. Pure: settings, plan and model config in, text out.

    pool_summaries(cfg, plan, model) -> {program name: "8,192 tokens (512 pages x 16)"}

A memory-sized pool is estimated from the accelerator's memory per chip (`tpu_env`), the
model's weights per chip and P's reserve (`pool_reserve`); the server sizes it exactly at start
from the device's own statistics, less the step programs' and the sampler's buffers, so the
estimate is marked `~` and errs high.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig

from pdtopo.config.pool_reserve import reserved_pages
from pdtopo.config.settings import (
    RuntimeSettings,
    resolved_dtype,
    resolved_kv_memory_fraction,
    runtime_settings,
)
from pdtopo.launcher.plan.expand import Plan
from pdtopo.launcher.plan.tpu_env import accelerator_spec
from pdtopo.model_config.shapes import kv_replication, param_shapes
from pdtopo.model_config.spec import ModelConfig

POOL_ROLES = ("prefill", "decode", "colocated")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _param_count(model: ModelConfig) -> int:
    def count(tree: Any) -> int:
        if isinstance(tree, dict):
            return sum(count(v) for v in tree.values())
        if isinstance(tree, list):
            return sum(count(v) for v in tree)
        return math.prod(tree)
    return count(param_shapes(model))


def estimated_pages(settings: RuntimeSettings, role: str, tp: int, platform: str,
                    hbm_gib: float, model: ModelConfig) -> int:
    """Pages a memory-sized pool of `role` gets on chips of `hbm_gib`, before the step's and
    the sampler's buffers."""
    engine = settings.engine
    fraction = resolved_kv_memory_fraction(engine.kv_memory_fraction, platform)
    weights = _param_count(model) * DTYPE_BYTES[resolved_dtype(engine.dtype, platform)] / tp
    kv_bytes = DTYPE_BYTES[resolved_dtype(engine.kv_dtype, platform)]
    kv_heads = model.num_kv_heads * kv_replication(model, tp) // tp
    page = 2 * model.num_layers * engine.page_size * kv_heads * model.head_dim * kv_bytes
    budget = fraction * hbm_gib * 2**30 - weights
    return max(int(budget // page) - reserved_pages(settings, role), 0)


def pool_text(settings: RuntimeSettings, role: str, tp: int, platform: str,
              hbm_gib: float | None, model: ModelConfig | None) -> str:
    engine = settings.engine
    fraction = resolved_kv_memory_fraction(engine.kv_memory_fraction, platform)
    if fraction is None:
        pages = int(engine.num_pages)
        return f"{pages * engine.page_size:,} tokens ({pages:,} pages x {engine.page_size})"
    where = f"{fraction:g} of device memory"
    if hbm_gib is None or model is None:
        return f"sized at start from {where}"
    try:
        pages = estimated_pages(settings, role, tp, platform, hbm_gib, model)
    except (ValueError, KeyError):  # a tp the model cannot split: preflight says so
        return f"sized at start from {where}"
    return (f"~{pages * engine.page_size:,} tokens (~{pages:,} pages x {engine.page_size}; "
            f"{fraction:g} of {hbm_gib:g} GiB per chip)")


def pool_summaries(cfg: DictConfig, plan: Plan, model: ModelConfig | None) -> dict[str, str]:
    """{program: its KV pool} for every P, D and colocated program of `plan`."""
    hbm = accelerator_spec(plan.accelerator, "tpu").hbm_gib if plan.platform == "tpu" else None
    out = {}
    for proc in plan.processes:
        if proc.role in POOL_ROLES:
            out[proc.name] = pool_text(runtime_settings(cfg, proc.role), proc.role,
                                       int(proc.mesh.get("tp", 1)), plan.platform, hbm, model)
    return out
