"""KV pool traffic of a TPU engine step, counted without a TPU.

    python benchmarks/bench_tpu_step.py

Builds one decoder layer of a Llama-3-8B-shaped stack (hidden 4096, 32 heads, 8 KV heads,
head_dim 128, bf16) as the engine compiles it (`step_programs._layer`, inside shard_map over a
tp=4 mesh of CPU devices), for two steps: a decode step (128 sequences at 2K context) and a
mixed step (96 decodes at 2K plus a 512-token prefill chunk continuing a 1K prompt). Each step
is built twice:
  today   the previous TPU path: the used pages of every row's page table (padded to the
          batch's page bucket) gathered from the K and V pools into one interleaved copy, then
          JAX's ragged paged-attention kernel on that copy (its block sizes passed, since its
          own lookup asks for the TPU version);
  new     pdtopo's kernel (`pdtopo.kernels.ragged_attention`) reading the pools in place.
Both are exported for TPU (`jax.export` with platforms=["tpu"]; the kernels become
`tpu_custom_call`s) to show the program is a TPU program, and their bytes are counted from the
traced program (the jaxpr the export lowers), per device, per layer (every layer is the same):
  - a gather/slice of a pool array reads its result's bytes from the pool;
  - a scatter/update into a pool array writes its update's bytes;
  - an array derived from a pool (a gathered copy) that a kernel takes as input was written
    once: its bytes (the fusion that makes it reads the pool once, counted above);
  - a kernel reads, from each pool-derived input, the pages its sequences occupy
    (ceil(kv_len / page_size) pages each, read once).
Live KV bytes are the bytes of the pages the batch's sequences occupy (K and V). Printed per
step: today's and the new path's bytes and each one's ratio to live bytes (1.0 is the floor).
The last line is the new decode step's: `decode step KV bytes / live KV bytes = X.XXx`.
What this does not measure: time. A TPU run must still confirm the kernel's speed (DMA
overlap, VMEM tiling of the [page_size, kv_heads, head_dim] pages) and Mosaic's acceptance of
the kernel, which lowering alone does not prove.
"""

from __future__ import annotations

import math
import os
import sys
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pdtopo.model_config.spec import ModelConfig  # noqa: E402
from pdtopo.runtime.engine import attention as attn  # noqa: E402
from pdtopo.runtime.engine.mesh import build_mesh  # noqa: E402
from pdtopo.runtime.engine.model_runner import SeqChunk  # noqa: E402
from pdtopo.runtime.engine.step_inputs import StepGeometry, prepare_step  # noqa: E402
from pdtopo.runtime.engine.step_programs import _layer, abstract  # noqa: E402
from pdtopo.runtime.model import llama  # noqa: E402

TP = 4
PAGE_SIZE = 64
CONTEXT = 2048
LLAMA3_8B = ModelConfig(name="llama3-8b-shape", architecture="llama",
                        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
SELECTIONS = {"gather", "dynamic_slice", "slice"}
UPDATES = {"scatter", "scatter-add", "dynamic_update_slice"}


# ---------------------------------------------------------------- today's path (the baseline)

def _today_local(q, k, v, k_pool, v_pool, md, *, sm_scale):
    """The previous TPU path: gather every row's table into an interleaved copy, then JAX's
    kernel on it (the code pdtopo ran before its own kernel)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    k_pool, v_pool = attn.write_kv(k, v, k_pool, v_pool, md)
    b, npages = md.page_table.shape
    _, page_size, kvh, d = k_pool.shape
    flat = md.page_table.reshape(-1)
    kv = jnp.stack([k_pool[flat], v_pool[flat]], axis=3).reshape(b * npages, page_size,
                                                                 2 * kvh, d)
    page_indices = jnp.arange(b * npages, dtype=jnp.int32).reshape(b, npages)
    out = ragged_paged_attention(q.astype(kv.dtype), kv, md.kv_lens, page_indices, md.cu_q_lens,
                                 md.num_seqs, sm_scale=sm_scale, num_kv_pages_per_block=4,
                                 num_queries_per_block=16, vmem_limit_bytes=64 * 1024 * 1024)
    return out.astype(q.dtype), k_pool, v_pool


def _today_attention(q, k, v, k_pool, v_pool, md, *, mesh, impl, layout, block_pages,
                     sm_scale=None):
    local = partial(_today_local, sm_scale=1.0 / math.sqrt(q.shape[-1]))
    return attn.per_device(local, mesh)(q, k, v, k_pool, v_pool, md)


# ---------------------------------------------------------------- the step programs

def _step_inputs(spans, num_pages, path):
    """Chunks (tokens, context before) over distinct pages, prepared in the ragged layout:
    the new path's page tables are as wide as the longest request (engine.max_model_len 4096),
    today's were as wide as the batch's longest row, bucketed."""
    chunks, at = [], 1
    for t, s in spans:
        need = math.ceil((t + s) / PAGE_SIZE)
        chunks.append(SeqChunk([1] * t, s, list(range(at, at + need))))
        at += need
    assert at <= num_pages
    widest = max(len(c.page_ids) for c in chunks)
    max_pages = 1 << (widest - 1).bit_length() if path == "today" else 4096 // PAGE_SIZE
    geometry = StepGeometry(page_size=PAGE_SIZE, max_pages=max_pages,
                            max_rows=128, max_prefill_tokens=1024, layout_kind="ragged")
    return prepare_step(chunks, geometry), geometry, chunks


def _layer_fn(path: str, mesh, block_pages: int):
    """The engine's layer program; today's path swaps in the previous attention call."""
    attend = _today_attention if path == "today" else attn.paged_attention
    return partial(_layer, cfg=LLAMA3_8B, mesh=mesh, impl="pallas", layout="ragged",
                   block_pages=block_pages, attend=attend)


def _abstract_args(step, mesh, num_pages):
    cfg = LLAMA3_8B
    dtype = jnp.bfloat16
    specs = llama.param_specs(cfg, TP)["layers"][0]
    lp = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, specs[k]))
          for k, shape in llama.layer_param_shapes(cfg).items()}
    pool = jax.ShapeDtypeStruct((num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim), dtype,
                                sharding=NamedSharding(mesh, P(None, None, "tp", None)))
    rep = NamedSharding(mesh, P())
    t = step.tokens.shape[0]
    x = jax.ShapeDtypeStruct((t, cfg.hidden_size), dtype, sharding=rep)
    put = partial(jax.device_put, device=rep)
    md = attn.AttentionMetadata(*(abstract(put(jnp.asarray(a))) for a in step.md))
    return lp, pool, pool, x, abstract(put(jnp.asarray(step.positions))), md


# ---------------------------------------------------------------- counting

def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize


def _sub_jaxprs(eqn):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if sub is not None:
            yield getattr(sub, "jaxpr", sub)


class Counter:
    """Walks a jaxpr (and the programs it calls), tagging each value "pool" (a pool array, or
    the pool after an in-place update) or "derived" (computed from one), and adds up bytes by
    the rules of the module docstring. One tag map serves every nesting level."""

    def __init__(self, live_pages: int):
        self.live_pages = live_pages  # pages the batch's sequences occupy
        self.bytes = {"pool reads": 0, "pool writes": 0, "copies": 0, "kernel reads": 0}
        self.tags: dict = {}

    def _tag(self, v):
        return None if hasattr(v, "val") else self.tags.get(v)

    def walk(self, jaxpr) -> None:
        for eqn in jaxpr.eqns:
            tags = [self._tag(v) for v in eqn.invars]
            if not any(tags):
                continue
            name = eqn.primitive.name
            subs = list(_sub_jaxprs(eqn))
            if name == "pallas_call":
                self._kernel(eqn, tags)
            elif subs and len(subs[0].invars) == len(eqn.invars):
                inner = subs[0]
                for iv, tag in zip(inner.invars, tags, strict=True):
                    if tag:
                        self.tags[iv] = tag
                self.walk(inner)
                for ov, iv in zip(eqn.outvars, inner.outvars, strict=True):
                    if self._tag(iv):
                        self.tags[ov] = self._tag(iv)
            elif name in UPDATES and tags[0] == "pool":
                update = eqn.invars[1] if name == "dynamic_update_slice" else eqn.invars[2]
                self.bytes["pool writes"] += _nbytes(update.aval)
                self.tags[eqn.outvars[0]] = "pool"
            else:
                if name in SELECTIONS and tags[0] == "pool":
                    self.bytes["pool reads"] += _nbytes(eqn.outvars[0].aval)
                for ov in eqn.outvars:
                    self.tags[ov] = "derived"

    def _kernel(self, eqn, tags) -> None:
        for v, tag in zip(eqn.invars, tags, strict=True):
            if tag is None:
                continue
            if tag == "derived":
                self.bytes["copies"] += _nbytes(v.aval)
            _, ps, heads, d = v.aval.shape
            self.bytes["kernel reads"] += (self.live_pages * ps * heads * d
                                           * jnp.dtype(v.aval.dtype).itemsize)
        for ov in eqn.outvars:
            self.tags[ov] = "derived"


def count(fn, args, pool_positions, live_pages) -> Counter:
    closed = jax.make_jaxpr(fn)(*args)
    counter = Counter(live_pages)
    flat_positions = _flat_positions(args, pool_positions)
    for i in flat_positions:
        counter.tags[closed.jaxpr.invars[i]] = "pool"
    counter.walk(closed.jaxpr)
    return counter


def _flat_positions(args, positions) -> list[int]:
    """Indices in the flattened argument list of the top-level args at `positions`."""
    out, at = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        if i in positions:
            out.extend(range(at, at + n))
        at += n
    return out


def grid_page_reads(step, q_block: int, pages_per_block: int) -> int:
    """Pages pdtopo's kernel DMAs for `step` as its grid runs (the rule above counts each
    sequence's pages once; a long prefill chunk is re-read once per query block, and a block
    of pages is read whole): the same walk as the kernel, on the host."""
    cu, kv_lens = step.md.cu_q_lens, step.md.kv_lens
    n = int(step.md.num_seqs[0])
    rows = -(-int(cu[n]) // q_block) * q_block
    span = pages_per_block * PAGE_SIZE
    pages = 0
    for first in range(0, rows, q_block):
        for s in range(n):
            q_start, q_end = int(cu[s]), int(cu[s + 1])
            if q_start < first + q_block and q_end > first and q_end > q_start:
                top = min(q_end, first + q_block) - 1
                seen = int(kv_lens[s]) - (q_end - q_start) + (top - q_start) + 1
                pages += -(-seen // span) * pages_per_block
    return pages


def _target_tpu_v6e() -> None:
    """Lowering asks the TPU generation of the device it runs on (the CPU here has none):
    answer for the export's target, a v6e core."""
    from jax._src.pallas.mosaic import tpu_info

    tpu_info.registry.setdefault(
        "cpu", lambda: tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V6E, 1))


def exported_kernels(fn, args) -> int:
    _target_tpu_v6e()
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return exported.mlir_module().count("tpu_custom_call")


def main() -> int:
    mesh = build_mesh(TP)
    cfg = LLAMA3_8B
    steps = {
        "decode": [(1, CONTEXT - 1)] * 128,
        "mixed": [(1, CONTEXT - 1)] * 96 + [(512, 1024)],
    }
    page_bytes = PAGE_SIZE * (cfg.num_kv_heads // TP) * cfg.head_dim * 2  # bf16, one array
    result = None
    print(f"Llama-3-8B-shaped layer, tp={TP}, bf16, page_size={PAGE_SIZE}; bytes per device "
          "per layer")
    for name, spans in steps.items():
        live_pages = sum(math.ceil((t + s) / PAGE_SIZE) for t, s in spans)
        num_pages = live_pages + 1
        live = 2 * live_pages * page_bytes
        line = [f"{name:6s} step: {len(spans)} sequences, {sum(t for t, _ in spans)} tokens, "
                f"live KV {live / 2**20:.1f} MiB"]
        ratios = {}
        for path in ("today", "new"):
            step, geometry, _ = _step_inputs(spans, num_pages, path)
            args = _abstract_args(step, mesh, num_pages)
            fn = _layer_fn(path, mesh, geometry.block_pages)
            kernels = exported_kernels(fn, args)
            if kernels < 1:
                print(f"{path}: the TPU export holds no tpu_custom_call", file=sys.stderr)
                return 1
            c = count(fn, args, (1, 2), live_pages)
            total = sum(c.bytes.values())
            ratios[path] = total / live
            parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in c.bytes.items())
            line.append(f"  {path:5s}: {total / 2**20:8.1f} MiB = {ratios[path]:.2f}x live "
                        f"({parts} MiB; {kernels} tpu_custom_call)")
        grid = grid_page_reads(step, min(attn.Q_BLOCK, int(step.tokens.shape[0])),
                               geometry.block_pages)
        line.append(f"  new / today: {ratios['new'] / ratios['today']:.2f}; the new kernel's "
                    f"grid reads {grid / live_pages:.2f}x the live pages (query blocks of "
                    f"{attn.Q_BLOCK} rows re-read a long chunk's context)")
        print("\n".join(line), flush=True)
        if name == "decode":
            result = ratios["new"]
    print(f"decode step KV bytes / live KV bytes = {result:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
