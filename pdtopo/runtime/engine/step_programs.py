"""The compiled programs of an engine step, one set per step shape, whatever the model's depth.

A step (`run`) is three kinds of program, each compiled once per step shape (StepKey):
  embed  tokens [T] -> hidden x [T, hidden]
  layer  (one layer's weights, that layer's K and V pools, x, positions, md) -> (x, K, V): one
         decoder layer with paged attention writing the new K/V into the pools (donated,
         updated in place). All layers share shapes and shardings, so the same executable runs
         layer 0, 1, ..., L-1 in turn: tracing and compiling do not grow with depth.
  head   (final norm, embedding or LM head, x, last_idx) -> float32 logits [rows, vocab]
The host dispatches the L+2 calls without waiting (JAX runs them asynchronously), so on an
accelerator the device never waits for the host as long as one layer takes longer to run than
to dispatch (tens of microseconds).

Programs are compiled ahead of time from abstract inputs (`compile`: shapes, dtypes and
shardings only), so warmup compiles a shape without executing it. `run` compiles a shape it has
not seen (a step larger than the geometry) on first use, and `compiled_shapes` counts them.
The persistent compilation cache (pdtopo.runtime.engine.compilation_cache) makes a warm start load
these executables instead of compiling them.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdtopo.model_config.spec import ModelConfig
from pdtopo.runtime.engine import attention as attn
from pdtopo.runtime.engine.step_inputs import LAYOUTS, StepKey
from pdtopo.runtime.model import llama

log = logging.getLogger(__name__)

HEAD_KEYS = ("embed", "final_norm", "lm_head")


def head_params(params: llama.Params) -> llama.Params:
    """The parameters the embed and head programs read."""
    return {k: params[k] for k in HEAD_KEYS if k in params}


def _embed(hp, tokens):
    return llama.embed(hp, tokens)


def _layer(lp, k_pool, v_pool, x, positions, md, *, cfg: ModelConfig, mesh: Mesh, impl: str,
           layout: str, block_pages: int, attend=attn.paged_attention):
    pools: dict[str, jax.Array] = {}

    def attention(q, k, v):
        out, pools["k"], pools["v"] = attend(
            q, k, v, k_pool, v_pool, md, mesh=mesh, impl=impl, layout=layout,
            block_pages=block_pages)
        return out

    x = llama.decoder_layer(lp, cfg, x, positions, attention)
    return x, pools["k"], pools["v"]


def _head(hp, x, last_idx, *, cfg: ModelConfig):
    # the norm is per row: normalising only the rows that give logits is the same
    return llama.compute_logits(hp, cfg, llama.final_norm(hp, cfg, x[last_idx]))


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a tree of arrays or of ShapeDtypeStructs."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


class StepPrograms:
    """Compiled embed/layer/head programs by step shape (see module docstring). Single owner:
    the model runner, under its lock."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, impl: str, block_pages: int,
                 kv_sharding: NamedSharding):
        self._replicated = replicated = NamedSharding(mesh, P())
        self._embed = jax.jit(_embed, out_shardings=replicated)
        self._layers = {
            layout: jax.jit(
                partial(_layer, cfg=cfg, mesh=mesh, impl=impl, layout=layout,
                        block_pages=block_pages),
                donate_argnums=(1, 2, 3),
                out_shardings=(replicated, kv_sharding, kv_sharding))
            for layout in LAYOUTS}
        self._head = jax.jit(partial(_head, cfg=cfg), out_shardings=replicated)
        self._compiled_embed: dict[int, Any] = {}
        self._compiled_head: dict[tuple[int, int], Any] = {}
        self._compiled_layer: dict[StepKey, Any] = {}

    @property
    def compiled_shapes(self) -> int:
        return len(self._compiled_layer)

    def keys(self) -> set[StepKey]:
        return set(self._compiled_layer)

    def has(self, key: StepKey) -> bool:
        return key in self._compiled_layer

    def compile(self, key: StepKey, params: llama.Params, caches: list, tokens, positions, md,
                last_idx) -> float:
        """Compile the programs of step shape `key` from the inputs' shapes (arrays or
        ShapeDtypeStructs; nothing runs). Returns the seconds it took (0 if already there)."""
        if key in self._compiled_layer:
            return 0.0
        t0 = time.perf_counter()
        hp = abstract(head_params(params))
        t = tokens.shape[0]
        x = self._hidden(t, params)
        if t not in self._compiled_embed:
            self._compiled_embed[t] = self._embed.lower(hp, abstract(tokens)).compile()
        head_key = (t, last_idx.shape[0])
        if head_key not in self._compiled_head:
            self._compiled_head[head_key] = self._head.lower(
                hp, x, abstract(last_idx)).compile()
        self._compiled_layer[key] = self._layers[key[0]].lower(
            abstract(params["layers"][0]), abstract(caches[0]), abstract(caches[1]), x,
            abstract(positions), abstract(md)).compile()
        return time.perf_counter() - t0

    def _hidden(self, tokens: int, params: llama.Params) -> jax.ShapeDtypeStruct:
        """The abstract hidden states [tokens, hidden] the layer and head programs take."""
        return jax.ShapeDtypeStruct((tokens, params["embed"].shape[1]), params["embed"].dtype,
                                    sharding=self._replicated)

    def memory_bytes(self, key: StepKey, params: llama.Params, pool, tokens, positions, md,
                     last_idx) -> int:
        """Temporary and output bytes of step shape `key`'s layer and head programs per
        device, from XLA's memory analysis (compiled here, not kept: `pool` may be a stand-in)."""
        hp = abstract(head_params(params))
        x = self._hidden(tokens.shape[0], params)
        layer = self._layers[key[0]].lower(abstract(params["layers"][0]), pool, pool, x,
                                           abstract(positions), abstract(md)).compile()
        head = self._head.lower(hp, x, abstract(last_idx)).compile()
        total = 0
        for program in (layer, head):
            stats = program.memory_analysis()
            if stats is not None:
                total += int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)
        return total

    def run(self, key: StepKey, params: llama.Params, caches: list, tokens, positions, md,
            last_idx) -> tuple[jax.Array, list]:
        """(logits, new caches) of one step over device inputs; `caches` (2*L arrays, k_0,
        v_0, k_1, ...) are donated."""
        self.compile(key, params, caches, tokens, positions, md, last_idx)
        layer = self._compiled_layer[key]
        hp = head_params(params)
        x = self._compiled_embed[tokens.shape[0]](hp, tokens)
        out = list(caches)
        for i, lp in enumerate(params["layers"]):
            x, out[2 * i], out[2 * i + 1] = layer(lp, out[2 * i], out[2 * i + 1], x, positions,
                                                  md)
        logits = self._compiled_head[(tokens.shape[0], last_idx.shape[0])](hp, x, last_idx)
        return logits, out
