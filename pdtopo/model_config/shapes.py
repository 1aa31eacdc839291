"""The parameter tree of a Llama-family decoder as shapes, and whether it splits over tp.

`kv_replication(cfg, tp)`: a model with fewer KV heads than `tp` devices (large-TP serving of
a GQA model) serves with every KV head repeated `tp // num_kv_heads` times, so each device holds
one; `serving_config(cfg, tp)` is the config the engine then runs (`num_kv_heads` = tp). Query
head h reads KV head h // (num_heads / kv): repeating KV head k to k*r .. k*r + r - 1 keeps
that mapping, so the math is unchanged.

Pure (no JAX): the loader and the launcher's pre-flight check a checkpoint against these shapes,
`llama.py` builds the arrays, shardings and forward pass on the same tree. Weights are stored
`[in, out]`; the optional leaves follow the config's switches (q/k/v and o biases, Qwen3's
per-head q/k norms).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdtopo.model_config.spec import ModelConfig

Params = dict[str, Any]


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "attn_norm": (h,),
        "wq": (h, cfg.q_size),
        "wk": (h, cfg.kv_size),
        "wv": (h, cfg.kv_size),
        "wo": (cfg.q_size, h),
        "mlp_norm": (h,),
        "w_gate": (h, i),
        "w_up": (h, i),
        "w_down": (i, h),
    }
    if cfg.qkv_bias:
        shapes.update(bq=(cfg.q_size,), bk=(cfg.kv_size,), bv=(cfg.kv_size,))
    if cfg.o_bias:
        shapes["bo"] = (h,)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's dimensions, weights shared by the heads
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    return shapes


def param_shapes(cfg: ModelConfig) -> Params:
    """The parameter pytree with shapes as leaves."""
    shapes: Params = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "layers": [layer_param_shapes(cfg) for _ in range(cfg.num_layers)],
        "final_norm": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is repeated to split the KV heads over `tp` devices: 1 when
    tp divides them, tp // num_kv_heads when the heads are fewer and divide tp."""
    kv = cfg.num_kv_heads
    if kv % tp == 0:
        return 1
    if kv < tp and tp % kv == 0:
        return tp // kv
    raise ValueError(
        f"tensor parallelism tp={tp} needs model.num_kv_heads % tp == 0 (each device holds "
        f"whole KV heads) or tp % model.num_kv_heads == 0 (each KV head repeated on "
        f"tp / num_kv_heads devices), but model.num_kv_heads={kv} ({cfg.name}); choose a tp "
        f"that divides {kv} or a multiple of it")


def serving_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the engine runs on `tp` devices (KV heads repeated where they are fewer)."""
    r = kv_replication(cfg, tp)
    return cfg if r == 1 else replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise a clear error when the model cannot be split over `tp` devices."""
    kv_replication(cfg, tp)
    for key, value in (("num_heads", cfg.num_heads),
                       ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            raise ValueError(
                f"tensor parallelism tp={tp} needs model.{key} % tp == 0, but "
                f"model.{key}={value} ({cfg.name}): attention heads and the MLP are "
                f"split across the tp devices; choose a tp that divides {value}"
            )
