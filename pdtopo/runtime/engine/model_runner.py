"""ModelRunner: the model's weights, the paged KV pool and one batched forward per engine step.

The scheduler thread owns the runner. Each step it calls `forward(chunks)` with one `SeqChunk`
per sequence: prefill chunks (many tokens), decode chunks (one token) or a mix. The runner
  1. builds the step's padded host inputs (`pdtopo.runtime.engine.step_inputs.prepare_step`): a decode
     step's shape depends on its batch bucket only, a prefill step's on its token bucket only,
     so the set of shapes is finite and small (`shape_grid`), `warmup` compiles all of it and
     steady-state serving never compiles; padded tokens write their K/V to the reserved page 0;
  2. runs the step's compiled programs (`pdtopo.runtime.engine.step_programs`: embed, one
     decoder layer executable called once per layer, head): paged attention
     (`pdtopo.runtime.engine.attention`) writes the new K/V into `kv_caches` (donated, updated in
     place); the result is float32 logits at each chunk's last token. A step that fails
     once the pool was donated leaves `kv_caches` deleted: the scheduler then ends the
     process (`pdtopo.runtime.engine.step_errors`).
A TPU kernel that Mosaic refuses at warmup sends an `auto` runner to the gather path
(`pdtopo.runtime.engine.attention_fallback`; `attention_path()` says which path serves).
KV pool format (docs/architecture.md): 2*L arrays `[num_pages, page_size, kv_heads, head_dim]`
ordered k_0, v_0, k_1, v_1, ..., sharded `P(None, None, "tp", None)`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from omegaconf import DictConfig

from pdtopo.config import tpu_kernel_budget
from pdtopo.config.pool_reserve import STAGING_COPIES
from pdtopo.config.settings import (
    EngineSettings,
    engine_settings,
    resolved_kv_memory_fraction,
)
from pdtopo.model_config.spec import ModelConfig, model_config_from_cfg
from pdtopo.runtime.engine import attention as attn
from pdtopo.runtime.engine.attention_fallback import (
    KERNEL_NAME,
    AttentionPath,
    error_detail,
    refusal_error,
    shape_text,
    short_reason,
)
from pdtopo.runtime.engine.pool_format import POOL_FORMAT
from pdtopo.runtime.engine.sampling import penalty_slots_for, sampler_memory_bytes
from pdtopo.runtime.engine.step_errors import StepFault
from pdtopo.runtime.engine.step_inputs import (
    PackedChunks,
    StepGeometry,
    StepInputs,
    bucket,
    pack_chunks,
    prepare_packed,
    prepare_step,
    shape_grid,
    warmup_steps,
)
from pdtopo.runtime.engine.step_programs import StepPrograms
from pdtopo.runtime.engine.step_transfer import StepTransfer
from pdtopo.runtime.model import llama
from pdtopo.runtime.model.loader import load_params

log = logging.getLogger(__name__)

KV_PARTITION_SPEC = P(None, None, "tp", None)


@dataclass
class SeqChunk:
    token_ids: Sequence[int]  # new tokens whose K/V are computed (and written to the pool) now
    start_pos: int            # tokens of this sequence already in the pool
    page_ids: Sequence[int]   # the sequence's page table; covers start_pos + len(token_ids)


# What a server of each role compiles ahead of serving: P only prefills, D only decodes (its
# rare local prefills — /health_generate, recompute after preemption — compile on first use).
# Every process of a multi-process instance must warm up the same way (lockstep SPMD).
WARMUP_BY_ROLE: dict[str, dict[str, bool]] = {
    "prefill": {"decode": False},
    "decode": {"prefill": False},
}


def warmup_kinds(role: str) -> dict[str, bool]:
    return dict(WARMUP_BY_ROLE.get(role, {}))


def tightest_memory(per_device: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One device's worth of memory that every device has: the smallest limit and the smallest
    free memory (as `bytes_in_use` of that limit); None when any device keeps no statistics."""
    if not per_device or any(not s or "bytes_limit" not in s for s in per_device):
        return None
    limit = min(int(s["bytes_limit"]) for s in per_device)
    free = min(int(s["bytes_limit"]) - int(s.get("bytes_in_use", 0)) for s in per_device)
    return {"bytes_limit": limit, "bytes_in_use": limit - free}


def _host_inputs(step: StepInputs) -> tuple:
    """What the step programs take besides weights and pool, in their order."""
    return (step.tokens, step.positions, step.md, step.last_idx)


class ModelRunner:
    """Weights + paged KV pool + bucketed, jitted batched forward (see module docstring)."""

    def __init__(self, model_cfg: DictConfig, engine: EngineSettings | DictConfig, mesh: Mesh,
                 reserve_pages: int = 0):
        """`reserve_pages`: pages' worth of device memory to leave out of a pool sized by
        `engine.kv_memory_fraction` (`reserved_pages`: P's held KV copies)."""
        engine = engine_settings(engine)  # a config node is typed and checked here
        self.reserve_pages = int(reserve_pages)
        # the checkpoint's config; `config` is what runs (KV heads repeated when fewer than tp)
        self.model_config: ModelConfig = model_config_from_cfg(model_cfg)
        self.mesh = mesh
        if "tp" not in mesh.shape:
            raise ValueError(f"mesh axes {tuple(mesh.shape)} lack the 'tp' axis (build_mesh)")
        self.tp = int(mesh.shape["tp"])
        llama.check_tp(self.model_config, self.tp)
        self.kv_replication = llama.kv_replication(self.model_config, self.tp)
        self.config: ModelConfig = llama.serving_config(self.model_config, self.tp)
        self.dtype = llama.resolve_dtype(engine.dtype)
        self.kv_dtype = llama.resolve_dtype(engine.kv_dtype, "engine.kv_dtype")
        self.page_size = engine.page_size
        self.max_model_len = engine.max_model_len
        self.max_running_requests = engine.max_running_requests
        self.max_prefill_tokens = engine.max_prefill_tokens
        self.max_pages_per_seq = math.ceil(self.max_model_len / self.page_size)
        self.requested_attention_impl = str(engine.attention_impl)
        self.attention_impl = attn.resolve_impl(engine.attention_impl, self.config.head_dim)
        self.attention_fallback: str | None = None  # why auto left the kernel
        self._sized_step_bytes: int | None = None  # step buffers a memory-sized pool left room for
        if self.attention_impl in attn.KERNEL_IMPLS:  # the checkpoint's shapes, this tp
            for _, _, why in tpu_kernel_budget.problems(
                    engine, self.config.num_kv_heads, self.config.num_heads,
                    self.config.head_dim, self.tp):
                raise ValueError(why)

        self.params = self._load_params()
        self.kv_sharding = NamedSharding(mesh, KV_PARTITION_SPEC)
        self.geometry = StepGeometry(
            page_size=self.page_size, max_pages=self.max_pages_per_seq,
            max_rows=bucket(self.max_running_requests),
            max_prefill_tokens=self.max_prefill_tokens, mixed=bool(engine.mixed_steps),
            layout_kind="ragged" if self.attention_impl in attn.KERNEL_IMPLS else "paged",
            kernel_shape=self.kernel_shape())
        self._replicated = NamedSharding(mesh, P())
        self._transfer = StepTransfer(self._replicated)
        self._programs = self._step_programs()
        self.num_pages = self._num_pages(engine)
        self.kv_caches: list[jax.Array] = self._allocate_pool()
        self._lock = threading.Lock()  # forward is single-owner; the lock guards misuse
        self._warmed = False  # after warmup, compiling a new shape is worth a warning
        self.step_fault = StepFault()  # testing: arm_step_fault
        log.info("ModelRunner: %s tp=%d dtype=%s kv_dtype=%s pages=%d x %d attention=%s%s",
                 self.config.name, self.tp, self.dtype, self.kv_dtype, self.num_pages,
                 self.page_size, self.attention_impl,
                 f" (each of {self.model_config.num_kv_heads} KV heads on "
                 f"{self.kv_replication} devices)" if self.kv_replication > 1 else "")

    # ------------------------------------------------------------------ setup

    def kernel_shape(self) -> tuple:
        """One device's (q dtype, kv dtype, heads, kv heads, head_dim): the TPU kernel's block
        table key (pdtopo.config.attention_blocks)."""
        cfg = self.config
        return (str(jnp.dtype(self.dtype)), str(jnp.dtype(self.kv_dtype)),
                cfg.num_heads // self.tp, cfg.num_kv_heads // self.tp, cfg.head_dim)

    def _load_params(self) -> llama.Params:
        if self.model_config.path:
            return load_params(self.model_config, self.mesh, self.dtype)
        host = llama.replicate_kv_heads(llama.init_params_numpy(self.model_config),
                                        self.model_config, self.kv_replication)
        return llama.place_params(host, self.config, self.mesh, self.dtype)

    def page_bytes_per_device(self) -> int:
        """Bytes one page takes on one device, over all 2*L pool arrays."""
        cfg = self.config
        per = self.page_size * (cfg.num_kv_heads // self.tp) * cfg.head_dim
        return 2 * cfg.num_layers * per * jnp.dtype(self.kv_dtype).itemsize

    def _num_pages(self, engine: EngineSettings) -> int:
        platform = self.mesh.devices.flat[0].platform
        fraction = resolved_kv_memory_fraction(engine.kv_memory_fraction, platform)
        if fraction is None:
            n = engine.num_pages
        else:
            stats = self._memory_stats()
            if not stats or "bytes_limit" not in stats:
                raise ValueError(
                    f"engine.kv_memory_fraction={fraction} needs device memory statistics, "
                    f"which the {jax.default_backend()} backend does not provide: set "
                    f"engine.kv_memory_fraction=null and engine.num_pages instead")
            limit = int(stats["bytes_limit"])
            free = limit - int(stats.get("bytes_in_use", 0))
            step, sampler = self.step_memory_bytes(), self.sampler_memory_bytes()
            self._sized_step_bytes = step
            budget = min(fraction * limit, 0.95 * free) - step - sampler
            n = int(budget // self.page_bytes_per_device()) - self.reserve_pages
            log.info("KV pool sized from device memory: limit %.2f GiB, free %.2f GiB, the "
                     "largest step's own buffers %.1f MiB, the sampler's %.1f MiB -> %d pages",
                     limit / 2**30, free / 2**30, step / 2**20, sampler / 2**20, n)
            if n < 2 and self.reserve_pages:
                raise ValueError(
                    f"engine.kv_memory_fraction={fraction} leaves room for "
                    f"{n + self.reserve_pages} KV pages, and {self.reserve_pages} of them "
                    "are kept for P's KV copies (disaggregation.max_held_kv_pages of them "
                    "in device memory; with disaggregation.d2h_staging only their packing: "
                    f"{STAGING_COPIES} prompts of engine.max_model_len): lower that setting or "
                    "raise engine.kv_memory_fraction")
            if self.reserve_pages:
                log.info("KV pool: %d pages; %d pages' worth of memory kept for P's KV copies "
                         "(reserved_pages)", n, self.reserve_pages)
        if n < 2:
            raise ValueError(f"engine.num_pages={n}: the pool needs at least 2 pages "
                             "(page 0 is reserved padding)")
        return n

    def _step_programs(self) -> StepPrograms:
        return StepPrograms(self.config, self.mesh, self.attention_impl,
                            self.geometry.block_pages, self.kv_sharding)

    def attention_path(self) -> AttentionPath:
        """The attention this runner serves with, as asked for, and why auto fell back."""
        return AttentionPath(self.attention_impl, self.requested_attention_impl,
                             self.attention_fallback)

    def _kernel_refused(self, key: tuple, exc: Exception) -> None:
        """Compiling (or first running) kernel step shape `key` raised `exc`: with
        engine.attention_impl=auto switch to the gather path (paged layouts, new programs;
        the caller compiles again), else fail the start (attention_fallback.py)."""
        if self.requested_attention_impl != "auto":
            raise refusal_error(self.requested_attention_impl, key, exc) from exc
        log.error("attention: the TPU kernel %r (%s) failed to compile for step shape %s: %s; "
                  "serving with the gather path instead (engine.attention_impl=auto)",
                  KERNEL_NAME, self.attention_impl, shape_text(key), error_detail(exc))
        self.attention_impl = "gather"
        self.attention_fallback = short_reason(exc)
        self.geometry = replace(self.geometry, layout_kind="paged")
        self._programs = self._step_programs()
        self._transfer = StepTransfer(self._replicated)  # drop the ragged keys' unpacking
        pool = getattr(self, "kv_caches", None)
        if pool is None:
            return  # refused while sizing the pool: it is sized for the gather path
        if any(a.is_deleted() for a in pool):  # a first run failed after taking the pool
            for a in pool:
                if not a.is_deleted():
                    a.delete()
            self.kv_caches = self._allocate_pool()  # warmup: nothing in it yet
        if self._sized_step_bytes is not None:
            need = self.step_memory_bytes()
            if need > self._sized_step_bytes:
                log.warning("attention: the KV pool was sized for the kernel's largest step "
                            "(%.1f MiB of step buffers); the gather path's needs %.1f MiB: "
                            "lower engine.kv_memory_fraction if steps run out of memory",
                            self._sized_step_bytes / 2**20, need / 2**20)

    def _memory_stats(self) -> dict[str, Any] | None:
        """The tightest memory statistics over this process's devices of the mesh: the
        smallest limit and the smallest free memory (None where the backend keeps none)."""
        return tightest_memory([d.memory_stats() for d in self.mesh.devices.flat
                                if d.process_index == jax.process_index()])

    def step_memory_bytes(self) -> int:
        """Device bytes the largest step needs beside the pool and the weights: the compiled
        layer and head programs' temporaries and outputs (XLA's memory analysis of the
        largest token bucket, compiled against a 2-page pool: the step's own buffers do not
        depend on the pool's size; sizing after warmup would be circular)."""
        step = max(warmup_steps(self.geometry), key=lambda st: st.tokens.shape[0])
        pool = jax.ShapeDtypeStruct((2, self.page_size, self.config.num_kv_heads,
                                     self.config.head_dim), self.kv_dtype,
                                    sharding=self.kv_sharding)
        try:
            return self._programs.memory_bytes(step.key, self.params, pool,
                                               *self._abstract_inputs(step))
        except Exception as exc:  # the kernel's first compile: Mosaic may refuse it
            if self.attention_impl not in attn.KERNEL_IMPLS:
                raise
            self._kernel_refused(step.key, exc)
            return self.step_memory_bytes()  # the gather path's

    def sampling_row_counts(self) -> set[int]:
        """Every row count of the padded logits the scheduler samples from: the largest batch
        bucket and those of 1, 2, 4, ... one-token chunks up to twice the running cap."""
        chunk = SeqChunk([0], 0, [1])
        rows, n = {self.geometry.max_rows}, 1
        while n < 2 * self.max_running_requests:
            rows.add(self.logits_rows([chunk] * n))
            n *= 2
        return rows

    def sampler_memory_bytes(self) -> int:
        """Device bytes the scheduler's sampler needs per device (its penalty tables and the
        full sampling program at the largest row count: `sampling.sampler_memory_bytes`)."""
        return sampler_memory_bytes(max(self.sampling_row_counts()), self.config.vocab_size,
                                    self._replicated,
                                    penalty_slots_for(self.max_running_requests))

    def _allocate_pool(self) -> list[jax.Array]:
        cfg = self.config
        shape = (self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=self.kv_sharding)
        return [make() for _ in range(2 * cfg.num_layers)]

    # ------------------------------------------------------------------ info

    def kv_layout(self) -> dict[str, Any]:
        """What P and D must agree on to exchange KV pages (compared key by key)."""
        cfg = self.config
        order = [int(d.process_index) for d in self.mesh.devices.flat]
        procs = sorted(set(order))
        return {
            "pool_format": POOL_FORMAT,
            "num_entries": 2 * cfg.num_layers,
            "page_size": self.page_size,
            "kv_heads": cfg.num_kv_heads,              # in the pool (replicas included)
            "model_kv_heads": self.model_config.num_kv_heads,
            "head_dim": cfg.head_dim,
            "dtype": str(jnp.dtype(self.kv_dtype)),
            "partition_spec": [None, None, "tp", None],
            "tp": self.tp,
            # processes the mesh spans, and which one holds each shard along heads: equal
            # layouts pair D process r with P process r; others are resharded on the way
            # (pdtopo.runtime.disagg.reshard.layout)
            "num_processes": len(procs),
            "shard_processes": [procs.index(p) for p in order],
        }  # num_pages is left out on purpose: P and D pools may differ in size

    def compile_count(self) -> int:
        """Distinct bucketed step shapes compiled so far (warmup's and any compiled later)."""
        return self._programs.compiled_shapes

    def compiled_keys(self) -> set[tuple]:
        """The step shapes (StepKeys) compiled so far."""
        return self._programs.keys()

    # ------------------------------------------------------------------ forward

    def _validate(self, chunks: Sequence[SeqChunk]) -> PackedChunks:
        """The chunks packed (`pack_chunks`), or ValueError naming the first bad chunk."""
        if not chunks:
            raise ValueError("forward: chunks is empty")
        packed = pack_chunks(chunks, self.page_size)
        vocab = self.config.vocab_size

        def owner(flat_index: int, counts: np.ndarray) -> int:  # the chunk of a flat entry
            return int(np.searchsorted(np.cumsum(counts), flat_index, side="right"))

        if (packed.lens == 0).any():
            i = int(np.argmax(packed.lens == 0))
            raise ValueError(f"chunk {i}: token_ids must be a non-empty 1-D sequence")
        bad = (packed.tokens < 0) | (packed.tokens >= vocab)
        if bad.any():
            i = owner(int(np.argmax(bad)), packed.lens)
            start = int(packed.lens[:i].sum())
            ids = packed.tokens[start:start + packed.lens[i]]
            raise ValueError(f"chunk {i}: token id out of range [0, {vocab}): "
                             f"min {ids.min()}, max {ids.max()}")
        if (packed.starts < 0).any():
            i = int(np.argmax(packed.starts < 0))
            raise ValueError(f"chunk {i}: start_pos={packed.starts[i]} must be >= 0")
        if (packed.have < packed.need).any():
            i = int(np.argmax(packed.have < packed.need))
            raise ValueError(
                f"chunk {i}: page_ids has {packed.have[i]} pages but start_pos "
                f"{packed.starts[i]} + {packed.lens[i]} tokens need {packed.need[i]} "
                f"(page_size {self.page_size})")
        bad = (packed.pages < 1) | (packed.pages >= self.num_pages)
        if bad.any():
            i = owner(int(np.argmax(bad)), packed.listed)
            pages = packed.pages[packed.page_offsets[i]:][:packed.listed[i]]
            raise ValueError(f"chunk {i}: page ids must be in [1, {self.num_pages}) "
                             f"(page 0 is reserved), got {pages.tolist()}")
        return packed

    def _device_inputs(self, step: StepInputs, feed: tuple | None = None) -> tuple:
        """The step's host arrays on the devices, in one transfer (`StepTransfer`); `feed`:
        (previous tokens on the device, the row each of this step's one-token chunks takes)."""
        if feed is None:
            return self._transfer.put(step.key, _host_inputs(step))
        prev, rows = feed
        src = np.full(step.tokens.shape[0], -1, np.int32)
        src[:len(rows)] = rows
        return self._transfer.put(step.key, _host_inputs(step), (prev, src))

    def _abstract_inputs(self, step: StepInputs) -> tuple:
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._replicated),
            _host_inputs(step))

    def _run(self, step: StepInputs, feed: tuple | None = None) -> jax.Array:
        inputs = self._device_inputs(step, feed)
        with self._lock:
            if self._warmed and not self._programs.has(step.key):
                log.warning("compiling step shape %s while serving: not warmed (a kind of "
                            "step this role's warmup skips, or a batch larger than the engine "
                            "settings allow)", "/".join(str(k) for k in step.key[:3]))
            logits, pool = self._programs.run(step.key, self.params, self.kv_caches, *inputs)
            self.step_fault.tick()  # testing: raises here, the pool donated and not taken back
            self.kv_caches = pool
        return logits

    def arm_step_fault(self, after: int | None) -> None:
        """Testing (`engine.fault_inject_step_error_after`): the `after`-th step from now fails
        after its programs were given the pool (`step_errors.StepFault`)."""
        self.step_fault = StepFault(after)

    # forward(..., feed=) is served by this runner (a multi-process leader's is not)
    supports_feed = True

    def forward(self, chunks: list[SeqChunk], padded: bool = False,
                feed: tuple[jax.Array, Sequence[int]] | None = None) -> jax.Array:
        """Logits (float32) at each chunk's last token: [len(chunks), vocab], or with
        `padded` the step's whole bucket of rows (row i is chunk i; extra rows are padding),
        which saves a slicing program per batch size. Writes the chunks' K/V into
        `self.kv_caches`. `feed` = (tokens, rows): one-token chunks whose token is still on
        the device, chunk i's being `tokens[rows[i]]` (their `token_ids` are placeholders;
        rows[i] < 0: chunk i's own token)
        On a mesh spanning several processes every process must call forward with the same
        chunks (lockstep) and gets its local copy of the logits."""
        logits = self._run(prepare_packed(self._validate(chunks), self.geometry), feed)
        if not logits.is_fully_addressable:
            # multi-process mesh: logits are replicated; sample from this process's copy
            logits = logits.addressable_data(0)
        return logits if padded else logits[: len(chunks)]

    def logits_rows(self, chunks: list[SeqChunk]) -> int:
        """Rows of the padded logits `forward(chunks, padded=True)` returns (nothing runs)."""
        return int(prepare_step(chunks, self.geometry).last_idx.shape[0])

    def warmup_feeds(self) -> int:
        """Compile the fed unpacking of every one-token step shape, from every row count of
        previous tokens (overlap scheduling: a decode step's, or a prefill or mixed step's,
        whose rows in the ragged layout can be fewer than the next step's sequences: that step
        also carries the running requests the prefill step did not); returns how many."""
        if not self.geometry.decode_layout and self.geometry.layout_kind != "ragged":
            return 0
        steps = [s for s in warmup_steps(self.geometry, decode=True, prefill=False)
                 if int(s.md.num_seqs[0]) == s.tokens.shape[0]]  # all one-token chunks
        rows = sorted({int(s.last_idx.shape[0]) for s in steps})
        n = 0
        with self._lock:
            for step in steps:
                for r in rows:
                    self._transfer.compile(step.key, _host_inputs(step), feed_rows=r)
                    n += 1
        return n

    def shape_grid(self, decode: bool = True, prefill: bool = True) -> set[tuple]:
        """The step shapes `warmup(decode, prefill)` compiles (see step_inputs.shape_grid)."""
        return shape_grid(self.geometry, decode, prefill)

    def warmup(self, decode: bool = True, prefill: bool = True) -> None:
        """Compile every step shape the scheduler can produce: decode at every batch bucket up
        to max_running_requests, prefill at every token bucket up to max_prefill_tokens; a
        role that never runs one kind skips it (`WARMUP_BY_ROLE`). Shapes compile from their
        inputs' shapes alone; the smallest shape of each layout also runs once (on the
        reserved page 0 only), so the whole step path is exercised before serving. Without
        decode shapes every later batch runs in the flat layout (`StepGeometry.decode_layout`),
        so one-token chunks (a prompt cached but for its last token) compile nothing either.
        A kernel step shape that fails to compile or run (Mosaic's refusal) switches an
        engine.attention_impl=auto runner to the gather path, whose shapes are then warmed
        up instead; the kernel asked for by name fails the start (`_kernel_refused`)."""
        if not decode:
            self.geometry = replace(self.geometry, decode_layout=False)
        steps = warmup_steps(self.geometry, decode, prefill)
        t0 = time.perf_counter()
        for n, step in enumerate(steps, 1):
            try:
                with self._lock:
                    took = self._programs.compile(step.key, self.params, self.kv_caches,
                                                  *self._abstract_inputs(step))
                    self._transfer.compile(step.key, _host_inputs(step))
            except Exception as exc:  # Mosaic may refuse the kernel for any shape
                if self.attention_impl not in attn.KERNEL_IMPLS:
                    raise
                self._kernel_refused(step.key, exc)
                return self.warmup(decode, prefill)  # the gather path's shapes
            log.info("compiled step shape %d/%d %s in %.2fs", n, len(steps),
                     "/".join(str(k) for k in step.key[:3]), took)
        ran: set[str] = set()
        for step in steps:
            if step.key[0] not in ran:  # the first of each layout is its smallest
                ran.add(step.key[0])
                try:
                    jax.block_until_ready(self._run(step))
                except Exception as exc:
                    if self.attention_impl not in attn.KERNEL_IMPLS:
                        raise
                    self._kernel_refused(step.key, exc)
                    return self.warmup(decode, prefill)
        log.info("warmup: %d step shapes compiled, %d run, in %.1fs", len(steps), len(ran),
                 time.perf_counter() - t0)
        self._warmed = True
