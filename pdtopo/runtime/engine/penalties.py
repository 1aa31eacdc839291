"""Per-request token counts on the device, for presence, frequency and repetition penalties.

Data flow. The `Sampler` owns one `PenaltyTables`: two device arrays with a row per slot,
`counts[slot, token]` (how often the request has generated `token`) and `seen[slot, token]`
(whether `token` is in its prompt or its output). A request that asks for a penalty gets a slot
the first time one of its rows is sampled (`slots_for`): the row is built on the host from its
prompt and output ids (one bincount, one transfer of a vocabulary-sized row) and set in place.
From then on the sampling program itself adds each sampled token to the row (on the device, the
tables donated), so nothing per token crosses to the device. `release(serial)` frees a slot when its
request ends. Slots are rebuilt from ids whenever needed, so a slot that had to be reused
(least recently used first) or a request moved between servers (PD: P samples token 0, D the
rest) sees the same counts as a request that never moved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class PenaltyHistory:
    """What a slot is built from: the request's serial (`Req.serial`, unique in the process:
    a client may reuse a rid) and its token ids so far (not copied)."""

    serial: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


@partial(jax.jit, donate_argnums=(0, 1))
def _set_row(counts, seen, slot, count_row, seen_row):
    return counts.at[slot].set(count_row), seen.at[slot].set(seen_row)


def apply_penalties(logits, counts_rows, seen_rows, presence, frequency, repetition):
    """Penalised logits (float32): repetition first (HF's rule: positive logits of seen tokens
    divided by the penalty, negative ones multiplied), then OpenAI's frequency and presence
    terms over generated tokens. Neutral values leave a row exactly as it was."""
    r = repetition[:, None]
    logits = jnp.where(seen_rows, jnp.where(logits > 0, logits / r, logits * r), logits)
    counts = counts_rows.astype(jnp.float32)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


class PenaltyTables:
    """The device tables and the host's slot map. Single owner: the scheduler thread."""

    def __init__(self, slots: int, vocab: int, sharding: Any = None):
        self.num_slots, self.vocab = slots, vocab
        self.counts = jax.device_put(np.zeros((slots, vocab), np.int32), sharding)
        self.seen = jax.device_put(np.zeros((slots, vocab), np.bool_), sharding)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # serial -> slot, oldest first
        self._free = list(range(slots - 1, -1, -1))

    def slots_for(self, histories: Sequence[PenaltyHistory | None]) -> np.ndarray:
        """The slot of each row (-1: no penalty), building the rows of new requests."""
        out = np.full(len(histories), -1, np.int32)
        wanted = {h.serial for h in histories if h is not None}
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} penalised requests in one step; the penalty "
                             f"tables have {self.num_slots} slots")
        for i, h in enumerate(histories):
            if h is None:
                continue
            slot = self._slot_of.get(h.serial)
            if slot is None:
                slot = self._take_slot(wanted)
                self._build(slot, h)
                self._slot_of[h.serial] = slot
            self._slot_of.move_to_end(h.serial)
            out[i] = slot
        return out

    def holds(self, serial: int) -> bool:
        """Whether request `serial` has a slot (its counts live on the device)."""
        return serial in self._slot_of

    def release(self, serial: int) -> None:
        slot = self._slot_of.pop(serial, None)
        if slot is not None:
            self._free.append(slot)

    def _take_slot(self, keep: set[int]) -> int:
        if self._free:
            return self._free.pop()
        victim = next(r for r in self._slot_of if r not in keep)  # least recently used
        return self._slot_of.pop(victim)

    def _build(self, slot: int, h: PenaltyHistory) -> None:
        count_row = np.bincount(np.asarray(h.output_ids, np.int64),
                                minlength=self.vocab)[:self.vocab].astype(np.int32)
        seen_row = count_row > 0
        if len(h.prompt_ids):
            seen_row[np.asarray(h.prompt_ids, np.int64)] = True
        self.counts, self.seen = _set_row(self.counts, self.seen, np.int32(slot),
                                          count_row, seen_row)
