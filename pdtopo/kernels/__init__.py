"""KV page gather/scatter kernels (Pallas TPU multi_layer_copy and an XLA implementation) and
the TPU ragged paged-attention kernel (ragged_attention.py).

This face only re-exports the copy entry points; the code is in the rooms:

    kv_copy.py                  select_from_kv_caches / insert_kv_chunks / insert_rows /
                                insert_kv_pieces: checked, then dispatched by `impl` (IMPLS)
    checks.py                   the pool and packed-array checks they share
    runs.py                     page-id validation, buckets (bucket_size), runs, DMA chunks
    xla_copy.py                 the XLA gather / scatter programs
    pallas_multi_layer_copy.py  the Pallas TPU scatter (async DMAs over merged page runs)
    ragged_attention.py         the ragged paged-attention kernel (engine.attention_impl)
"""

from pdtopo.kernels.kv_copy import (
    IMPLS,
    insert_kv_chunks,
    insert_kv_pieces,
    insert_rows,
    select_from_kv_caches,
)
from pdtopo.kernels.runs import bucket_size

__all__ = ["select_from_kv_caches", "insert_kv_chunks", "insert_rows", "insert_kv_pieces",
           "bucket_size", "IMPLS"]
