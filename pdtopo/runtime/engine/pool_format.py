"""The name of the KV pool's storage format, which P and D compare before moving pages.

`kv_caches` is `2 * num_layers` arrays `[num_pages, page_size, kv_heads, head_dim]`, ordered
k_0, v_0, k_1, ... (docs/architecture.md, "KV pool format"). `ModelRunner.kv_layout()` reports
this name and `pdtopo.runtime.disagg.reshard.layout.layout_problems` refuses a peer that stores KV
another way, naming both. Servers from before the name existed stored this same format, so a
layout without it reads as this one.
"""

POOL_FORMAT = "k-v-arrays-per-layer/1"
