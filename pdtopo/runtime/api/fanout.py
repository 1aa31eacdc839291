"""`n > 1`: one prompt's completions as separate requests that share the prompt's KV.

Data flow. A route validates each prompt of a body once (`Prepared`, whose `sampling.n` says
how many completions it wants), then `submit_completions` submits every completion: the
first of a prompt leads (it offers the prompt's pages to the prefix cache when its prefill
ends), the others follow it (they wait for those pages and prefill only the last partial page).
Each completion gets its own seed (`seed + i` when the client gave one; otherwise the scheduler
derives one), its own rid (`rid_i`) and, in PD, its own bootstrap room.

Rooms: P and D get the same body from the router and must agree on each completion's room. The
router sends a scalar room for one prompt (completion i takes room + i), or a list with one
room per completion (chat with n > 1), or one per prompt (prompt b's completion i takes
rooms[b] + i). Hosts and ports follow the same shapes, without the offsets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pdtopo.runtime.api.state import Handle, Prepared, ServerState
from pdtopo.runtime.engine.request import UINT64_MAX, InvalidRequest


def completion_seed(seed: int | None, i: int) -> int | None:
    return None if seed is None else (seed + i) % (UINT64_MAX + 1)


def spread(value: Any, counts: Sequence[int], name: str, *, offset: bool) -> list[list[Any]]:
    """Per prompt, per completion: a scalar or None for all, a list with one entry per
    completion, or a list with one per prompt. `offset`: completion i adds i (rooms); the
    scalar adds the completion's position in the whole body."""
    total = sum(counts)
    if isinstance(value, list):
        if len(value) == total:
            flat = iter(value)
            return [[next(flat) for _ in range(n)] for n in counts]
        if len(value) == len(counts):
            return [[_shift(v, i, offset) for i in range(n)] for v, n in zip(value, counts,
                                                                             strict=True)]
        raise InvalidRequest(name, f"{name} has {len(value)} entries; this body has "
                             f"{len(counts)} prompts and {total} completions")
    out, start = [], 0
    for n in counts:
        out.append([_shift(value, start + i, offset) for i in range(n)])
        start += n
    return out


def _shift(value: Any, i: int, offset: bool) -> Any:
    if value is None or not offset:
        return value
    return (int(value) + i) % (UINT64_MAX + 1)


def completion_rids(rids: Sequence[str | None], counts: Sequence[int]) -> list[list[str | None]]:
    return [[r if n == 1 or r is None else f"{r}_{i}" for i in range(n)]
            for r, n in zip(rids, counts, strict=True)]


def submit_completions(state: ServerState, prepared: Sequence[Prepared],
                       rids: Sequence[str | None], routing: dict[str, Any]) -> list[Handle]:
    """Submit every completion of every prompt, in order (prompt 0's, then prompt 1's...).
    `routing`: the body's bootstrap_host/port/room fields as given."""
    counts = [p.sampling.n for p in prepared]
    hosts = spread(routing.get("bootstrap_host"), counts, "bootstrap_host", offset=False)
    ports = spread(routing.get("bootstrap_port"), counts, "bootstrap_port", offset=False)
    rooms = spread(routing.get("bootstrap_room"), counts, "bootstrap_room", offset=True)
    ids = completion_rids(rids, counts)
    handles: list[Handle] = []
    for b, prep in enumerate(prepared):
        n, leader = counts[b], None
        for i in range(n):
            sampling = dataclasses.replace(prep.sampling, n=1,
                                           seed=completion_seed(prep.sampling.seed, i))
            h = state.submit(Prepared(prep.prompt_ids, sampling), rid=ids[b][i],
                             bootstrap_host=hosts[b][i], bootstrap_port=ports[b][i],
                             bootstrap_room=rooms[b][i], leader=leader,
                             followers=n - 1 if i == 0 else 0)
            leader = leader or h
            handles.append(h)
    return handles
