"""Pallas TPU ``multi_layer_copy``: scatter packed KV pages into the pool with async DMAs.

Data flow for ``multi_layer_copy(pool, packed, page_ids)``:

1. Host (``runs``): destination page ids -> runs of consecutive pages -> DMA chunks whose
   lengths are powers of two (a DMA needs a static size) -> chunk arrays (packed offset, pool
   page, size class) padded to the page bucket B, plus the real chunk count.
2. Kernel (one grid step, all refs in ``pl.ANY`` memory, i.e. left in HBM): for every layer
   (entries k_l, v_l) and every chunk < count it starts
   ``make_async_copy(packed[e][src:src+2**c], pool[e][dst:dst+2**c], sem[l % 2])``; layer l+1's
   copies are started before layer l's are waited on, so the DMA engines always have queued
   work. The chunk arrays and the count arrive by scalar prefetch (SMEM), so every request
   length in a bucket runs the same compiled kernel; the size class selects one of a few
   static-size copies with ``pl.when``.
3. ``input_output_aliases`` maps every pool input to its output and the jitted wrapper donates
   the pool, so the pool is updated in place.

Sharded pools (NamedSharding, e.g. heads over "tp"): the kernel runs per shard under
``jax.shard_map`` with packed arrays sharded like the pool (page offsets are the same on every
shard; only the head slice differs).

Off TPU the kernel runs in Pallas TPU interpret mode; under shard_map with DMA execution
``eager`` (the default ``on_wait`` hangs there with several emulated devices).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdtopo.kernels import interpret_support
from pdtopo.kernels import runs as _runs

# Largest DMA chunk (pages). Longer runs become several chunks; the kernel has one static-size
# copy branch per power of two up to this size.
MAX_CHUNK_PAGES = 64

TRACE_COUNTS: collections.Counter = collections.Counter()


def _layer_groups(num_entries: int) -> list[tuple[int, ...]]:
    """Entries grouped by layer: (k_0, v_0), (k_1, v_1), ..."""
    return [tuple(range(i, min(i + 2, num_entries))) for i in range(0, num_entries, 2)]


def _make_kernel(num_entries: int, num_classes: int):
    groups = _layer_groups(num_entries)

    def kernel(src_ref, dst_ref, cls_ref, count_ref, *refs):
        packed = refs[:num_entries]
        pool = refs[2 * num_entries: 3 * num_entries]  # outputs (aliased to the pool inputs)
        sems = refs[3 * num_entries]
        count = count_ref[0]

        def for_each_copy(group, slot, action):
            def body(i, carry):
                src, dst, cls = src_ref[i], dst_ref[i], cls_ref[i]
                for c in range(num_classes):
                    size = 1 << c

                    @pl.when(cls == c)
                    def _(size=size):
                        for e in group:
                            copy = pltpu.make_async_copy(
                                packed[e].at[pl.ds(src, size)],
                                pool[e].at[pl.ds(dst, size)],
                                sems.at[slot])
                            if action == "start":
                                copy.start()
                            else:
                                copy.wait()
                return carry

            jax.lax.fori_loop(0, count, body, 0)

        for_each_copy(groups[0], 0, "start")
        for layer in range(1, len(groups)):
            for_each_copy(groups[layer], layer % 2, "start")
            for_each_copy(groups[layer - 1], (layer - 1) % 2, "wait")
        for_each_copy(groups[-1], (len(groups) - 1) % 2, "wait")

    return kernel


def _copy_local(pool: tuple, packed: tuple, src, dst, cls, count, *, num_classes: int,
                interpret):
    """The pallas_call on local (per-shard) arrays; returns the updated pool entries."""
    num_entries = len(pool)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        _make_kernel(num_entries, num_classes),
        out_shape=[jax.ShapeDtypeStruct(kv.shape, kv.dtype) for kv in pool],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(1,),
            in_specs=[any_spec] * (2 * num_entries),
            out_specs=[any_spec] * num_entries,
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        # operands: 4 scalar-prefetch arrays, packed entries, pool entries
        input_output_aliases={4 + num_entries + i: i for i in range(num_entries)},
        interpret=interpret,
        name="multi_layer_copy",
    )
    return tuple(call(src, dst, cls, count, *packed, *pool))


@functools.partial(jax.jit, static_argnames=("num_classes", "interpret", "sharding"),
                   donate_argnums=(0,))
def _multi_layer_copy_jit(pool: tuple, packed: tuple, src, dst, cls, count, *,
                          num_classes: int, interpret, sharding):
    TRACE_COUNTS["multi_layer_copy"] += 1
    local = functools.partial(_copy_local, num_classes=num_classes, interpret=interpret)
    if sharding is None:
        return local(pool, packed, src, dst, cls, count)
    spec = sharding.spec
    n = len(pool)
    mapped = jax.shard_map(
        local, mesh=sharding.mesh,
        in_specs=((spec,) * n, (spec,) * n, P(), P(), P(), P()),
        out_specs=(spec,) * n,
        check_vma=False,
    )
    return mapped(pool, packed, src, dst, cls, count)


def _interpret_params(interpret, backend: str, sharded: bool):
    """None -> interpret off TPU; True -> InterpretParams suited to the layout; else as given."""
    if interpret is None:
        interpret = backend != "tpu"
    if interpret is not False:
        interpret_support.install()
    if interpret is True:
        # "eager" DMAs under shard_map: the default "on_wait" hangs with several devices.
        return pltpu.InterpretParams(dma_execution_mode="eager" if sharded else "on_wait")
    if interpret is False:
        return False
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise ValueError(f"interpret must be None, a bool or pltpu.InterpretParams, got {interpret!r}")


def multi_layer_copy(pool: tuple, packed: tuple, page_ids, *, interpret=None,
                     first_row: int = 0) -> tuple:
    """Write ``packed[e][first_row + j]`` to ``pool[e][page_ids[j]]`` for every entry e; pool
    is donated.

    ``packed`` entries must already have the bucket length
    ``runs.bucket_size(first_row + len(page_ids))`` and the pool's sharding; ``page_ids`` must
    be validated and unique (``pdtopo.kernels.insert_kv_chunks`` does both).
    """
    ids = page_ids if hasattr(page_ids, "dtype") else _runs.validate_page_ids(
        page_ids, pool[0].shape[0], unique=True)
    bucket = packed[0].shape[0]
    if bucket != _runs.bucket_size(first_row + len(ids)):
        raise ValueError(f"packed arrays have {bucket} pages; expected the bucket "
                         f"{_runs.bucket_size(first_row + len(ids))} for {len(ids)} page ids "
                         f"after {first_row} skipped rows")
    max_chunk = _runs.max_chunk_for(bucket, MAX_CHUNK_PAGES)
    runs = _runs.page_runs(ids)
    runs = runs._replace(src=runs.src + np.int32(first_row))
    chunks, count = _runs.pad_chunks(_runs.dma_chunks(runs, max_chunk), bucket)
    sharding = pool[0].sharding if isinstance(pool[0].sharding, NamedSharding) else None
    params = _interpret_params(interpret, jax.default_backend(), sharding is not None)
    try:
        return _multi_layer_copy_jit(
            pool, packed, *(jnp.asarray(a) for a in chunks), jnp.asarray([count], jnp.int32),
            num_classes=max_chunk.bit_length(), interpret=params, sharding=sharding)
    except Exception:
        if params is not False:
            pltpu.reset_tpu_interpret_mode_state()
        raise
