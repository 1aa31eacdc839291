"""How much device memory a server keeps out of a KV pool sized from memory: pure settings
arithmetic, shared by the model runner (which sizes the pool at start) and the launcher's
pool estimate (`pdtopo render`, the launch table).

    reserved_pages(settings, role)
        decode / colocated      0
        prefill, mode A         disaggregation.max_held_kv_pages (copies wait in device memory)
        prefill, mode B         staging_reserve_pages(engine): copies wait in host memory; only
                                their packing on the way there is on the device
"""

from __future__ import annotations

import math
from typing import Any

# mode B (d2h_staging): packed copies of this many longest prompts may be on the device at
# once: the one being staged and the one before it, whose copy to host the transfer engine
# waits for before starting another (`JaxTransferKVEngine._stage`)
STAGING_COPIES = 2
GATHER_MIN_BUCKET = 8  # pdtopo.kernels.runs.MIN_BUCKET (a test keeps the two equal)


def gather_bucket(pages: int) -> int:
    """The page count a packed copy of `pages` pages is padded to (kernels.bucket_size)."""
    b = GATHER_MIN_BUCKET
    while b < pages:
        b *= 2
    return b


def staging_reserve_pages(engine: Any) -> int:
    """Mode B's transient device memory, in pool pages: `STAGING_COPIES` packed copies of an
    `engine.max_model_len` prompt, each padded to its gather bucket."""
    longest = math.ceil(int(engine.max_model_len) / int(engine.page_size))
    return STAGING_COPIES * gather_bucket(longest)


def reserved_pages(settings: Any, role: str) -> int:
    """Pages' worth of device memory a server of `role` keeps out of a pool that
    `engine.kv_memory_fraction` sizes (see the module docstring)."""
    if role != "prefill":
        return 0
    if settings.disaggregation.d2h_staging:
        return staging_reserve_pages(settings.engine)
    return int(settings.disaggregation.max_held_kv_pages)
