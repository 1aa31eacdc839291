"""engine.dtype / kv_dtype `auto`: bfloat16 on TPU, float32 elsewhere, compared resolved."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import resolved_dtype
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.runtime.model.llama import resolve_dtype


def test_auto_is_bfloat16_on_tpu_only():
    assert resolved_dtype("auto", "tpu") == "bfloat16"
    assert resolved_dtype("auto", "cpu") == "float32"
    assert resolved_dtype("float32", "tpu") == "float32"  # f32 on a TPU when asked for
    assert resolve_dtype("auto", platform="tpu") == jnp.bfloat16
    assert resolve_dtype("auto") == jnp.float32  # this machine's CPU backend
    with pytest.raises(ValueError, match="engine.dtype='fp8'"):
        resolve_dtype("fp8")


def test_default_config_is_auto():
    cfg = compose_config([])
    assert cfg.engine.dtype == "auto" and cfg.engine.kv_dtype == "auto"


def test_p_and_d_compare_resolved_kv_dtypes():
    # on a TPU a bfloat16 P pairs with an auto D (bfloat16 there) ...
    expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_v6e8",
                                "+topology.prefill.engine.kv_dtype=bfloat16"]))
    # ... and a float32 one does not
    with pytest.raises(TopologyError, match="prefill kv_dtype='float32' but decode "
                                            "kv_dtype='bfloat16'"):
        expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_v6e8",
                                    "+topology.prefill.engine.kv_dtype=float32"]))
