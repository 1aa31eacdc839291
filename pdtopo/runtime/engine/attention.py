"""Paged attention behind one function: `paged_attention(q, k, v, k_pool, v_pool, md, ...)`.

Data flow for one layer of one engine step (inputs from pdtopo.runtime.engine.step_inputs):
  1. the new tokens' K/V ([T, kv_heads, head_dim]) are scattered into the layer's pool pages at
     (`md.slot_pages`, `md.slot_offsets`); padded tokens target page 0, the reserved page;
  2. each query attends to its own sequence's context, causally masked by absolute position.
     The "gather" implementation reads the context block by block (`block_pages` pages per
     block, `md.num_blocks` blocks: a loop whose trip count is data, not shape) and folds each
     block into an online softmax. Two layouts: "decode" (token i is sequence i, pages from
     `md.page_table[i]`) and "flat" (any batch: pages from the batch's context list
     `md.ctx_pages`, each page tagged with its owner sequence and first position).
The pool layout is the project's KV format: `[num_pages, page_size, kv_heads, head_dim]`
sharded over "tp" along kv heads. Everything runs inside `shard_map`, so each device works on
its own heads and its own pool shard with no communication.

Implementations (`engine.attention_impl`):
  - "gather": XLA gathers of context blocks and an online softmax; runs everywhere.
  - "pallas": pdtopo's Pallas TPU ragged paged-attention kernel
    (`pdtopo.kernels.ragged_attention`), "ragged" layout. It reads the K and V pools in place,
    page by page, by DMA: nothing is copied out of the pool before the call.
  - "pallas_interpret": the same kernel and call, run by JAX's TPU interpreter on any backend
    (the CPU here): how CI executes what TPU serving runs. Slow; for tests.
  - "auto": pallas on TPU, gather elsewhere.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pdtopo.kernels import interpret_support, ragged_attention
from pdtopo.runtime.engine.step_inputs import AttentionMetadata

IMPLS = ("auto", "pallas", "pallas_interpret", "gather")
KERNEL_IMPLS = ("pallas", "pallas_interpret")  # the ragged kernel, on a TPU or interpreted
_MASKED = -1e30  # finite so that fully masked (padding) rows give no NaN


def resolve_impl(impl: str, head_dim: int, platform: str | None = None) -> str:
    if impl not in IMPLS:
        raise ValueError(f"engine.attention_impl={impl!r}: choose one of {', '.join(IMPLS)}")
    platform = platform or jax.default_backend()
    if impl == "auto":
        return "pallas" if platform == "tpu" else "gather"
    if impl == "pallas" and platform != "tpu":
        raise ValueError(f"engine.attention_impl=pallas needs a TPU (this backend: {platform}); "
                         "use auto or gather, or pallas_interpret to run the TPU kernel "
                         "interpreted (slow)")
    return impl


def write_kv(k: jax.Array, v: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
             md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    k_pool = k_pool.at[md.slot_pages, md.slot_offsets].set(k.astype(k_pool.dtype))
    v_pool = v_pool.at[md.slot_pages, md.slot_offsets].set(v.astype(v_pool.dtype))
    return k_pool, v_pool


def _online_block(carry, scores, valid, v, out_spec: str):
    """One block of an online softmax: fold `scores` (masked by `valid`) and values `v` into
    the running (max, sum, accumulator). Masked entries contribute exactly nothing."""
    m, denom, acc = carry
    scores = jnp.where(valid, scores, _MASKED)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(scores - m_new[..., None]), 0.0)
    denom = denom * alpha + p.sum(axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum(out_spec, p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return m_new, denom, acc


def _finish(carry):
    _, denom, acc = carry
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # fully masked (padding) rows give 0


def decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                     md: AttentionMetadata, sm_scale: float, block_pages: int) -> jax.Array:
    """Decode layout: token i is sequence i's one new token. q [B, H, D] -> [B, H, D]."""
    b, h, d = q.shape
    page_size, kvh = k_pool.shape[1], k_pool.shape[2]
    span = block_pages * page_size
    qg = q.reshape(b, kvh, h // kvh, d).astype(k_pool.dtype)

    def body(i, carry):
        pages = jax.lax.dynamic_slice_in_dim(md.page_table, i * block_pages, block_pages, 1)
        k = k_pool[pages].reshape(b, span, kvh, d)
        v = v_pool[pages].reshape(b, span, kvh, d)
        scores = jnp.einsum("bkgd,bskd->bkgs", qg, k,
                            preferred_element_type=jnp.float32) * sm_scale
        kpos = i * span + jnp.arange(span, dtype=jnp.int32)
        valid = (kpos[None, :] < md.kv_lens[:, None])[:, None, None, :]
        return _online_block(carry, scores, valid, v, "bkgs,bskd->bkgd")

    init = (jnp.full((b, kvh, h // kvh), _MASKED, jnp.float32),
            jnp.zeros((b, kvh, h // kvh), jnp.float32),
            jnp.zeros((b, kvh, h // kvh, d), jnp.float32))
    out = _finish(jax.lax.fori_loop(0, md.num_blocks[0], body, init))
    return out.reshape(b, h, d).astype(q.dtype)


def flat_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                   md: AttentionMetadata, sm_scale: float, block_pages: int) -> jax.Array:
    """Flat layout: every token attends to the context pages of its own sequence. Runs the
    step's work items (`md.work`, see step_inputs.WORK_FIELDS): one tile of a sequence's query
    rows against one block of that sequence's pages in `md.ctx_pages`. q [T, H, D]."""
    t, h, d = q.shape
    page_size, kvh = k_pool.shape[1], k_pool.shape[2]
    g = h // kvh
    span = tile = block_pages * page_size
    qg = q.reshape(t, kvh, g, d).astype(k_pool.dtype)
    qg = jnp.concatenate([qg, jnp.zeros((tile, kvh, g, d), qg.dtype)])  # room for a last tile
    r = jnp.arange(tile, dtype=jnp.int32)[:, None]
    c = jnp.arange(span, dtype=jnp.int32)[None, :]

    def body(i, carry):
        block, row, rows, qpos, kpos = jax.lax.dynamic_slice_in_dim(md.work, i, 1, 1)[:, 0]
        pages = jax.lax.dynamic_slice_in_dim(md.ctx_pages, block * block_pages, block_pages)
        k = k_pool[pages].reshape(span, kvh, d)
        v = v_pool[pages].reshape(span, kvh, d)
        qt = jax.lax.dynamic_slice_in_dim(qg, row, tile)
        scores = jnp.einsum("tkgd,skd->tkgs", qt, k,
                            preferred_element_type=jnp.float32) * sm_scale
        valid = ((r < rows) & (kpos + c <= qpos + r))[:, None, None, :]
        window = tuple(jax.lax.dynamic_slice_in_dim(x, row, tile) for x in carry)
        window = _online_block(window, scores, valid, v, "tkgs,skd->tkgd")
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, w, row, 0)
                     for x, w in zip(carry, window, strict=True))

    init = (jnp.full((t + tile, kvh, g), _MASKED, jnp.float32),
            jnp.zeros((t + tile, kvh, g), jnp.float32),
            jnp.zeros((t + tile, kvh, g, d), jnp.float32))
    out = _finish(jax.lax.fori_loop(0, md.num_work[0], body, init))[:t]
    return out.reshape(t, h, d).astype(q.dtype)


def pallas_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                     md: AttentionMetadata, sm_scale: float, interpret: bool) -> jax.Array:
    """The ragged kernel over the pools in place (`md` in the ragged layout)."""
    if interpret:
        interpret_support.install()
    return ragged_attention.ragged_paged_attention(
        q, k_pool, v_pool, md.kv_lens, md.page_table, md.cu_q_lens, md.kind_counts,
        md.dec_seqs, md.pf_blocks, md.pf_q_rows, md.out_rows, sm_scale=sm_scale,
        # "eager" DMAs: the interpreter's default ("on_wait") can hang under shard_map
        interpret=pltpu.InterpretParams(dma_execution_mode="eager") if interpret else False)


def _local(q, k, v, k_pool, v_pool, md, *, impl: str, layout: str, block_pages: int,
           sm_scale: float):
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, md)
    if impl in KERNEL_IMPLS:
        out = pallas_attention(q, k_pool, v_pool, md, sm_scale,
                               interpret=impl == "pallas_interpret")
    else:
        attend = decode_attention if layout == "decode" else flat_attention
        out = attend(q, k_pool, v_pool, md, sm_scale, block_pages)
    return out, k_pool, v_pool


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_pool: jax.Array,
                    v_pool: jax.Array, md: AttentionMetadata, *, mesh: Mesh,
                    impl: str = "gather", layout: str = "flat", block_pages: int = 1,
                    sm_scale: float | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write k/v [T, KVH, D] into the pools, attend q [T, H, D]; returns (out, k_pool, v_pool).

    `impl` must already be resolved ("gather", "pallas" or "pallas_interpret"); `layout` is the
    one md was prepared for ("decode" or "flat" for gather, "ragged" for the kernel); call
    inside jit.
    """
    if impl not in ("gather", *KERNEL_IMPLS):
        raise ValueError(f"paged_attention: impl must be gather, pallas or pallas_interpret, "
                         f"got {impl!r}")
    want = ("ragged",) if impl in KERNEL_IMPLS else ("decode", "flat")
    if layout not in want:
        raise ValueError(f"paged_attention: impl {impl!r} reads layout {' or '.join(want)}, "
                         f"got {layout!r}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    local = partial(_local, impl=impl, layout=layout, block_pages=block_pages, sm_scale=scale)
    return per_device(local, mesh)(q, k, v, k_pool, v_pool, md)


def per_device(local, mesh: Mesh):
    """`local(q, k, v, k_pool, v_pool, md) -> (out, k_pool, v_pool)` on each device's heads and
    pool shard (shard_map over "tp"; the metadata replicated)."""
    heads = P(None, "tp", None)
    pool = P(None, None, "tp", None)
    md_specs = AttentionMetadata(*([P()] * len(AttentionMetadata._fields)))
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, md_specs),
                         out_specs=(heads, pool, pool), check_vma=False)
