"""XLA gather/scatter of KV pages over all layer entries of a pool (bucketed, jit-cached).

Gather:  kv_caches[i][ids_padded] for every entry i in one jitted call; ids are padded to a
         power-of-two bucket with page 0 (a valid page whose rows are then dropped), so all
         request lengths of a bucket share one executable. The caller slices the result to n
         (``take_leading``), a separate tiny jitted slice.
Scatter: kv_caches[i].at[ids_padded].set(packed_padded[i], mode="drop") with the pool donated;
         padding ids point one past the pool (``num_pages``) so padded rows are dropped and no
         real page is touched.

Sharding: the pool's sharding (e.g. heads over "tp") is passed as a static argument and
imposed on the results with ``with_sharding_constraint``, so packed arrays come out sharded
like the pool and the scattered pool keeps its layout.

``TRACE_COUNTS`` counts Python traces of each jitted function (tests use it to prove that
lengths inside one bucket do not retrace).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

TRACE_COUNTS: collections.Counter = collections.Counter()


def _constrain(xs, shardings):
    if shardings is None:
        return xs
    return tuple(jax.lax.with_sharding_constraint(x, s) for x, s in zip(xs, shardings, strict=True))


@functools.partial(jax.jit, static_argnames=("shardings",))
def gather_pages(kv_caches: tuple, ids, shardings=None) -> tuple:
    """Packed ``[B, page_size, heads, head_dim]`` per entry, B = len(ids)."""
    TRACE_COUNTS["gather"] += 1
    return _constrain(tuple(jnp.take(kv, ids, axis=0) for kv in kv_caches), shardings)


@functools.partial(jax.jit, static_argnames=("shardings",), donate_argnums=(0,))
def scatter_pages(kv_caches: tuple, packed: tuple, ids, shardings=None) -> tuple:
    """Pool entries with ``packed[i][j]`` written at page ``ids[j]`` (out-of-range ids dropped)."""
    TRACE_COUNTS["scatter"] += 1
    out = tuple(kv.at[ids].set(p.astype(kv.dtype), mode="drop")
                for kv, p in zip(kv_caches, packed, strict=True))
    return _constrain(out, shardings)


@functools.partial(jax.jit, static_argnames=("n", "shardings"))
def take_leading(xs: tuple, n: int, shardings=None) -> tuple:
    """The first ``n`` rows of every array (glue: one tiny executable per distinct n)."""
    TRACE_COUNTS["take_leading"] += 1
    return _constrain(tuple(x[:n] for x in xs), shardings)


@functools.partial(jax.jit, static_argnames=("bucket", "shardings"))
def pad_leading(xs: tuple, bucket: int, shardings=None) -> tuple:
    """Every array zero-padded along axis 0 to ``bucket`` rows (glue, per distinct n)."""
    TRACE_COUNTS["pad_leading"] += 1
    out = tuple(jnp.pad(x, [(0, bucket - x.shape[0])] + [(0, 0)] * (x.ndim - 1)) for x in xs)
    return _constrain(out, shardings)
