"""Block sizes of pdtopo's TPU attention kernel: one table read by the kernel, the step inputs
and the plan's on-chip memory check.

    blocks_for(kind, q_dtype, kv_dtype, heads, kv_heads, head_dim, page_size, tokens)
        -> KernelBlocks(kind, q_tokens, seqs, kv_tokens, group)

`kind` is "decode" (sequences with one query token this step) or "prefill" (sequences with two
or more: prompt chunks, alone or beside decodes in a mixed step); the kernel runs one call per
kind, each with its own static blocks. `heads`/`kv_heads` are one device's (after tp), `tokens`
the step's token bucket.

A decode block is `seqs` sequences of one query token; each sequence's matmul rows are the
`group` query heads of one KV head. A prefill block is `q_tokens` tokens of one sequence times
its `group` query heads (rows = q_tokens * group, token-major). Either walks the context
`kv_tokens` at a time (a whole number of pages), fetching only the pages a block's rows see.

Where the numbers come from. Anchors (TABLE) follow sglang-jax's tuned table for its v3 ragged
kernel on v6e (bf16, head_dim 128): decode 1 token per sequence over KV blocks of 256-512
tokens; prefill with all query heads of a KV head packed as rows, over KV blocks of 512-2,048
tokens. One departure: prefill blocks here hold 64 tokens, not 32, so that a 2,048-token prompt
re-reads its context about 16.5 times on average instead of about 32.5 (each query block reads
the context up to its last row); with 4 query heads per KV head that is 256 rows per fetch.
A key the table lacks gets the rule (`rule_for`): decode 8 sequences per grid step over
max(256, page_size) tokens; prefill max(64, 128 / group) tokens (at least 128 rows) over
max(512, page_size) tokens. Every q block is then cut to the step's token bucket (a 16-token
step runs 16-token blocks), every KV block rounded to whole pages. Only a TPU run can say
whether other sizes run faster (`benchmarks/bench_tpu_step.py` counts bytes and rows, not
time).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("decode", "prefill")
DECODE_SEQS = 8            # decode sequences per grid step (a sublane's worth of rows)
DECODE_KV_TOKENS = 256     # at least: KV tokens per decode block
PREFILL_Q_TOKENS = 64      # at least: query tokens per prefill block
PREFILL_ROWS = 128         # at least: matmul rows per prefill block (tokens x group)
PREFILL_KV_TOKENS = 512    # at least: KV tokens per prefill block

# (kind, q dtype, kv dtype, query heads per KV head, head_dim) -> (q_tokens, seqs, kv_tokens)
TABLE: dict[tuple, tuple[int, int, int]] = {
    ("decode", "bfloat16", "bfloat16", 4, 128): (1, 8, 512),
    ("decode", "bfloat16", "bfloat16", 8, 128): (1, 8, 512),
    ("prefill", "bfloat16", "bfloat16", 4, 128): (64, 1, 1024),
    ("prefill", "bfloat16", "bfloat16", 8, 128): (64, 1, 1024),
}


@dataclass(frozen=True)
class KernelBlocks:
    kind: str
    q_tokens: int   # query tokens per block of one sequence (decode: 1)
    seqs: int       # sequences per grid step (prefill: 1)
    kv_tokens: int  # context tokens per KV block, whole pages
    group: int      # query heads per KV head

    @property
    def rows(self) -> int:
        """Matmul rows each fetched KV block feeds (per KV head, per sequence)."""
        return self.q_tokens * self.group

    def kv_pages(self, page_size: int) -> int:
        return self.kv_tokens // page_size


def _bucket(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def rule_for(kind: str, group: int, page_size: int) -> tuple[int, int, int]:
    """(q_tokens, seqs, kv_tokens) for a key the table lacks (module docstring)."""
    if kind == "decode":
        return 1, DECODE_SEQS, max(DECODE_KV_TOKENS, page_size)
    q_tokens = max(PREFILL_Q_TOKENS, _bucket(-(-PREFILL_ROWS // group)))
    return q_tokens, 1, max(PREFILL_KV_TOKENS, page_size)


def blocks_for(kind: str, q_dtype: str, kv_dtype: str, heads: int, kv_heads: int,
               head_dim: int, page_size: int, tokens: int) -> KernelBlocks:
    if kind not in KINDS:
        raise ValueError(f"attention block kind {kind!r}: choose one of {', '.join(KINDS)}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    group = heads // kv_heads
    key = (kind, str(q_dtype), str(kv_dtype), group, head_dim)
    q_tokens, seqs, kv_tokens = TABLE.get(key) or rule_for(kind, group, page_size)
    q_tokens = min(q_tokens, _bucket(tokens))
    kv_tokens = max(page_size, kv_tokens // page_size * page_size)
    return KernelBlocks(kind, q_tokens, seqs, kv_tokens, group)


def block_counts(blocks_decode: KernelBlocks, blocks_prefill: KernelBlocks, tokens: int,
                 rows: int) -> tuple[int, int]:
    """Static grid sizes of a step of `tokens` (bucket) over at most `rows` sequences:
    (decode rows, padded to whole grid steps; prefill query blocks). A prefill sequence has at
    least two tokens, so at most min(rows, tokens // 2) of them, each with one partial block."""
    dec = min(rows, tokens)
    dec = -(-dec // blocks_decode.seqs) * blocks_decode.seqs
    pf = tokens // blocks_prefill.q_tokens + min(rows, tokens // 2)
    return dec, max(pf, 1)
