"""Llama-family decoder in JAX (Llama, Qwen2, Qwen3): parameters, sharding and the forward pass.

Parameters are a plain pytree (see `param_shapes`): weights are stored `[in, out]` so a layer is
`x @ w`. `param_specs` gives each leaf's PartitionSpec over the "tp" mesh axis (Megatron style:
q/k/v/gate/up column parallel, o/down row parallel; XLA inserts the all-reduce after the row
parallel matmuls). The forward pass comes in pieces: `embed`, `decoder_layer` (one layer, its
attention a callable), `final_norm` and `compute_logits`; `forward_hidden` chains them over
every layer for a flat token array (the serving runner instead compiles one layer and calls it
per layer: pdtopo.runtime.engine.step_programs). Attention goes through a callable so the same
code serves the paged runner (`pdtopo.runtime.engine.attention`) and the dense, unpaged
reference (`dense_forward`) used by tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdtopo.config.settings import resolved_dtype
from pdtopo.model_config.shapes import (  # noqa: F401
    check_tp,
    kv_replication,
    layer_param_shapes,
    param_shapes,
    serving_config,
)
from pdtopo.model_config.spec import ModelConfig

Params = dict[str, Any]
# attention(layer, q [T,H,D], k [T,KVH,D], v [T,KVH,D]) -> out [T,H,D]
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str, key: str = "engine.dtype", platform: str | None = None
                  ) -> jnp.dtype:
    """The dtype of engine.dtype / kv_dtype `name` on `platform` (default: this backend);
    "auto" is bfloat16 on TPU, float32 elsewhere (pdtopo.config.settings.resolved_dtype)."""
    name = resolved_dtype(name, platform or jax.default_backend())
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r} is not supported (choose one of auto, "
                         f"{', '.join(DTYPES)})")
    return jnp.dtype(DTYPES[name])


_LAYER_SPECS = {
    "attn_norm": P(), "mlp_norm": P(),
    "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"),
    "bq": P("tp"), "bk": P("tp"), "bv": P("tp"),
    "q_norm": P(), "k_norm": P(),
    "wo": P("tp", None), "bo": P(),
    "w_gate": P(None, "tp"), "w_up": P(None, "tp"),
    "w_down": P("tp", None),
}


def param_specs(cfg: ModelConfig, tp: int) -> Params:
    """PartitionSpec of every parameter (same tree as `param_shapes`)."""
    specs: Params = {
        "embed": P(),
        "layers": [{k: _LAYER_SPECS[k] for k in layer_param_shapes(cfg)}
                   for _ in range(cfg.num_layers)],
        "final_norm": P(),
    }
    if not cfg.tie_word_embeddings:
        # Vocab-parallel LM head when the vocabulary splits evenly; replicated otherwise.
        specs["lm_head"] = P(None, "tp") if cfg.vocab_size % tp == 0 else P()
    return specs


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    tp = mesh.shape["tp"]
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, tp),
                        is_leaf=lambda x: isinstance(x, P))


def init_params_numpy(cfg: ModelConfig, seed: int | None = None) -> Params:
    """Random parameters (float32 NumPy) from `seed` (default `cfg.init_seed`).

    Weights ~ N(0, 1/fan_in) so activations stay O(1) and logits are well spread; norm weights
    are ones around a small perturbation so the norms are exercised too.
    """
    rng = np.random.default_rng(cfg.init_seed if seed is None else seed)

    def leaf(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.startswith("b"):
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        fan_in = shape[0] if name != "embed" else 1
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    shapes = param_shapes(cfg)
    params: Params = {
        "embed": leaf("embed", shapes["embed"]),
        "layers": [{k: leaf(k, s) for k, s in layer.items()} for layer in shapes["layers"]],
        "final_norm": leaf("final_norm", shapes["final_norm"]),
    }
    if "lm_head" in shapes:
        params["lm_head"] = leaf("lm_head", shapes["lm_head"])
    return params


KV_KEYS = ("wk", "wv", "bk", "bv")  # parameters whose outputs are KV heads


def kv_replica_columns(cfg: ModelConfig, r: int) -> np.ndarray:
    """For each output column of a KV projection with every KV head repeated `r` times, the
    model's column it copies."""
    d = cfg.head_dim
    cols = np.arange(cfg.num_kv_heads * r * d)
    return (cols // d // r) * d + cols % d


def replicate_kv_heads(params: Params, cfg: ModelConfig, r: int) -> Params:
    """Host parameters of `cfg` with every KV head repeated `r` times (k/v projections and
    biases; per-dim k norms are shared), for `serving_config(cfg, tp)`. r == 1: unchanged."""
    if r == 1:
        return params
    cols = kv_replica_columns(cfg, r)
    layers = [{k: np.asarray(v)[..., cols] if k in KV_KEYS else v for k, v in lp.items()}
              for lp in params["layers"]]
    return {**params, "layers": layers}


def place_params(params: Params, cfg: ModelConfig, mesh: Mesh, dtype: Any) -> Params:
    """Cast host parameters to `dtype` and put them on the mesh with their shardings."""
    shardings = param_shardings(cfg, mesh)
    return jax.tree.map(
        lambda a, s: jax.device_put(np.asarray(a).astype(dtype), s), params, shardings)


# ----------------------------------------------------------------------------------- math


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf.astype(x.dtype) * weight


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] of the model's RoPE (`cfg.rope`: default, linear,
    llama3), computed in float64 and rounded once."""
    d, rope = cfg.head_dim, cfg.rope
    inv = 1.0 / (rope.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        factor = float(rope.factor)
        low, high = float(rope.low_freq_factor), float(rope.high_freq_factor)
        old_len = float(rope.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face Llama convention). x: [T, heads, head_dim]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [T, hidden] of flat tokens [T]."""
    return params["embed"][tokens]


def decoder_layer(lp: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                  attention: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
                  ) -> jax.Array:
    """One decoder layer over hidden states x [T, hidden] at `positions` [T]; `attention(q, k,
    v)` is this layer's attention (q [T,H,D], k/v [T,KVH,D] -> [T,H,D])."""
    t = x.shape[0]
    inv_freq = rope_inv_freq(cfg)
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    o = attention(q, k, v).astype(x.dtype)
    x = x + o.reshape(t, cfg.q_size) @ lp["wo"]
    if cfg.o_bias:
        x = x + lp["bo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    return x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]


def final_norm(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def forward_hidden(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   attention: AttentionFn) -> jax.Array:
    """Decoder over flat tokens [T] at `positions` [T]; returns final-normed hidden [T, hidden],
    every layer traced inline."""
    x = embed(params, tokens)
    for i, lp in enumerate(params["layers"]):
        x = decoder_layer(lp, cfg, x, positions, partial(attention, i))
    return final_norm(params, cfg, x)


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] from final hidden states."""
    if cfg.tie_word_embeddings:
        out = jnp.einsum("...h,vh->...v", hidden, params["embed"],
                         preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("...h,hv->...v", hidden, params["lm_head"],
                         preferred_element_type=jnp.float32)
    return out.astype(jnp.float32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Dense causal GQA attention over one sequence. q [S,H,D], k/v [S,KVH,D] -> [S,H,D]."""
    s, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(s, kvh, h // kvh, d)
    scores = jnp.einsum("qkgd,skd->kgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgqs,skd->qkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(s, h, d).astype(q.dtype)


def dense_forward(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Unpaged reference: logits [S, vocab] (float32) of one sequence, no KV cache."""
    tokens = jnp.asarray(tokens, dtype=jnp.int32)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    hidden = forward_hidden(params, cfg, tokens, positions,
                            lambda _i, q, k, v: causal_attention(q, k, v))
    return compute_logits(params, cfg, hidden)
