"""A fake model runner for scheduler unit tests: a "model" whose next token is a hash of the
whole sequence it reads back through the page table, so wrong page bookkeeping (a page shared,
freed early or missing) changes the output. Token ids 0..1 are never produced (EOS = 1)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.runtime.engine.model_runner import SeqChunk
from pdtopo.runtime.settings import direct_process_context

VOCAB = 64
EOS = 1


class FakeTokenizer:
    eos_token_ids = [EOS]
    bos_token_id = 0
    vocab_size = VOCAB

    def encode(self, text, add_special_tokens=True):
        return [2 + (b % (VOCAB - 2)) for b in text.encode()]

    def decode(self, ids):
        return "".join(chr(ord("a") + (i % 26)) for i in ids if i > 1)


def next_token(seq: list[int]) -> int:
    h = 7
    for i, t in enumerate(seq):
        h = (h * 31 + (i + 1) * t) % 1000003
    return 2 + h % (VOCAB - 2)


class FakeRunner:
    def __init__(self, num_pages=32, page_size=4, fail_on=None, read_only=None):
        self.read_only = read_only  # page -> True if a write there is a bug (prefix cache)
        self.page_size = page_size
        self.num_pages = num_pages
        self.pool = np.full((num_pages, page_size), -1, np.int64)
        self.calls: list[list[SeqChunk]] = []
        self.fail_on = fail_on  # token id that makes forward raise

    def forward(self, chunks, padded=False):  # padded: exactly one row per chunk is fine
        self.calls.append(chunks)
        ps = self.page_size
        out = np.zeros((len(chunks), VOCAB), np.float32)
        for i, c in enumerate(chunks):
            if self.fail_on is not None and self.fail_on in c.token_ids:
                raise RuntimeError("injected forward failure")
            end = c.start_pos + len(c.token_ids)
            assert len(c.page_ids) * ps >= end, (c, "page table too short")
            for j, t in enumerate(c.token_ids):
                pos = c.start_pos + j
                page = c.page_ids[pos // ps]
                assert self.read_only is None or not self.read_only(page), \
                    (c, f"writing into page {page}, which the prefix cache shares")
                self.pool[page, pos % ps] = t
            seq = [int(self.pool[c.page_ids[p // ps], p % ps]) for p in range(end)]
            assert all(t >= 0 for t in seq), (c, "reading unwritten KV")
            out[i, next_token(seq)] = 10.0
        return jnp.asarray(out)


def make_ctx(**engine):
    eng = {"max_model_len": 64, "max_prefill_tokens": 32, "max_running_requests": 4,
           "seed": 0, "served_model_name": None, **engine}
    cfg = OmegaConf.merge(compose_config(["model=tiny_llama"]),
                          {"engine": eng, "model": {"name": "fake"}})
    return direct_process_context(cfg)


def reference(prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the fake model, computed without any paging."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


def run_until_idle(s, max_steps: int = 500, after_step=None) -> None:
    """Step a scheduler (not started) on this thread until it has nothing to run;
    `after_step(s)` runs after every batch (e.g. a consistency check)."""
    for _ in range(max_steps):
        s.drain_inbox()
        batch = s.schedule()
        if batch is None:
            s.publish_stats()
            return
        s.run_batch(batch)
        if after_step is not None:
            after_step(s)
    raise AssertionError("scheduler did not become idle")
