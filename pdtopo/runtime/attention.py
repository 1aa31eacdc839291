"""Paged attention behind one function: `paged_attention(q, k, v, k_pool, v_pool, md, ...)`.

Data flow for one layer of one engine step (all shapes padded to buckets by the runner):
  1. the new tokens' K/V ([T, kv_heads, head_dim]) are scattered into the layer's pool pages at
     (`md.slot_pages`, `md.slot_offsets`); padded tokens target page 0, the reserved page;
  2. each query attends to its sequence's context read back through its page table
     (`md.page_table[b]`), causally masked by absolute position and by `md.kv_lens`.
The pool layout is the project's KV format: `[num_pages, page_size, kv_heads, head_dim]`
sharded over "tp" along kv heads. Everything runs inside `shard_map`, so each device works on
its own heads and its own pool shard with no communication.

Implementations (`engine.attention_impl`):
  - "gather": XLA gather of the context pages, dense masked softmax; runs everywhere.
  - "pallas": JAX's TPU ragged paged attention kernel
    (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`). It wants K and V interleaved in
    one array, so the used pages are gathered into a compact combined array first.
  - "auto": pallas on TPU when head_dim % 128 == 0, gather otherwise (CPU: always gather).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

IMPLS = ("auto", "pallas", "gather")
_MASKED = -1e30  # finite so that fully masked (padding) rows give no NaN


class AttentionMetadata(NamedTuple):
    """Per-step metadata (int32, replicated). T flat tokens, B sequences, Q max chunk length."""

    slot_pages: jax.Array    # [T] pool page written by each token (0 for padding)
    slot_offsets: jax.Array  # [T] offset inside that page
    page_table: jax.Array    # [B, P] pages of each sequence (0-padded)
    kv_lens: jax.Array       # [B] context length after this step (0 for padding sequences)
    q_starts: jax.Array      # [B] absolute position of each chunk's first token
    cu_q_lens: jax.Array     # [B+1] offsets of each chunk in the flat token array
    seq_tok_idx: jax.Array   # [B, Q] flat index of chunk b's j-th token (0 when padding)
    tok_seq: jax.Array       # [T] sequence of each flat token
    tok_qidx: jax.Array      # [T] index of each flat token inside its chunk
    num_seqs: jax.Array      # [1] real sequences


def resolve_impl(impl: str, head_dim: int, platform: str | None = None) -> str:
    if impl not in IMPLS:
        raise ValueError(f"engine.attention_impl={impl!r}: choose one of {', '.join(IMPLS)}")
    platform = platform or jax.default_backend()
    if impl == "auto":
        return "pallas" if platform == "tpu" and head_dim % 128 == 0 else "gather"
    if impl == "pallas" and platform != "tpu":
        raise ValueError(f"engine.attention_impl=pallas needs a TPU (this backend: {platform}); "
                         "use auto or gather")
    return impl


def write_kv(k: jax.Array, v: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
             md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    k_pool = k_pool.at[md.slot_pages, md.slot_offsets].set(k.astype(k_pool.dtype))
    v_pool = v_pool.at[md.slot_pages, md.slot_offsets].set(v.astype(v_pool.dtype))
    return k_pool, v_pool


def gather_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                     md: AttentionMetadata, sm_scale: float) -> jax.Array:
    """Attention of flat queries [T, H, D] over their sequences' pages -> [T, H, D]."""
    _, h, d = q.shape
    b, npages = md.page_table.shape
    qlen = md.seq_tok_idx.shape[1]
    page_size, kvh = k_pool.shape[1], k_pool.shape[2]
    ctx = npages * page_size
    qb = q[md.seq_tok_idx].reshape(b, qlen, kvh, h // kvh, d)
    kc = k_pool[md.page_table].reshape(b, ctx, kvh, d)
    vc = v_pool[md.page_table].reshape(b, ctx, kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qb.astype(kc.dtype), kc,
                        preferred_element_type=jnp.float32) * sm_scale
    qpos = md.q_starts[:, None] + jnp.arange(qlen, dtype=jnp.int32)[None, :]   # [B, Q]
    kpos = jnp.arange(ctx, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (
        kpos[None, None, :] < md.kv_lens[:, None, None])                        # [B, Q, S]
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(vc.dtype)
    ob = jnp.einsum("bkgqs,bskd->bqkgd", probs, vc, preferred_element_type=jnp.float32)
    ob = ob.reshape(b, qlen, h, d)
    return ob[md.tok_seq, md.tok_qidx].astype(q.dtype)


def ragged_kernel_inputs(k_pool: jax.Array, v_pool: jax.Array, md: AttentionMetadata):
    """(kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) in the ragged kernel's format:
    the sequences' pages gathered into one compact array with K and V interleaved on heads."""
    b, npages = md.page_table.shape
    _, page_size, kvh, d = k_pool.shape
    flat = md.page_table.reshape(-1)
    kv = jnp.stack([k_pool[flat], v_pool[flat]], axis=3)  # [B*P, ps, kvh, 2, d]
    kv = kv.reshape(b * npages, page_size, 2 * kvh, d)
    page_indices = jnp.arange(b * npages, dtype=jnp.int32).reshape(b, npages)
    return kv, md.kv_lens, page_indices, md.cu_q_lens, md.num_seqs


def pallas_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                     md: AttentionMetadata, sm_scale: float) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    kv, kv_lens, page_indices, cu_q_lens, num_seqs = ragged_kernel_inputs(k_pool, v_pool, md)
    return ragged_paged_attention(q.astype(kv.dtype), kv, kv_lens, page_indices, cu_q_lens,
                                  num_seqs, sm_scale=sm_scale).astype(q.dtype)


def _local(q, k, v, k_pool, v_pool, md, *, impl: str, sm_scale: float):
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, md)
    attend = pallas_attention if impl == "pallas" else gather_attention
    return attend(q, k_pool, v_pool, md, sm_scale), k_pool, v_pool


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_pool: jax.Array,
                    v_pool: jax.Array, md: AttentionMetadata, *, mesh: Mesh,
                    impl: str = "gather", sm_scale: float | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write k/v [T, KVH, D] into the pools, attend q [T, H, D]; returns (out, k_pool, v_pool).

    `impl` must already be resolved ("gather" or "pallas"); call inside jit.
    """
    if impl not in ("gather", "pallas"):
        raise ValueError(f"paged_attention: impl must be 'gather' or 'pallas', got {impl!r}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    heads = P(None, "tp", None)
    pool = P(None, None, "tp", None)
    md_specs = AttentionMetadata(*([P()] * len(AttentionMetadata._fields)))
    fn = jax.shard_map(
        partial(_local, impl=impl, sm_scale=scale), mesh=mesh,
        in_specs=(heads, heads, heads, pool, pool, md_specs),
        out_specs=(heads, pool, pool), check_vma=False)
    return fn(q, k, v, k_pool, v_pool, md)
