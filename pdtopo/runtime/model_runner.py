"""ModelRunner: the model's weights, the paged KV pool and one batched forward per engine step.

The scheduler thread owns the runner. Each step it calls `forward(chunks)` with one `SeqChunk`
per sequence: prefill chunks (many tokens), decode chunks (one token) or a mix. The runner
  1. flattens the chunks into one token array and builds the paging metadata on the host with
     NumPy (`_prepare`): every shape is padded to a power-of-two bucket (tokens T, sequences B,
     longest chunk Q, pages per sequence P) so steady-state serving reuses compiled programs;
     padded tokens write their K/V to the reserved page 0 and padded sequences have length 0;
  2. runs one jitted step (`_step`): decoder forward with paged attention
     (`pdtopo.runtime.attention`), writing the new K/V into `kv_caches` (donated, updated in
     place) and returning float32 logits at each chunk's last token.
KV pool format (docs/architecture.md): 2*L arrays `[num_pages, page_size, kv_heads, head_dim]`
ordered k_0, v_0, k_1, v_1, ..., sharded `P(None, None, "tp", None)`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from omegaconf import DictConfig, OmegaConf

from pdtopo.runtime import attention as attn
from pdtopo.runtime.model import llama
from pdtopo.runtime.model.config import ModelConfig, model_config_from_cfg

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


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def _engine_get(engine_cfg: Any, key: str, default: Any) -> Any:
    value = engine_cfg.get(key, default) if engine_cfg is not None else default
    return default if value is None else value


class ModelRunner:
    """Weights + paged KV pool + bucketed, jitted batched forward (see module docstring)."""

    def __init__(self, model_cfg: DictConfig, engine_cfg: DictConfig, mesh: Mesh):
        if isinstance(engine_cfg, dict):
            engine_cfg = OmegaConf.create(engine_cfg)
        self.config: ModelConfig = model_config_from_cfg(model_cfg)
        self.mesh = mesh
        if "tp" not in mesh.shape:
            raise ValueError(f"mesh axes {tuple(mesh.shape)} lack the 'tp' axis (build_mesh)")
        self.tp = int(mesh.shape["tp"])
        llama.check_tp(self.config, self.tp)
        self.dtype = llama.resolve_dtype(_engine_get(engine_cfg, "dtype", "float32"))
        self.kv_dtype = llama.resolve_dtype(
            _engine_get(engine_cfg, "kv_dtype", str(self.dtype)), "engine.kv_dtype")
        self.page_size = int(_engine_get(engine_cfg, "page_size", 16))
        if self.page_size < 1:
            raise ValueError(f"engine.page_size={self.page_size} must be >= 1")
        self.max_model_len = int(_engine_get(engine_cfg, "max_model_len", 1024))
        self.max_running_requests = int(_engine_get(engine_cfg, "max_running_requests", 32))
        self.max_prefill_tokens = int(_engine_get(engine_cfg, "max_prefill_tokens", 1024))
        self.max_pages_per_seq = math.ceil(self.max_model_len / self.page_size)
        self.attention_impl = attn.resolve_impl(
            str(_engine_get(engine_cfg, "attention_impl", "auto")), self.config.head_dim)

        self.params = self._load_params()
        self.num_pages = self._num_pages(engine_cfg)
        self.kv_sharding = NamedSharding(mesh, KV_PARTITION_SPEC)
        self.kv_caches: list[jax.Array] = self._allocate_pool()

        self._replicated = NamedSharding(mesh, P())
        self._step = jax.jit(
            partial(_step, cfg=self.config, mesh=mesh, impl=self.attention_impl),
            donate_argnums=(1,),
            out_shardings=(self._replicated, [self.kv_sharding] * len(self.kv_caches)),
        )
        self._shapes: set[tuple[int, int, int, int]] = set()
        self._lock = threading.Lock()  # forward is single-owner; the lock guards misuse
        log.info("ModelRunner: %s tp=%d dtype=%s kv_dtype=%s pages=%d x %d attention=%s",
                 self.config.name, self.tp, self.dtype, self.kv_dtype, self.num_pages,
                 self.page_size, self.attention_impl)

    # ------------------------------------------------------------------ setup

    def _load_params(self) -> llama.Params:
        if self.config.path:
            from pdtopo.runtime.model.loader import load_params

            return load_params(self.config, self.mesh, self.dtype)
        host = llama.init_params_numpy(self.config)
        return llama.place_params(host, self.config, self.mesh, self.dtype)

    def page_bytes_per_device(self) -> int:
        """Bytes one page takes on one device, over all 2*L pool arrays."""
        cfg = self.config
        per = self.page_size * (cfg.num_kv_heads // self.tp) * cfg.head_dim
        return 2 * cfg.num_layers * per * jnp.dtype(self.kv_dtype).itemsize

    def _num_pages(self, engine_cfg: Any) -> int:
        fraction = _engine_get(engine_cfg, "kv_memory_fraction", None)
        if fraction is None:
            n = int(_engine_get(engine_cfg, "num_pages", 512))
        else:
            fraction = float(fraction)
            if not 0.0 < fraction < 1.0:
                raise ValueError(f"engine.kv_memory_fraction={fraction} must be in (0, 1)")
            stats = self.mesh.devices.flat[0].memory_stats()
            if not stats or "bytes_limit" not in stats:
                raise ValueError(
                    f"engine.kv_memory_fraction={fraction} needs device memory statistics, "
                    f"which the {jax.default_backend()} backend does not provide: set "
                    f"engine.kv_memory_fraction=null and engine.num_pages instead")
            limit = int(stats["bytes_limit"])
            free = limit - int(stats.get("bytes_in_use", 0))
            budget = min(fraction * limit, 0.95 * free)
            n = int(budget // self.page_bytes_per_device())
        if n < 2:
            raise ValueError(f"engine.num_pages={n}: the pool needs at least 2 pages "
                             "(page 0 is reserved padding)")
        return n

    def _allocate_pool(self) -> list[jax.Array]:
        cfg = self.config
        shape = (self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=self.kv_sharding)
        return [make() for _ in range(2 * cfg.num_layers)]

    # ------------------------------------------------------------------ info

    def kv_layout(self) -> dict[str, Any]:
        """What P and D must agree on to exchange KV pages (compared key by key)."""
        cfg = self.config
        return {
            "num_entries": 2 * cfg.num_layers,
            "page_size": self.page_size,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "dtype": str(jnp.dtype(self.kv_dtype)),
            "partition_spec": [None, None, "tp", None],
            "tp": self.tp,
            # processes the mesh spans: D process r pulls from P process r (N:N pairing), so
            # P and D must be split alike
            "num_processes": len({int(d.process_index) for d in self.mesh.devices.flat}),
        }  # num_pages is left out on purpose: P and D pools may differ in size

    def compile_count(self) -> int:
        """Distinct bucketed shapes the step function has been compiled for."""
        return len(self._shapes)

    # ------------------------------------------------------------------ forward

    def _validate(self, chunks: Sequence[SeqChunk]) -> None:
        if not chunks:
            raise ValueError("forward: chunks is empty")
        vocab = self.config.vocab_size
        for i, c in enumerate(chunks):
            ids = np.asarray(c.token_ids)
            if ids.ndim != 1 or ids.size == 0:
                raise ValueError(f"chunk {i}: token_ids must be a non-empty 1-D sequence")
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"chunk {i}: token id out of range [0, {vocab}): "
                                 f"min {ids.min()}, max {ids.max()}")
            if c.start_pos < 0:
                raise ValueError(f"chunk {i}: start_pos={c.start_pos} must be >= 0")
            need = math.ceil((c.start_pos + ids.size) / self.page_size)
            pages = np.asarray(c.page_ids, dtype=np.int64)[:need]
            if pages.size < need:
                raise ValueError(
                    f"chunk {i}: page_ids has {len(c.page_ids)} pages but start_pos "
                    f"{c.start_pos} + {ids.size} tokens need {need} (page_size {self.page_size})")
            if pages.size and (pages.min() < 1 or pages.max() >= self.num_pages):
                raise ValueError(f"chunk {i}: page ids must be in [1, {self.num_pages}) "
                                 f"(page 0 is reserved), got {pages.tolist()}")

    def _prepare(self, chunks: Sequence[SeqChunk]) -> tuple[tuple[int, ...], dict[str, Any]]:
        """Host-side (NumPy) padded inputs of one step; returns (bucket key, arrays)."""
        ps = self.page_size
        n = len(chunks)
        lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
        starts = np.array([c.start_pos for c in chunks], dtype=np.int32)
        need = -(-(starts + lens) // ps)
        total = int(lens.sum())
        tb, bb = bucket(total), bucket(n)
        qb, pb = bucket(int(lens.max())), bucket(int(need.max()))

        cu = np.zeros(bb + 1, dtype=np.int32)
        cu[1:n + 1] = np.cumsum(lens)
        cu[n + 1:] = total
        tok_seq = np.zeros(tb, dtype=np.int32)
        tok_seq[:total] = np.repeat(np.arange(n, dtype=np.int32), lens)
        tok_qidx = np.zeros(tb, dtype=np.int32)
        tok_qidx[:total] = np.arange(total, dtype=np.int32) - cu[tok_seq[:total]]
        tokens = np.zeros(tb, dtype=np.int32)
        tokens[:total] = np.concatenate([np.asarray(c.token_ids, dtype=np.int32) for c in chunks])
        positions = np.zeros(tb, dtype=np.int32)
        positions[:total] = starts[tok_seq[:total]] + tok_qidx[:total]

        page_table = np.zeros((bb, pb), dtype=np.int32)
        for i, c in enumerate(chunks):
            page_table[i, :need[i]] = np.asarray(c.page_ids[:need[i]], dtype=np.int32)
        slot_pages = np.zeros(tb, dtype=np.int32)
        slot_pages[:total] = page_table[tok_seq[:total], positions[:total] // ps]
        slot_offsets = np.zeros(tb, dtype=np.int32)
        slot_offsets[:total] = positions[:total] % ps

        kv_lens = np.zeros(bb, dtype=np.int32)
        kv_lens[:n] = starts + lens
        q_starts = np.zeros(bb, dtype=np.int32)
        q_starts[:n] = starts
        j = np.arange(qb, dtype=np.int32)[None, :]
        seq_tok_idx = np.where(j < np.pad(lens, (0, bb - n))[:, None], cu[:-1, None] + j, 0)
        last_idx = np.zeros(bb, dtype=np.int32)
        last_idx[:n] = cu[1:n + 1] - 1

        md = attn.AttentionMetadata(
            slot_pages=slot_pages, slot_offsets=slot_offsets, page_table=page_table,
            kv_lens=kv_lens, q_starts=q_starts, cu_q_lens=cu,
            seq_tok_idx=seq_tok_idx.astype(np.int32), tok_seq=tok_seq, tok_qidx=tok_qidx,
            num_seqs=np.array([n], dtype=np.int32))
        return (tb, bb, qb, pb), {"tokens": tokens, "positions": positions, "md": md,
                                  "last_idx": last_idx}

    def _run(self, key: tuple[int, ...], arrays: dict[str, Any]) -> jax.Array:
        put = partial(jax.device_put, device=self._replicated)
        arrays = jax.tree.map(put, arrays)
        with self._lock:
            logits, self.kv_caches = self._step(
                self.params, self.kv_caches, arrays["tokens"], arrays["positions"],
                arrays["md"], arrays["last_idx"])
            self._shapes.add(key)
        return logits

    def forward(self, chunks: list[SeqChunk]) -> jax.Array:
        """Logits [len(chunks), vocab] (float32) at each chunk's last token; writes the chunks'
        K/V into `self.kv_caches`. On a mesh spanning several processes every process must
        call forward with the same chunks (lockstep) and gets its local copy of the logits."""
        self._validate(chunks)
        key, arrays = self._prepare(chunks)
        logits = self._run(key, arrays)
        if not logits.is_fully_addressable:
            # multi-process mesh: logits are replicated; sample from this process's copy
            logits = logits.addressable_data(0)
        return logits[: len(chunks)]

    def warmup(self, decode: bool = True, prefill: bool = True) -> None:
        """Compile the common buckets: decode at every batch bucket up to max_running_requests
        (short contexts), and single-sequence prefill at every token bucket up to
        max_prefill_tokens; a role that never runs one kind skips it (`WARMUP_BY_ROLE`).
        Warmup steps only write the reserved page 0."""
        shapes: list[tuple[int, int]] = []  # (batch, tokens per sequence)
        b = 1
        while decode and b <= bucket(self.max_running_requests):
            shapes.append((b, 1))
            b *= 2
        t = 2
        while prefill and t <= bucket(self.max_prefill_tokens):
            shapes.append((1, t))
            t *= 2
        for nseq, ntok in shapes:
            if math.ceil(ntok / self.page_size) > self.max_pages_per_seq:
                continue
            chunks = [SeqChunk([0] * ntok, 0, [0] * math.ceil(ntok / self.page_size))
                      for _ in range(nseq)]
            key, arrays = self._prepare(chunks)  # page 0 only: no pool page is touched
            jax.block_until_ready(self._run(key, arrays))


def _step(params, kv_caches, tokens, positions, md, last_idx, *, cfg: ModelConfig,
          mesh: Mesh, impl: str):
    caches = list(kv_caches)

    def attention(layer: int, q, k, v):
        out, caches[2 * layer], caches[2 * layer + 1] = attn.paged_attention(
            q, k, v, caches[2 * layer], caches[2 * layer + 1], md, mesh=mesh, impl=impl)
        return out

    hidden = llama.forward_hidden(params, cfg, tokens, positions, attention)
    logits = llama.compute_logits(params, cfg, hidden[last_idx])
    return logits, caches
