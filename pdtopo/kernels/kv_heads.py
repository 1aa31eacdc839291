"""Packed KV between engines that repeat the model's KV heads differently.

An engine whose tp exceeds the model's KV heads repeats each head tp / num_kv_heads times
(`pdtopo.model_config.shapes.serving_config`): head k of the model is pool heads
k*r .. k*r + r - 1. Moving packed KV `[n, page_size, heads, head_dim]` from an engine with r_from
copies to one with r_to copies keeps the first copy of each head and repeats it r_to times:

    packed = convert_heads(packed, base_heads=model_kv_heads, to_heads=target_pool_heads)

Only the first copies travel when the source repeats heads (the slice runs before the move).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def convert_heads(packed: Sequence[jax.Array], base_heads: int,
                  to_heads: int) -> list[jax.Array]:
    out = []
    for a in packed:
        from_heads = int(a.shape[2])
        if from_heads == to_heads:
            out.append(a)
            continue
        if from_heads % base_heads or to_heads % base_heads:
            raise ValueError(f"packed KV has {from_heads} heads, the target pool {to_heads}: "
                             f"neither is a multiple of the model's {base_heads} KV heads")
        first = a[:, :, :: from_heads // base_heads]  # one copy of each model head
        r_to = to_heads // base_heads
        out.append(first if r_to == 1 else jnp.repeat(first, r_to, axis=2))
    return out
