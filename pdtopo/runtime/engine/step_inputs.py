"""Host-side inputs of one engine step, and the finite set of shapes they can take.

ModelRunner.forward(chunks) -> `prepare_step(chunks, geometry)` -> (StepKey, arrays) -> one
jitted step per StepKey. Everything here is NumPy and pure: no JAX, no I/O.

The goal is a closed shape set: a server compiles every StepKey its scheduler can produce during
warmup (`shape_grid`) and never compiles while serving. Three layouts:

  decode  every chunk is one token (a running batch). Token i belongs to sequence i; each
          sequence's page table is padded to the longest a request may have
          (`StepGeometry.decode_pages`), so the key depends on the batch bucket alone.
  flat    anything else (prefill batches, mixed batches). Tokens are flat; the context pages of
          every sequence in the batch are listed one after another (`ctx_pages`, with their owner
          sequence and first position), each sequence starting on a block boundary, padded to a
          fixed length (`StepGeometry.flat_pages`); the key depends on the token bucket alone.
  ragged  the TPU ragged paged-attention kernel's inputs (per-sequence page tables as wide as
          the decode layout's, cumulative query lengths); the key depends on the token bucket
          alone (rows: min(max_rows, tokens), since a step has no more sequences than tokens),
          so its grid is one shape per token bucket up to max(max_rows, max_prefill_tokens).

Attention (pdtopo.runtime.engine.attention) walks the context block by block (`block_pages` pages per
block) with an online softmax, only as far as the data goes, so padded tables cost nothing but a
few int32s: a decode step visits `num_blocks` blocks for the whole batch; a flat step runs a
list of work items (the `work` array, rows `WORK_FIELDS`: one tile of `tile_tokens` query rows of one
sequence against one block of that sequence's context, blocks entirely after the tile's last
position skipped), so batching short prompts costs what they need, not tokens x all contexts.
A sequence's blocks and query tiles start at its own first page and first token in both
layouts, so a token sees the same blocks in the same order whatever else is in the batch.

Inputs a layout does not read get small fixed-shape placeholders, so they never change a key.
A batch larger than the geometry (not produced by the scheduler: e.g. a request longer than
engine.max_model_len) falls back to a bigger bucket: correct, at the cost of one compilation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from pdtopo.config.attention_blocks import KernelBlocks, block_counts, blocks_for
from pdtopo.config.tpu_kernel_budget import TABLE_BLOCK_TOKENS

# context tokens the gather path reads per block (a block holds
# max(1, CONTEXT_BLOCK_TOKENS // page_size) pages); ragged page tables are as wide as the
# longest request in whole blocks of this size too (the kernel's SMEM budget counts them so)
CONTEXT_BLOCK_TOKENS = TABLE_BLOCK_TOKENS

LAYOUTS = ("decode", "flat", "ragged")


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


class AttentionMetadata(NamedTuple):
    """Per-step metadata (int32, replicated). T flat tokens; see the module docstring."""

    slot_pages: Any    # [T] pool page written by each token (0, the reserved page, for padding)
    slot_offsets: Any  # [T] offset inside that page
    page_table: Any    # decode/ragged: [B, P] pages of each sequence (0-padded)
    kv_lens: Any       # decode/ragged: [B] context length after this step (0 for padding)
    cu_q_lens: Any     # ragged: [B+1] offsets of each chunk in the flat token array
    num_seqs: Any      # ragged: [1] real sequences
    ctx_pages: Any     # flat: [N] the batch's context pages, block-aligned per sequence
    num_blocks: Any    # decode: [1] context blocks attention visits
    work: Any          # flat: [5, I] work items (query tile x context block), rows: WORK_FIELDS
    num_work: Any      # flat: [1] real work items
    # ragged (the TPU kernel's per-kind calls; pdtopo.kernels.ragged_attention):
    kind_counts: Any   # [2] decode rows, prefill query blocks
    dec_seqs: Any      # [Gd, Bd] sequences with one query token, Bd per decode grid step
    pf_blocks: Any     # [Gp, 2] prefill query blocks: (sequence, first row within its chunk)
    pf_q_rows: Any     # [Gp, Tq] each prefill block's flat token rows (T: padding)
    out_rows: Any      # [T] each token's row in [decode outputs; prefill outputs; zero row]


# Rows of AttentionMetadata.work: the item's block in ctx_pages, the tile's first token row,
# how many of the tile's rows are its sequence's, the absolute position of the tile's first
# row, and of the block's first token. The mask is computed from these scalars alone.
WORK_FIELDS = ("block", "row", "rows", "qpos", "kpos")


@dataclass(frozen=True)
class StepGeometry:
    """Fixed sizes of a runner's step inputs, derived from the engine config."""

    page_size: int
    max_pages: int          # pages of the longest request (engine.max_model_len)
    max_rows: int           # sequences per step: bucket(engine.max_running_requests)
    max_prefill_tokens: int
    layout_kind: str = "paged"  # paged (decode + flat layouts, gather attention) | ragged
    block_tokens: int = CONTEXT_BLOCK_TOKENS
    # False: every batch runs in the flat layout, one-token chunks included (a server that
    # never decodes, P, then never compiles a decode shape for a batch of one-token chunks)
    decode_layout: bool = True
    # True: a flat step may carry every running decode beside the prompt chunks
    # (engine.mixed_steps), so its context list is bounded by max_rows whole contexts
    mixed: bool = False
    # ragged: one device's (q dtype, kv dtype, heads, kv heads, head_dim), the key of the
    # kernel's block table (pdtopo.config.attention_blocks)
    kernel_shape: tuple = ("float32", "float32", 1, 1, 128)

    def kernel_blocks(self, tokens: int) -> tuple[KernelBlocks, KernelBlocks]:
        """The TPU kernel's (decode, prefill) blocks for a step of `tokens` (bucket)."""
        q_dtype, kv_dtype, heads, kv_heads, head_dim = self.kernel_shape
        key = (q_dtype, kv_dtype, heads, kv_heads, head_dim, self.page_size, tokens)
        return blocks_for("decode", *key), blocks_for("prefill", *key)

    @property
    def block_pages(self) -> int:
        return max(1, self.block_tokens // self.page_size)

    @property
    def tile_tokens(self) -> int:
        """Query rows per work item of the flat layout (one block of context each)."""
        return self.block_pages * self.page_size

    @property
    def decode_pages(self) -> int:
        return round_up(self.max_pages, self.block_pages)

    @property
    def flat_pages(self) -> int:
        """Bound on a flat batch's block-aligned context list: one sequence continuing a
        chunked prompt (up to max_pages; with mixed steps every row's whole context) + the
        batch's new tokens + per-sequence alignment."""
        new = math.ceil(self.max_prefill_tokens / self.page_size) + self.max_rows
        contexts = self.max_rows * self.max_pages if self.mixed else self.max_pages
        return round_up(contexts + new + self.max_rows * self.block_pages, self.block_pages)

    @property
    def flat_work(self) -> int:
        """Bound on a prefill batch's work items: every query tile (the batch's tokens in
        tiles, plus one partial tile per sequence) times the blocks of the longest context."""
        tiles = math.ceil(self.max_prefill_tokens / self.tile_tokens) + self.max_rows
        blocks = math.ceil(self.max_pages / self.block_pages) + 1
        return bucket(tiles * blocks)


# (layout, tokens T, rows B, page-table width P (0 for flat), (context pages N, work items I)
# for flat else 0)
StepKey = tuple


@dataclass
class StepInputs:
    key: StepKey
    tokens: np.ndarray     # [T]
    positions: np.ndarray  # [T]
    md: AttentionMetadata
    last_idx: np.ndarray   # [rows] flat index of each sequence's last token (logit rows)


def choose_layout(lens: np.ndarray, geometry: StepGeometry) -> str:
    if geometry.layout_kind == "ragged":
        return "ragged"
    return "decode" if geometry.decode_layout and bool((lens == 1).all()) else "flat"


@dataclass
class PackedChunks:
    """A step's chunks as flat arrays (`pack_chunks`), read once for validation and packing."""

    lens: np.ndarray    # [n] new tokens of each chunk
    starts: np.ndarray  # [n] its start_pos
    need: np.ndarray    # [n] pages its context spans after this step
    have: np.ndarray    # [n] pages its page_ids list
    listed: np.ndarray  # [n] of them in `pages`: min(need, have)
    tokens: np.ndarray  # [sum(lens)] the chunks' new tokens, one chunk after another
    pages: np.ndarray   # [sum(listed)] each chunk's first `listed` pages, likewise

    @property
    def page_offsets(self) -> np.ndarray:
        """Where each chunk's pages start in `pages`."""
        return np.cumsum(self.listed) - self.listed


def pack_chunks(chunks: Sequence[Any], page_size: int) -> PackedChunks:
    """The chunks' lengths, positions, tokens and needed pages in a few NumPy arrays (one pass
    over the chunks per field, no per-chunk array). A chunk whose token_ids are not a flat
    sequence of ints raises ValueError naming it."""
    n = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, n)
    starts = np.fromiter((c.start_pos for c in chunks), np.int64, n)
    need = -(-(starts + lens) // page_size)
    have = np.fromiter((len(c.page_ids) for c in chunks), np.int64, n)
    listed = np.minimum(need, have)
    try:
        tokens = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), np.int64,
                             int(lens.sum()))
    except (TypeError, ValueError):
        bad = next(i for i, c in enumerate(chunks) if np.asarray(c.token_ids).ndim != 1)
        raise ValueError(f"chunk {bad}: token_ids must be a non-empty 1-D sequence") from None
    pages = np.fromiter(chain.from_iterable(
        c.page_ids[:k] for c, k in zip(chunks, listed.tolist(), strict=True)), np.int64,
        int(listed.sum()))
    return PackedChunks(lens, starts, need, have, listed, tokens, pages)


def prepare_step(chunks: Sequence[Any], geometry: StepGeometry) -> StepInputs:
    """Padded host arrays of one step over `chunks` (objects with token_ids, start_pos and
    page_ids covering start_pos + len(token_ids)). The caller has validated them."""
    return prepare_packed(pack_chunks(chunks, geometry.page_size), geometry)


def prepare_packed(packed: PackedChunks, geometry: StepGeometry) -> StepInputs:
    """`prepare_step` from chunks already packed (`pack_chunks`)."""
    ps, bp = geometry.page_size, geometry.block_pages
    lens, starts = packed.lens.astype(np.int32), packed.starts.astype(np.int32)
    n = len(lens)
    need = packed.need.astype(np.int32)  # pages each sequence's context spans after this step
    total = int(lens.sum())
    layout = choose_layout(lens, geometry)

    if layout == "decode":
        tb = rows = max(bucket(n), 1)
    elif layout == "flat":
        tb, rows = bucket(total), max(geometry.max_rows, bucket(n))
    else:  # ragged: a step of T tokens has at most T sequences, so the key is T's bucket
        tb = bucket(total)
        rows = max(min(geometry.max_rows, tb), bucket(n))

    cu = np.zeros(rows + 1, dtype=np.int32)
    cu[1:n + 1] = np.cumsum(lens)
    cu[n + 1:] = total
    seq = np.repeat(np.arange(n, dtype=np.int32), lens)
    pos = starts[seq] + (np.arange(total, dtype=np.int32) - cu[seq])
    tokens = np.zeros(tb, dtype=np.int32)
    tokens[:total] = packed.tokens
    positions = np.zeros(tb, dtype=np.int32)
    positions[:total] = pos
    # each sequence's pages lie in packed.pages from page_off on; page j of sequence i is
    # packed.pages[page_off[i] + j], the sequence and column of every listed page below
    page_off = packed.page_offsets.astype(np.int32)
    page_seq = np.repeat(np.arange(n, dtype=np.int32), packed.listed)
    page_col = np.arange(len(packed.pages), dtype=np.int32) - page_off[page_seq]
    slot_pages = np.zeros(tb, dtype=np.int32)  # padding tokens write the reserved page 0
    slot_offsets = np.zeros(tb, dtype=np.int32)
    if total:
        slot_pages[:total] = packed.pages[page_off[seq] + pos // ps]
        slot_offsets[:total] = pos % ps
    last_idx = np.zeros(rows, dtype=np.int32)
    last_idx[:n] = cu[1:n + 1] - 1

    if layout == "flat":
        blocks = -(-need // bp)
        n_ctx = int(blocks.sum()) * bp
        width = geometry.flat_pages if n_ctx <= geometry.flat_pages else round_up(
            bucket(n_ctx), bp)
        ctx_pages = np.zeros(width, dtype=np.int32)
        tile, span = geometry.tile_tokens, bp * ps
        ctx_at = (np.cumsum(blocks) - blocks) * bp  # each sequence's first slot, block-aligned
        ctx_pages[ctx_at[page_seq] + page_col] = packed.pages
        items: list[tuple[int, int, int, int, int]] = []
        for i in range(n):
            first_block, lo, hi = int(ctx_at[i]) // bp, int(cu[i]), int(cu[i + 1])
            for row in range(lo, hi, tile):
                rows_in = min(tile, hi - row)
                qpos = int(starts[i]) + row - lo
                last_pos = qpos + rows_in - 1
                for j in range(min(int(blocks[i]), last_pos // span + 1)):  # causal skip
                    items.append((first_block + j, row, rows_in, qpos, j * span))
        n_work = len(items)
        width_i = geometry.flat_work if n_work <= geometry.flat_work else bucket(n_work)
        work = np.zeros((len(WORK_FIELDS), width_i), dtype=np.int32)
        if items:
            work[:, :n_work] = np.array(items, dtype=np.int32).T
        page_table = np.zeros((1, bp), dtype=np.int32)
        kv_lens = np.zeros(1, dtype=np.int32)
        num_blocks = np.zeros(1, dtype=np.int32)
        pages_key, ctx_key = 0, (width, width_i)
    else:
        width = geometry.decode_pages  # the kernel reads only the pages a row needs
        if int(need.max()) > width:
            width = round_up(bucket(int(need.max())), bp)
        page_table = np.zeros((rows, width), dtype=np.int32)
        page_table[page_seq, page_col] = packed.pages
        kv_lens = np.zeros(rows, dtype=np.int32)
        kv_lens[:n] = starts + lens
        num_blocks = np.array([-(-int(need.max()) // bp)], dtype=np.int32)
        ctx_pages = np.zeros(bp, dtype=np.int32)
        work = np.zeros((len(WORK_FIELDS), 1), dtype=np.int32)
        n_work = 0
        pages_key, ctx_key = width, 0

    kernel = (kernel_inputs(lens, cu, n, tb, rows, geometry) if layout == "ragged"
              else _NO_KERNEL_INPUTS)
    md = AttentionMetadata(
        slot_pages=slot_pages, slot_offsets=slot_offsets,
        page_table=page_table, kv_lens=kv_lens,
        cu_q_lens=cu if layout == "ragged" else np.zeros(2, dtype=np.int32),
        num_seqs=np.array([n], dtype=np.int32), ctx_pages=ctx_pages, num_blocks=num_blocks,
        work=work, num_work=np.array([n_work], dtype=np.int32), **kernel)
    key = (layout, tb, rows, pages_key, ctx_key)
    return StepInputs(key, tokens, positions, md, last_idx)


_NO_KERNEL_INPUTS = {
    "kind_counts": np.zeros(2, np.int32), "dec_seqs": np.zeros((1, 1), np.int32),
    "pf_blocks": np.zeros((1, 2), np.int32), "pf_q_rows": np.zeros((1, 1), np.int32),
    "out_rows": np.zeros(1, np.int32)}


def kernel_inputs(lens: np.ndarray, cu: np.ndarray, n: int, tb: int, rows: int,
                  geometry: StepGeometry) -> dict[str, np.ndarray]:
    """The ragged kernel's per-kind work: sequences of one query token are decode rows, the
    others are cut into prefill query blocks of the table's size; `out_rows` maps every token
    back from [decode outputs; prefill outputs; a zero row]. Shapes follow (tb, rows) alone."""
    decode, prefill = geometry.kernel_blocks(tb)
    dec_cap, pf_cap = block_counts(decode, prefill, tb, rows)
    tq = prefill.q_tokens
    zero_row = dec_cap + pf_cap * tq
    out_rows = np.full(tb, zero_row, np.int32)
    is_dec = lens == 1
    dec = np.flatnonzero(is_dec).astype(np.int32)
    dec_seqs = np.zeros(dec_cap, np.int32)
    dec_seqs[:len(dec)] = dec
    out_rows[cu[dec]] = np.arange(len(dec), dtype=np.int32)
    pf = np.flatnonzero(~is_dec)
    per_seq = -(-lens[pf] // tq)                        # query blocks of each prefill sequence
    seq = np.repeat(pf, per_seq).astype(np.int32)
    q0 = (np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * tq
    nb = len(seq)
    pf_blocks = np.zeros((pf_cap, 2), np.int32)
    pf_blocks[:nb, 0], pf_blocks[:nb, 1] = seq, q0
    rows_of = cu[seq][:, None] + q0[:, None] + np.arange(tq, dtype=np.int32)[None, :]
    inside = rows_of < cu[seq + 1][:, None]
    pf_q_rows = np.full((pf_cap, tq), tb, np.int32)
    pf_q_rows[:nb] = np.where(inside, rows_of, tb)
    slots = dec_cap + np.arange(nb * tq, dtype=np.int32).reshape(nb, tq)
    out_rows[rows_of[inside]] = slots[inside]
    return {"kind_counts": np.array([len(dec), nb], np.int32),
            "dec_seqs": dec_seqs.reshape(-1, decode.seqs), "pf_blocks": pf_blocks,
            "pf_q_rows": pf_q_rows, "out_rows": out_rows}


def warmup_batches(geometry: StepGeometry, decode: bool = True,
                   prefill: bool = True) -> list[list[tuple[int, int]]]:
    """One representative batch per StepKey of `shape_grid`: a list of (tokens, start_pos) per
    sequence, to be run on the reserved page 0 only."""
    batches: list[list[tuple[int, int]]] = []
    if geometry.layout_kind == "ragged":  # one key per token bucket, whatever the step's kind
        top = max(geometry.max_rows, bucket(geometry.max_prefill_tokens))
        longest = geometry.max_pages * geometry.page_size  # one sequence's most tokens
        t = 1
        while t <= top:
            if t <= geometry.max_rows:
                batches.append([(1, 0)] * t)
            else:
                batches.append([(min(longest, t - at), 0) for at in range(0, t, longest)])
            t *= 2
        return batches
    if decode:
        b = 1
        while b <= geometry.max_rows:
            batches.append([(1, 0)] * b)
            b *= 2
    if prefill:
        t = 2 if geometry.decode_layout else 1  # else one-token chunks run flat too
        while t <= bucket(geometry.max_prefill_tokens):
            if math.ceil(t / geometry.page_size) <= geometry.max_pages:
                batches.append([(t, 0)])
            t *= 2
    return batches


def shape_grid(geometry: StepGeometry, decode: bool = True, prefill: bool = True
               ) -> set[StepKey]:
    """Every StepKey the scheduler's batches can produce (paged layouts): decode steps at each
    batch bucket, prefill steps at each token bucket up to engine.max_prefill_tokens."""
    return {step.key for step in warmup_steps(geometry, decode, prefill)}


class _PageZeroChunk(NamedTuple):
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]


def warmup_steps(geometry: StepGeometry, decode: bool = True,
                 prefill: bool = True) -> list[StepInputs]:
    """The prepared steps of `warmup_batches`, every token on the reserved page 0."""
    return [prepare_step([_PageZeroChunk([0] * t, s, [0] * math.ceil((s + t) / geometry.page_size))
                          for t, s in batch], geometry)
            for batch in warmup_batches(geometry, decode, prefill)]
