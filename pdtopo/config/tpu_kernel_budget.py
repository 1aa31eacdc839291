"""On-chip memory the TPU attention kernel needs, checked before anything starts.

pdtopo's ragged paged-attention kernel (`pdtopo.kernels.ragged_attention`) takes every row's page
table, the context lengths, the query offsets and its per-kind work lists by scalar prefetch, so
they sit in the core's SMEM (1 MiB on TPU v4 and later); its KV buffers, query/output blocks,
softmax state and score tiles sit in VMEM, under the compiler's default scoped-VMEM limit
(16 MiB). Both follow from the engine settings, the model's shapes and the block table
(`pdtopo.config.attention_blocks`, the same one the kernel runs with):

    smem_bytes(max_running_requests, max_model_len, page_size, max_prefill_tokens)
    vmem_bytes(blocks, kv_heads_per_device, head_dim, q_itemsize, kv_itemsize)  (one call)
    problems(engine, kv_heads, heads, head_dim, tp) -> [(key, value, why)] naming what to change

VMEM is counted the way the TPU lays arrays out: the minor dimension padded to 128 lanes, the
second-minor to 8 sublanes of 32 bits (16 rows for bf16, 32 for 8-bit types), so a [G, 1]
softmax column takes a whole [8, 128] tile. Pure arithmetic, no I/O: the plan checks roles whose
model shapes the config states, and the model runner checks again with the checkpoint's shapes
before it allocates anything. The budgets leave a quarter of SMEM and half of the scoped VMEM
for what the compiler itself places there (256 rows at 8K tokens of 16-token pages, 514 KiB of
page tables, fits).
"""

from __future__ import annotations

import math
from typing import Any

from pdtopo.config.attention_blocks import (
    DECODE_SEQS,
    PREFILL_Q_TOKENS,
    KernelBlocks,
    blocks_for,
)
from pdtopo.config.settings import resolved_dtype

SMEM_BUDGET = 768 * 1024        # of a v4/v5e/v5p/v6e/v7 core's 1 MiB; 256 KiB left over
VMEM_BUDGET = 8 * 1024 * 1024   # half of the default 16 MiB scoped VMEM
# page tables are as wide as the longest request, in whole 64-token blocks (step_inputs)
TABLE_BLOCK_TOKENS = 64
INT32 = 4
LANES = 128
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _bucket(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """VMEM bytes of a [rows, cols] array: cols padded to 128 lanes, rows to the sublane
    tile of the dtype (8 rows of 32 bits: 16 of bf16)."""
    sublanes = 8 * max(1, 4 // itemsize)
    return _round_up(rows, sublanes) * _round_up(cols, LANES) * itemsize


def smem_bytes(max_running_requests: int, max_model_len: int, page_size: int,
               max_prefill_tokens: int = 0) -> int:
    """Scalar-prefetch bytes of the largest step: page tables [rows, width], kv_lens [rows],
    cu_q_lens [rows+1], kind_counts [2], the decode rows (rows, whole grid steps) and the
    prefill blocks (2 ints each; at most tokens / 64 + min(rows, tokens / 2) of them: 64 is
    the smallest prefill block the table gives). rows: the batch bucket; width: max_model_len's
    pages in whole 64-token blocks."""
    rows = _bucket(max_running_requests)
    per_block = max(1, TABLE_BLOCK_TOKENS // page_size)
    width = -(-math.ceil(max_model_len / page_size) // per_block) * per_block
    tokens = max(rows, _bucket(max_prefill_tokens))
    decode = _round_up(min(rows, tokens), DECODE_SEQS)
    prefill = max(1, tokens // PREFILL_Q_TOKENS + min(rows, tokens // 2))
    return INT32 * (rows * width + rows + rows + 1 + 2 + decode + 2 * prefill)


def vmem_bytes(blocks: KernelBlocks, kv_heads: int, head_dim: int, q_itemsize: int,
               kv_itemsize: int) -> int:
    """Per-device VMEM of one kernel call: K and V buffers (two slots, a [kv_tokens, D] tile
    per KV head), query and output blocks (the pipeline double-buffers both), float32 softmax
    state (m, l columns and the accumulator) and the float32 score, probability and mask
    tiles of one KV head at a time."""
    rows, span = blocks.rows, blocks.kv_tokens
    kv = 2 * 2 * kv_heads * tile_bytes(span, head_dim, kv_itemsize)
    if blocks.kind == "decode":
        q_block = blocks.seqs * kv_heads * tile_bytes(blocks.group, head_dim, q_itemsize)
    else:
        q_block = kv_heads * tile_bytes(rows, head_dim, q_itemsize)
    state = kv_heads * (2 * tile_bytes(rows, 1, 4) + tile_bytes(rows, head_dim, 4))
    temps = 3 * tile_bytes(rows, span, 4)
    return kv + 2 * 2 * q_block + state + temps


def kernel_vmem(engine: Any, kv_heads: int, heads: int, head_dim: int) -> dict[str, int]:
    """VMEM of each call (decode, prefill) of the largest step, per device."""
    q_dtype = resolved_dtype(engine.dtype, "tpu")
    kv_dtype = resolved_dtype(engine.kv_dtype, "tpu")
    tokens = max(_bucket(engine.max_running_requests), _bucket(engine.max_prefill_tokens))
    out = {}
    for kind in ("decode", "prefill"):
        blocks = blocks_for(kind, q_dtype, kv_dtype, heads, kv_heads, head_dim,
                            engine.page_size, tokens)
        out[kind] = vmem_bytes(blocks, kv_heads, head_dim, ITEMSIZE.get(q_dtype, 4),
                               ITEMSIZE.get(kv_dtype, 4))
    return out


def problems(engine: Any, kv_heads: int | None, heads: int | None, head_dim: int | None,
             tp: int) -> list[tuple[str, Any, str]]:
    """What does not fit as (key, value, why) (empty when the kernel fits). Model shapes not
    known yet (None: a checkpoint the plan does not read) skip the VMEM check."""
    out = []
    smem = smem_bytes(engine.max_running_requests, engine.max_model_len, engine.page_size,
                      engine.max_prefill_tokens)
    if smem > SMEM_BUDGET:
        out.append((
            "engine.max_running_requests", engine.max_running_requests,
            f"engine.max_running_requests={engine.max_running_requests} with "
            f"engine.max_model_len={engine.max_model_len} and engine.page_size="
            f"{engine.page_size}: the TPU attention kernel's page tables need {smem / 1024:.0f} "
            f"KiB of SMEM, over its {SMEM_BUDGET // 1024} KiB budget; lower "
            "engine.max_running_requests or engine.max_model_len, or raise engine.page_size"))
    if None in (kv_heads, heads, head_dim):
        return out
    kvd, hd = max(1, kv_heads // tp), max(1, heads // tp)
    vmem = kernel_vmem(engine, kvd, hd, head_dim)
    kind = max(vmem, key=vmem.get)
    if vmem[kind] > VMEM_BUDGET:
        out.append((
            "engine.page_size", engine.page_size,
            f"engine.page_size={engine.page_size}: the TPU attention kernel's {kind} call "
            f"needs {vmem[kind] / 2**20:.1f} MiB of VMEM per device ({hd} query and {kvd} KV "
            f"heads of {head_dim} per device, KV blocks of at least one page), over its "
            f"{VMEM_BUDGET // 2**20} MiB budget; lower engine.page_size or raise the tp"))
    return out
