"""On-chip memory the TPU attention kernel needs, checked before anything starts.

pdtopo's ragged paged-attention kernel (`pdtopo.kernels.ragged_attention`) takes every row's page
table, the context lengths and the query offsets by scalar prefetch, so they sit in the core's
SMEM (1 MiB on TPU v4 and later); its page buffers, query/output blocks and softmax state sit
in VMEM, under the compiler's default scoped-VMEM limit (16 MiB). Both follow from the engine
settings and the model's shapes alone:

    smem_bytes(max_running_requests, max_model_len, page_size)
    vmem_bytes(page_size, kv_heads_per_device, heads_per_device, head_dim, kv_itemsize)
    problems(engine, kv_heads, heads, head_dim, tp) -> [(key, value, why)] naming what to change

Pure arithmetic, no I/O: the plan checks roles whose model shapes the config states, and the
model runner checks again with the checkpoint's shapes before it allocates anything. The
kernel's block sizes live here (`Q_BLOCK`, `CONTEXT_BLOCK_TOKENS`: the attention and step-input
modules read them from this module); the budgets leave a quarter of
SMEM and half of the scoped VMEM for what the compiler itself places there (256 rows at 8K
tokens of 16-token pages, 514 KiB of page tables, fits).
"""

from __future__ import annotations

import math
from typing import Any

from pdtopo.config.settings import resolved_dtype

SMEM_BUDGET = 768 * 1024        # of a v4/v5e/v5p/v6e/v7 core's 1 MiB; 256 KiB left over
VMEM_BUDGET = 8 * 1024 * 1024   # half of the default 16 MiB scoped VMEM
Q_BLOCK = 16                    # query rows per grid step of the ragged kernel (fewer when
#                                 the step is shorter)
# context tokens attention reads per block: long enough to amortise the loop, short enough that
# a short context is not padded much
CONTEXT_BLOCK_TOKENS = 64
INT32 = 4


def _bucket(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def pages_per_block(page_size: int) -> int:
    return max(1, CONTEXT_BLOCK_TOKENS // page_size)


def smem_bytes(max_running_requests: int, max_model_len: int, page_size: int) -> int:
    """Scalar-prefetch bytes: page tables [rows, width], kv_lens [rows], cu_q_lens [rows+1],
    num_seqs [1] (rows: the batch bucket; width: max_model_len's pages, block-aligned)."""
    rows = _bucket(max_running_requests)
    ppb = pages_per_block(page_size)
    width = -(-math.ceil(max_model_len / page_size) // ppb) * ppb
    return INT32 * (rows * width + rows + rows + 1 + 1)


def vmem_bytes(page_size: int, kv_heads: int, heads: int, head_dim: int,
               kv_itemsize: int) -> int:
    """Per-device VMEM: K and V page buffers (two slots each), query and output blocks (the
    pipeline double-buffers them), float32 softmax state and accumulator."""
    pages = 2 * 2 * pages_per_block(page_size) * page_size * kv_heads * head_dim * kv_itemsize
    blocks = 2 * 2 * Q_BLOCK * heads * head_dim * 4
    state = heads * Q_BLOCK * (head_dim + 2) * 4
    return pages + blocks + state


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def problems(engine: Any, kv_heads: int | None, heads: int | None, head_dim: int | None,
             tp: int) -> list[tuple[str, Any, str]]:
    """What does not fit as (key, value, why) (empty when the kernel fits). Model shapes not
    known yet (None: a checkpoint the plan does not read) skip the VMEM check."""
    out = []
    smem = smem_bytes(engine.max_running_requests, engine.max_model_len, engine.page_size)
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
    vmem = vmem_bytes(engine.page_size, max(1, kv_heads // tp), max(1, heads // tp), head_dim,
                      ITEMSIZE.get(resolved_dtype(engine.kv_dtype, "tpu"), 4))
    if vmem > VMEM_BUDGET:
        out.append((
            "engine.page_size", engine.page_size,
            f"engine.page_size={engine.page_size}: the TPU attention kernel needs "
            f"{vmem / 2**20:.1f} MiB of VMEM per device ({max(1, heads // tp)} query and "
            f"{max(1, kv_heads // tp)} KV heads of {head_dim} per device), over its "
            f"{VMEM_BUDGET // 2**20} MiB budget; lower engine.page_size or raise the tp"))
    return out
