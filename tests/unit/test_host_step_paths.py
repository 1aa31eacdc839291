"""The host step's batched paths (issue 48) against what they replace: packing a step's chunks
as flat arrays gives every per-sequence table a chunk-by-chunk reading gives; the runner's
vectorised validation names the first bad chunk; the batch-observed latency histogram exposes
what a prometheus-client Histogram does for the same values; a stream's consumer that falls
behind gets the newest output (never skipping the first, a final one or a handoff marker)."""

from __future__ import annotations

import asyncio
import math
import random
from typing import NamedTuple

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdtopo.runtime.api.movable import HandoffMarker
from pdtopo.runtime.api.streaming import latest_outputs
from pdtopo.runtime.engine.metrics import BatchHistogram
from pdtopo.runtime.engine.request import ReqOutput
from pdtopo.runtime.engine.step_inputs import StepGeometry, pack_chunks, prepare_step


class Chunk(NamedTuple):
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]


def _chunks(rng: random.Random, n: int, ps: int, one_token: bool) -> list[Chunk]:
    out = []
    for _ in range(n):
        t = 1 if one_token else rng.randint(2, 12)
        start = rng.randint(0, 40)
        need = math.ceil((start + t) / ps)
        # page lists longer than the step needs, as a request's are while it decodes
        out.append(Chunk([rng.randrange(1000) for _ in range(t)], start,
                         rng.sample(range(1, 4096), need + rng.randint(0, 3))))
    return out


@pytest.mark.parametrize("layout", ["decode", "flat", "ragged"])
def test_packed_tables_equal_a_chunk_by_chunk_reading(layout):
    rng = random.Random(7)
    g = StepGeometry(page_size=4, max_pages=16, max_rows=8, max_prefill_tokens=64,
                     block_tokens=8, layout_kind="ragged" if layout == "ragged" else "paged")
    for _ in range(40):
        chunks = _chunks(rng, rng.randint(1, 8), 4, one_token=layout == "decode")
        step = prepare_step(chunks, g)
        assert step.key[0] == layout
        row = 0
        for i, c in enumerate(chunks):
            need = math.ceil((c.start_pos + len(c.token_ids)) / 4)
            for j, tok in enumerate(c.token_ids):
                pos = c.start_pos + j
                assert step.tokens[row] == tok and step.positions[row] == pos
                assert step.md.slot_pages[row] == c.page_ids[pos // 4]
                assert step.md.slot_offsets[row] == pos % 4
                row += 1
            assert step.last_idx[i] == row - 1
            if layout != "flat":
                assert list(step.md.page_table[i, :need]) == c.page_ids[:need]
                assert not step.md.page_table[i, need:].any()
                assert step.md.kv_lens[i] == c.start_pos + len(c.token_ids)
        assert not step.md.slot_pages[row:].any()  # padding writes the reserved page 0
        if layout == "flat":
            at = 0
            for c in chunks:
                need = math.ceil((c.start_pos + len(c.token_ids)) / 4)
                assert list(step.md.ctx_pages[at:at + need]) == c.page_ids[:need]
                at += math.ceil(need / g.block_pages) * g.block_pages


def test_packing_reads_only_the_pages_a_chunk_needs():
    packed = pack_chunks([Chunk([5, 6], 3, [9, 8, 7]), Chunk([1], 0, [4, 3])], page_size=4)
    assert packed.need.tolist() == [2, 1] and packed.have.tolist() == [3, 2]
    assert packed.pages.tolist() == [9, 8, 4] and packed.page_offsets.tolist() == [0, 2]
    assert packed.tokens.tolist() == [5, 6, 1]


class _Runner:
    """What ModelRunner._validate reads of its runner."""

    class config:  # noqa: N801 - the attribute a runner has
        vocab_size = 100

    page_size = 4
    num_pages = 50


@pytest.mark.parametrize(("chunks", "message"), [
    ([Chunk([1], 0, [1]), Chunk([1, 100], 0, [2])], r"chunk 1: token id out of range \[0, 100\)"),
    ([Chunk([1], 0, [1]), Chunk([], 0, [2])], "chunk 1: token_ids must be a non-empty"),
    ([Chunk([1], 0, [1]), Chunk([[1, 2]], 0, [2])], "chunk 1: token_ids must be a non-empty"),
    ([Chunk([1], 0, [1]), Chunk([1], -1, [2])], "chunk 1: start_pos=-1 must be >= 0"),
    ([Chunk([1], 0, [1]), Chunk([1] * 5, 0, [2])], "chunk 1: page_ids has 1 pages .* need 2"),
    ([Chunk([1], 0, [1]), Chunk([1] * 5, 0, [2, 0, 3])],
     r"chunk 1: page ids must be in \[1, 50\) \(page 0 is reserved\), got \[2, 0\]"),
    ([Chunk([1] * 5, 0, [2, 3]), Chunk([1], 0, [50])], r"chunk 1: .*got \[50\]"),
])
def test_validation_names_the_first_bad_chunk(chunks, message):
    from pdtopo.runtime.engine.model_runner import ModelRunner

    with pytest.raises(ValueError, match=message):
        ModelRunner._validate(_Runner(), chunks)


def test_a_valid_step_passes_validation_packed():
    from pdtopo.runtime.engine.model_runner import ModelRunner

    packed = ModelRunner._validate(_Runner(), [Chunk([1, 2], 3, [4, 5, 6]), Chunk([7], 0, [8])])
    assert packed.pages.tolist() == [4, 5, 8]


def _series(registry: CollectorRegistry, name: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith(name) and "_created" not in line]


def test_batch_histogram_exposes_what_a_histogram_does():
    buckets = (0.001, 0.01, 0.1, 1.0)
    values = [0.0005, 0.001, 0.0010001, 0.05, 0.1, 3.0, 0.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("x_seconds", "doc", {"model_name": "m"}, buckets, ours)
    ref = Histogram("x_seconds", "doc", labelnames=["model_name"], buckets=buckets,
                    registry=theirs).labels(model_name="m")
    batch.observe_many(values[:4])
    batch.observe_many([])
    for v in values[4:]:
        batch.observe(v)
    for v in values:
        ref.observe(v)
    assert _series(ours, "x_seconds") == _series(theirs, "x_seconds")
    assert any('le="+Inf"' in line and line.endswith(" 7.0") for line in _series(ours, "x"))


class _Sink:
    def __init__(self, outs):
        self.queue = list(outs)
        self.later = None  # what get() waits for once the queue is empty

    async def get(self):
        if not self.queue:
            self.queue.append(self.later)
        return self.queue.pop(0)

    def get_nowait(self):
        return self.queue.pop(0) if self.queue else None


class _Handle:
    """What latest_outputs reads of a Handle (state.py): next / next_nowait and `final`."""

    def __init__(self, outs):
        self.sink, self.final, self.output_ids = _Sink(outs), None, []

    def _took(self, out):
        self.output_ids.extend(out.new_token_ids)
        if out.finished:
            self.final = out
        return out

    async def next(self):
        return self._took(await self.sink.get())

    def next_nowait(self):
        out = self.sink.get_nowait()
        return None if out is None else self._took(out)


def _out(n: int, finished: bool = False) -> ReqOutput:
    return ReqOutput("r", [n], n, 3, finished=finished)


def _consume(handle) -> list:
    async def run():
        return [out async for out in latest_outputs(handle)]
    return asyncio.run(run())


def test_a_consumer_behind_gets_the_newest_output_never_skipping_first_or_final():
    h = _Handle([_out(1), _out(2), _out(3), _out(4, finished=True)])
    got = _consume(h)
    # the first alone; 2..4 queued by then: the newest, which is the final one
    assert [o.num_output_tokens for o in got] == [1, 4]
    assert h.output_ids == [1, 2, 3, 4]  # every output's tokens were taken
    assert got[-1].finished and h.final is got[-1]

    h = _Handle([_out(1), _out(2), _out(3)])
    h.sink.later = _out(4, finished=True)  # the end comes once the middle was written
    assert [o.num_output_tokens for o in _consume(h)] == [1, 3, 4]


def test_a_handoff_marker_ends_the_outputs_after_what_came_before_it():
    marker = HandoffMarker.__new__(HandoffMarker)  # only its type matters here
    ReqOutput.__init__(marker, "r", [], 3, 3)
    h = _Handle([_out(1), _out(2), _out(3), marker, _out(4)])
    got = _consume(h)
    assert [type(o).__name__ for o in got] == ["ReqOutput", "ReqOutput", "HandoffMarker"]
    assert got[1].num_output_tokens == 3  # 2 was superseded by 3, which came before the marker
    assert np.array_equal(h.output_ids, [1, 2, 3])  # nothing after the marker was taken
