"""The parameter tree of a Llama-family decoder as shapes, and whether it splits over tp.

Pure (no JAX): the loader and the launcher's pre-flight check a checkpoint against these shapes,
`llama.py` builds the arrays, shardings and forward pass on the same tree. Weights are stored
`[in, out]`; the optional leaves follow the config's switches (q/k/v and o biases, Qwen3's
per-head q/k norms).
"""

from __future__ import annotations

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


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise a clear error when the model cannot be split over `tp` devices."""
    for key, value in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads),
                       ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            raise ValueError(
                f"tensor parallelism tp={tp} needs model.{key} % tp == 0, but "
                f"model.{key}={value} ({cfg.name}): KV heads, attention heads and the MLP are "
                f"split across the tp devices; choose a tp that divides {value}"
            )
