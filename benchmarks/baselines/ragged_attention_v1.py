"""Baseline for benchmarks/bench_tpu_step.py: pdtopo's previous Pallas TPU ragged
paged-attention kernel, restored unchanged from git (`git show
ce245dc:pdtopo/kernels/ragged_attention.py`; it served until df1629e replaced it with the
per-kind kernel in pdtopo/kernels/ragged_attention.py). Not used by pdtopo: the bench runs it
interpreted beside the current kernel, on the same steps, to count both kernels' DMAs.
Its step inputs are the ragged layout's kv_lens, page_table, cu_q_lens and num_seqs
(pdtopo.runtime.engine.step_inputs still builds them); it was called with q_block=16 and
pages_per_block=max(1, 64 // page_size).

The original docstring: reads one layer's KV pool in place.

Inputs (one device's shard; call inside ``shard_map`` for a sharded pool):
  q            [T, H, D]     the step's flat query tokens, sequences one after another
  k_pool       [N, S, K, D]  one layer's K pages (docs/architecture.md, "KV pool format")
  v_pool       [N, S, K, D]  the same layer's V pages
  kv_lens      [B]           context length of each sequence after this step (0: empty slot)
  page_table   [B, P]        each sequence's pages, in order (unused entries: any valid page)
  cu_q_lens    [B + 1]       offsets of each sequence's query rows in q
  num_seqs     [1]           real sequences (slots after it are skipped)

Data flow of one call: the grid walks q in blocks of ``q_block`` rows (the output block is the
same rows). For a q block the kernel visits every sequence whose rows overlap it; for such a
sequence it walks the sequence's context ``pages_per_block`` pages at a time, only up to the
last position a row of this block may see (causal skip). Each page is two DMAs (its K and its
V) from the pools, left in HBM (``pl.ANY``), into VMEM buffers,
double-buffered: the next block's pages are requested before the current block is used. Scores for every query head against its kv head
(GQA: query head j reads kv head j // (H / K)) are masked by sequence membership, context
length and causality, and folded into an online softmax kept in VMEM scratch per q block. Rows
of no sequence (padding) come out as zeros. The pool is only read: new K/V are written before
the call (pdtopo.runtime.engine.attention scatters the step's tokens).

The scalar inputs arrive by scalar prefetch (SMEM), so every step of one (T, B, P) shape runs
the same program. The kernel indexes refs only with ``.at``/``pl.ds`` and integers (no ref
reshapes), which is what lets JAX's TPU interpreter run it on the CPU
(``interpret=pltpu.InterpretParams()``): the same kernel and call TPU serving uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_MASKED = -1e30  # finite: a fully masked row keeps m finite and contributes nothing


def _kernel(kv_lens_ref, table_ref, cu_ref, nseq_ref,  # scalar prefetch (SMEM)
            q_ref, k_pool, v_pool,                     # q block (VMEM), pools (HBM)
            o_ref,                                     # output block
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref,  # scratch
            *, q_block: int, pages_per_block: int, table_width: int, sm_scale: float):
    num_heads = q_ref.shape[1]
    group = num_heads // k_pool.shape[2]
    span = pages_per_block * k_pool.shape[1]
    first_row = pl.program_id(0) * q_block
    last_row = first_row + q_block  # exclusive
    rows = first_row + jax.lax.broadcasted_iota(jnp.int32, (q_block, span), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (q_block, span), 1)

    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def block_copies(seq, block, slot):
        copies = []
        for p in range(pages_per_block):
            idx = jnp.minimum(block * pages_per_block + p, table_width - 1)
            page = table_ref[seq * table_width + idx]
            for pool, buf, kind in ((k_pool, k_buf, 0), (v_pool, v_buf, 1)):
                copies.append(pltpu.make_async_copy(pool.at[page], buf.at[slot, p],
                                                    sems.at[kind, slot, p]))
        return copies

    def attend_block(block, slot, q_start, q_end, kv_len, q_len):
        key_pos = block * span + cols
        row_pos = kv_len - q_len + (rows - q_start)
        valid = (rows >= q_start) & (rows < q_end) & (key_pos < kv_len) & (key_pos <= row_pos)
        for h in range(num_heads):
            kvh = h // group
            k = jnp.concatenate([k_buf[slot, p, :, kvh, :] for p in range(pages_per_block)])
            v = jnp.concatenate([v_buf[slot, p, :, kvh, :] for p in range(pages_per_block)])
            s = jax.lax.dot_general(q_ref[:, h, :].astype(k.dtype), k,
                                    (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * sm_scale
            s = jnp.where(valid, s, _MASKED)
            m_old = m_ref[h]                       # [q_block, 1]
            m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m_old - m_new)
            p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
            l_ref[h] = l_ref[h] * alpha + p.sum(axis=1, keepdims=True)
            acc_ref[h] = acc_ref[h] * alpha + jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32)
            m_ref[h] = m_new

    def visit(seq, carry):
        q_start, q_end = cu_ref[seq], cu_ref[seq + 1]
        overlaps = (q_start < last_row) & (q_end > first_row) & (q_end > q_start)

        @pl.when(overlaps)
        def _():
            kv_len = kv_lens_ref[seq]
            q_len = q_end - q_start
            # one past the last position any of this block's rows of `seq` may see
            top_row = jnp.minimum(q_end, last_row) - 1
            seen = kv_len - q_len + (top_row - q_start) + 1
            num_blocks = (seen + span - 1) // span
            for c in block_copies(seq, 0, 0):
                c.start()

            def step(block, carry):
                slot = block % 2

                @pl.when(block + 1 < num_blocks)
                def _():
                    for c in block_copies(seq, block + 1, 1 - slot):
                        c.start()

                for c in block_copies(seq, block, slot):
                    c.wait()
                attend_block(block, slot, q_start, q_end, kv_len, q_len)
                return carry

            jax.lax.fori_loop(0, num_blocks, step, 0)

        return carry

    jax.lax.fori_loop(0, nseq_ref[0], visit, 0)
    for h in range(num_heads):
        denom = l_ref[h]
        o_ref[:, h, :] = (acc_ref[h] / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


def padded_tokens(num_tokens: int, q_block: int) -> int:
    """Rows q must have for `q_block`: a whole number of blocks."""
    return -(-num_tokens // q_block) * q_block


def check_shapes(q_shape: tuple, pool_shape: tuple) -> None:
    num_heads, head_dim = q_shape[1], q_shape[2]
    if len(pool_shape) != 4 or pool_shape[3] != head_dim:
        raise ValueError(f"KV pool {pool_shape} is not [pages, page_size, kv_heads, {head_dim}] "
                         f"for q {q_shape}")
    if num_heads % pool_shape[2]:
        raise ValueError(f"{num_heads} query heads do not group over {pool_shape[2]} kv heads")


@functools.partial(jax.jit, static_argnames=("sm_scale", "q_block", "pages_per_block",
                                             "interpret"))
def ragged_paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           kv_lens: jax.Array, page_table: jax.Array, cu_q_lens: jax.Array,
                           num_seqs: jax.Array, *, sm_scale: float, q_block: int = 16,
                           pages_per_block: int = 4, interpret=False) -> jax.Array:
    """Attention of q [T, H, D] over the pools; returns [T, H, D] in q's dtype.

    T may be any length (q is padded to whole blocks inside). ``interpret``: False on a TPU,
    ``pltpu.InterpretParams()`` to run the same kernel in JAX's TPU interpreter.
    """
    check_shapes(q.shape, k_pool.shape)
    t, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    width = page_table.shape[1]
    tp = padded_tokens(t, q_block)
    qp = jnp.pad(q, ((0, tp - t), (0, 0), (0, 0))) if tp != t else q
    kernel = functools.partial(_kernel, q_block=q_block, pages_per_block=pages_per_block,
                               table_width=width, sm_scale=float(sm_scale))
    q_spec = pl.BlockSpec((q_block, num_heads, head_dim), lambda i, *_: (i, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    page_buf = pltpu.VMEM((2, pages_per_block, page_size, kv_heads, head_dim), k_pool.dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tp, num_heads, head_dim), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(tp // q_block,),
            in_specs=[q_spec, any_spec, any_spec],
            out_specs=q_spec,
            scratch_shapes=[
                page_buf, page_buf,
                pltpu.SemaphoreType.DMA((2, 2, pages_per_block)),
                pltpu.VMEM((num_heads, q_block, 1), jnp.float32),
                pltpu.VMEM((num_heads, q_block, 1), jnp.float32),
                pltpu.VMEM((num_heads, q_block, head_dim), jnp.float32),
            ]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="pdtopo_ragged_paged_attention",
    )(kv_lens.astype(jnp.int32), page_table.reshape(-1).astype(jnp.int32),
      cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), qp, k_pool, v_pool)
    return out[:t]
