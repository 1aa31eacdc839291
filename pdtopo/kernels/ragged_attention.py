"""pdtopo's Pallas TPU ragged paged attention: one call per kind of sequence, reading one
layer's KV pool in place.

Inputs (one device's shard; call inside ``shard_map`` for a sharded pool):
  q            [T, H, D]     the step's flat query tokens, sequences one after another
  k_pool       [N, S, K, D]  one layer's K pages (docs/architecture.md, "KV pool format")
  v_pool       [N, S, K, D]  the same layer's V pages
  kv_lens      [B]           context length of each sequence after this step (0: empty slot)
  page_table   [B, W]        each sequence's pages, in order
  cu_q_lens    [B + 1]       offsets of each sequence's query rows in q
  kind_counts  [2]           decode rows, prefill blocks this step
  dec_seqs     [Gd, Bd]      the sequences with one query token (decode rows), Bd per grid step
  pf_blocks    [Gp, 2]       prefill query blocks: (sequence, first query row within its chunk)
  pf_q_rows    [Gp, Tq]      each prefill block's rows of q (T: padding)
  out_rows     [T]           each token's row in [decode outputs; prefill outputs; zeros]
(`pdtopo.runtime.engine.step_inputs` builds them; block sizes: `pdtopo.config.attention_blocks`.)

Data flow. XLA packs q twice: decode rows as [Gd*Bd, K, G, D] (G = H / K query heads per KV
head) and prefill blocks as [Gp, K, Tq*G, D] (rows token-major: row r is token r // G, query
head r % G of that KV head). Two pallas_calls, grid axes "parallel" (independent steps: both
TensorCores of a megacore chip take a share):
  decode   a grid step takes Bd decode rows. For each row it walks the sequence's context one
           KV block (`kv_tokens`) at a time: every needed page of every KV head is one DMA for
           K and one for V, HBM -> VMEM, into [slot, kv head, tokens, D] buffers, so a KV head's
           block is one [tokens, D] tile. The next block is requested before the current one
           is used, also across sequence boundaries (the next row's first block starts while
           the current row's last block is computed). Per KV head the G query heads are the
           rows of one matmul.
  prefill  a grid step takes one query block of one sequence (Tq tokens x G heads = the matmul
           rows per KV head). It walks the context up to the block's last row (causal), with
           the same buffers and double-buffering, masks by position and folds each block into
           an online softmax in float32 VMEM scratch.
Only the pages a block's rows may see are fetched (pages past a sequence's length are skipped,
their buffer rows masked and their values zeroed), so a decode step's DMA bytes equal its live
KV bytes. XLA then scatters both outputs back to token order with one gather (`out_rows`).
Skipped grid steps (fewer sequences than the static grid) write zeros to their own output
block. The pool is only read: new K/V are written before the call
(pdtopo.runtime.engine.attention scatters the step's tokens).

All scalars arrive by scalar prefetch (SMEM), so every step of one shape runs one program. Refs
are indexed only on leading dimensions with ``.at``/``pl.ds`` (the minor two dims of every VMEM
tile stay whole), which is also what JAX's TPU interpreter (``interpret=pltpu.InterpretParams``)
needs to run the same kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdtopo.config.attention_blocks import KernelBlocks, blocks_for

_MASKED = -1e30  # finite: a fully masked row keeps m finite and contributes nothing
NAMES = {"decode": "pdtopo_ragged_attention_decode",
         "prefill": "pdtopo_ragged_attention_prefill"}


class _Pages:
    """DMAs of one KV block of one sequence: every needed page of every KV head, K and V."""

    def __init__(self, table_ref, width, k_pool, v_pool, k_buf, v_buf, sems, kv_pages):
        self.table, self.width = table_ref, width
        self.pools, self.bufs, self.sems = (k_pool, v_pool), (k_buf, v_buf), sems
        self.kv_pages = kv_pages
        self.page_size, self.kv_heads = k_pool.shape[1], k_pool.shape[2]

    def _each(self, seq, block, num_pages, slot, action):
        size = self.page_size

        def page(p, carry):
            index = block * self.kv_pages + p

            @pl.when(index < num_pages)
            def _():
                pid = self.table[seq * self.width + index]
                for kvh in range(self.kv_heads):
                    for c in range(2):
                        copy = pltpu.make_async_copy(
                            self.pools[c].at[pid, :, kvh, :],
                            self.bufs[c].at[slot, kvh, pl.ds(p * size, size), :],
                            self.sems.at[c, slot, kvh, p])
                        action(copy)
            return carry

        jax.lax.fori_loop(0, self.kv_pages, page, 0)

    def start(self, seq, block, num_pages, slot):
        self._each(seq, block, num_pages, slot, lambda c: c.start())

    def wait(self, seq, block, num_pages, slot):
        self._each(seq, block, num_pages, slot, lambda c: c.wait())


def _fold(state, kvh, q, k, v, valid, kv_ok, sm_scale):
    """Fold one KV block into KV head `kvh`'s online softmax. q [R, D], k/v [span, D], valid
    [R, span] (row may see column), kv_ok [span, 1] (column holds fetched data)."""
    m_ref, l_ref, acc_ref = state
    s = jax.lax.dot_general(q.astype(k.dtype), k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale
    s = jnp.where(valid, s, _MASKED)
    m_old = m_ref[kvh]
    m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_old - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    v = jnp.where(kv_ok, v, jnp.zeros_like(v))  # unfetched rows may hold anything
    l_ref[kvh] = l_ref[kvh] * alpha + p.sum(axis=1, keepdims=True)
    acc_ref[kvh] = acc_ref[kvh] * alpha + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    m_ref[kvh] = m_new


def _reset(state):
    m_ref, l_ref, acc_ref = state
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _result(state, kvh):
    _, l_ref, acc_ref = state
    denom = l_ref[kvh]
    return acc_ref[kvh] / jnp.where(denom > 0, denom, 1.0)


def _decode_kernel(kv_lens_ref, table_ref, counts_ref, dec_ref,   # scalar prefetch (SMEM)
                   q_ref, k_pool, v_pool, o_ref,                   # [Bd, K, G, D]; HBM; out
                   k_buf, v_buf, sems, m_ref, l_ref, acc_ref,       # scratch
                   *, seqs: int, kv_pages: int, width: int, sm_scale: float):
    kv_heads = k_pool.shape[2]
    span = kv_pages * k_pool.shape[1]
    pages = _Pages(table_ref, width, k_pool, v_pool, k_buf, v_buf, sems, kv_pages)
    state = (m_ref, l_ref, acc_ref)
    first = pl.program_id(0) * seqs
    n_rows = jnp.clip(counts_ref[0] - first, 0, seqs)
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, span), 1)
    kv_col = jax.lax.broadcasted_iota(jnp.int32, (span, 1), 0)

    def row_of(r):
        seq = dec_ref[first + r]
        kv_len = kv_lens_ref[seq]
        num_pages = (kv_len + k_pool.shape[1] - 1) // k_pool.shape[1]
        return seq, kv_len, num_pages, (num_pages + kv_pages - 1) // kv_pages

    @pl.when(n_rows > 0)
    def _():
        seq, _, num_pages, _ = row_of(0)
        pages.start(seq, 0, num_pages, 0)

    def row(r, slot):
        seq, kv_len, num_pages, num_blocks = row_of(r)
        _reset(state)

        def block(b, slot):
            @pl.when(b + 1 < num_blocks)
            def _():
                pages.start(seq, b + 1, num_pages, 1 - slot)

            @pl.when((b + 1 == num_blocks) & (r + 1 < n_rows))
            def _():
                nseq, _, npages, _ = row_of(r + 1)
                pages.start(nseq, 0, npages, 1 - slot)

            pages.wait(seq, b, num_pages, slot)
            valid = b * span + cols < kv_len
            kv_ok = b * span + kv_col < kv_len
            for kvh in range(kv_heads):
                _fold(state, kvh, q_ref[r, kvh], k_buf[slot, kvh], v_buf[slot, kvh], valid,
                      kv_ok, sm_scale)
            return 1 - slot

        slot = jax.lax.fori_loop(0, num_blocks, block, slot)
        for kvh in range(kv_heads):
            o_ref[r, kvh] = _result(state, kvh).astype(o_ref.dtype)
        return slot

    jax.lax.fori_loop(0, n_rows, row, 0)


def _prefill_kernel(kv_lens_ref, table_ref, cu_ref, counts_ref, blocks_ref,  # SMEM
                    q_ref, k_pool, v_pool, o_ref,                         # [K, R, D]; HBM; out
                    k_buf, v_buf, sems, m_ref, l_ref, acc_ref,             # scratch
                    *, q_tokens: int, group: int, kv_pages: int, width: int,
                    sm_scale: float):
    kv_heads, page_size = k_pool.shape[2], k_pool.shape[1]
    span = kv_pages * page_size
    rows = q_tokens * group
    pages = _Pages(table_ref, width, k_pool, v_pool, k_buf, v_buf, sems, kv_pages)
    state = (m_ref, l_ref, acc_ref)
    j = pl.program_id(0)
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(j < counts_ref[1])
    def _():
        seq, q0 = blocks_ref[2 * j], blocks_ref[2 * j + 1]
        q_len = cu_ref[seq + 1] - cu_ref[seq]
        kv_len = kv_lens_ref[seq]
        first_pos = kv_len - q_len + q0          # position of the block's first token
        valid_tokens = jnp.minimum(q_tokens, q_len - q0)
        seen = first_pos + valid_tokens          # one past the last position a row may see
        num_pages = (seen + page_size - 1) // page_size
        num_blocks = (num_pages + kv_pages - 1) // kv_pages
        token = jax.lax.broadcasted_iota(jnp.int32, (rows, span), 0) // group
        cols = jax.lax.broadcasted_iota(jnp.int32, (rows, span), 1)
        kv_col = jax.lax.broadcasted_iota(jnp.int32, (span, 1), 0)
        _reset(state)
        pages.start(seq, 0, num_pages, 0)

        def block(b, carry):
            slot = b % 2

            @pl.when(b + 1 < num_blocks)
            def _():
                pages.start(seq, b + 1, num_pages, 1 - slot)

            pages.wait(seq, b, num_pages, slot)
            valid = (token < valid_tokens) & (b * span + cols <= first_pos + token)
            kv_ok = b * span + kv_col < seen
            for kvh in range(kv_heads):
                _fold(state, kvh, q_ref[kvh], k_buf[slot, kvh], v_buf[slot, kvh], valid,
                      kv_ok, sm_scale)
            return carry

        jax.lax.fori_loop(0, num_blocks, block, 0)
        for kvh in range(kv_heads):
            o_ref[kvh] = _result(state, kvh).astype(o_ref.dtype)


def _kv_scratch(blocks: KernelBlocks, pool_shape, dtype, rows: int):
    _, page_size, kv_heads, head_dim = pool_shape
    kv_pages = blocks.kv_pages(page_size)
    buf = pltpu.VMEM((2, kv_heads, kv_pages * page_size, head_dim), dtype)
    return [buf, buf, pltpu.SemaphoreType.DMA((2, 2, kv_heads, kv_pages)),
            pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32)]


def _call(kind, kernel, q, k_pool, v_pool, scalars, block, steps, rows, interpret):
    """One kind's pallas_call: q/out blocks of shape `block` per grid step, pools in HBM,
    the shared KV scratch for `rows` matmul rows, grid steps independent ("parallel")."""
    spec = pl.BlockSpec(block, lambda i, *_: (i, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(steps,), in_specs=[spec, any_spec, any_spec],
            out_specs=spec, scratch_shapes=_kv_scratch(kind, k_pool.shape, k_pool.dtype, rows)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret, name=NAMES[kind.kind],
    )(*scalars, q, k_pool, v_pool)


def _decode_call(q_dec, k_pool, v_pool, scalars, blocks, width, sm_scale, interpret):
    _, kv_heads, group, head_dim = q_dec.shape
    kernel = functools.partial(_decode_kernel, seqs=blocks.seqs,
                               kv_pages=blocks.kv_pages(k_pool.shape[1]), width=width,
                               sm_scale=sm_scale)
    return _call(blocks, kernel, q_dec, k_pool, v_pool, scalars,
                 (blocks.seqs, kv_heads, group, head_dim), scalars[3].shape[0] // blocks.seqs,
                 group, interpret)


def _prefill_call(q_pf, k_pool, v_pool, scalars, blocks, width, sm_scale, interpret):
    steps, kv_heads, rows, head_dim = q_pf.shape
    kernel = functools.partial(_prefill_kernel, q_tokens=blocks.q_tokens, group=blocks.group,
                               kv_pages=blocks.kv_pages(k_pool.shape[1]), width=width,
                               sm_scale=sm_scale)
    return _call(blocks, kernel, q_pf, k_pool, v_pool, scalars,
                 (None, kv_heads, rows, head_dim), steps, rows, interpret)


def check_shapes(q_shape: tuple, pool_shape: tuple) -> None:
    num_heads, head_dim = q_shape[1], q_shape[2]
    if len(pool_shape) != 4 or pool_shape[3] != head_dim:
        raise ValueError(f"KV pool {pool_shape} is not [pages, page_size, kv_heads, {head_dim}] "
                         f"for q {q_shape}")
    if num_heads % pool_shape[2]:
        raise ValueError(f"{num_heads} query heads do not group over {pool_shape[2]} kv heads")


def kernel_blocks(q_dtype, kv_dtype, heads: int, kv_heads: int, head_dim: int, page_size: int,
                  tokens: int) -> tuple[KernelBlocks, KernelBlocks]:
    """(decode, prefill) blocks of a step of `tokens` (bucket) for these per-device shapes."""
    key = (str(jnp.dtype(q_dtype)), str(jnp.dtype(kv_dtype)), heads, kv_heads, head_dim,
           page_size, tokens)
    return blocks_for("decode", *key), blocks_for("prefill", *key)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def ragged_paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           kv_lens: jax.Array, page_table: jax.Array, cu_q_lens: jax.Array,
                           kind_counts: jax.Array, dec_seqs: jax.Array, pf_blocks: jax.Array,
                           pf_q_rows: jax.Array, out_rows: jax.Array, *, sm_scale: float,
                           interpret=False) -> jax.Array:
    """Attention of q [T, H, D] over the pools; returns [T, H, D] in q's dtype.

    The decode grid's rows per step and the prefill blocks' tokens are the shapes of
    `dec_seqs` [Gd, Bd] and `pf_q_rows` [Gp, Tq]; the KV blocks come from the block table.
    ``interpret``: False on a TPU, ``pltpu.InterpretParams(...)`` to run the same kernel in
    JAX's TPU interpreter.
    """
    check_shapes(q.shape, k_pool.shape)
    t, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    decode, prefill = kernel_blocks(q.dtype, k_pool.dtype, heads, kv_heads, head_dim,
                                    page_size, t)
    bd, tq = dec_seqs.shape[1], pf_q_rows.shape[1]
    decode = KernelBlocks("decode", 1, bd, decode.kv_tokens, group)
    prefill = KernelBlocks("prefill", tq, 1, prefill.kv_tokens, group)
    width = page_table.shape[1]
    i32 = jnp.int32
    kv_lens, table = kv_lens.astype(i32), page_table.reshape(-1).astype(i32)
    cu, counts = cu_q_lens.astype(i32), kind_counts.astype(i32)
    dec = dec_seqs.reshape(-1).astype(i32)
    qz = jnp.concatenate([q, jnp.zeros((1, heads, head_dim), q.dtype)])  # row t: zeros

    q_dec = qz[jnp.minimum(cu[dec], t)].reshape(-1, kv_heads, group, head_dim)
    out_dec = _decode_call(q_dec, k_pool, v_pool, (kv_lens, table, counts, dec), decode,
                           width, sm_scale, interpret)

    gp = pf_q_rows.shape[0]
    q_pf = qz[pf_q_rows.reshape(-1)].reshape(gp, tq, kv_heads, group, head_dim)
    q_pf = q_pf.transpose(0, 2, 1, 3, 4).reshape(gp, kv_heads, tq * group, head_dim)
    out_pf = _prefill_call(q_pf, k_pool, v_pool,
                           (kv_lens, table, cu, counts, pf_blocks.reshape(-1).astype(i32)),
                           prefill, width, sm_scale, interpret)
    out_pf = out_pf.reshape(gp, kv_heads, tq, group, head_dim).transpose(0, 2, 1, 3, 4)
    rows = jnp.concatenate([out_dec.reshape(-1, heads, head_dim),
                            out_pf.reshape(-1, heads, head_dim),
                            jnp.zeros((1, heads, head_dim), q.dtype)])
    return rows[out_rows]
