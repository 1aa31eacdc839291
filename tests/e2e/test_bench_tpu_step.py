"""benchmarks/bench_tpu_step.py measures what it claims, on steps small enough for a test: the
DMA bytes it counts out of both kernels (pdtopo's and the previous one, interpreted) equal the
pages their grids fetch worked out by hand, the rows per fetch are the kernels' matmul rows, the
program it exports is a TPU program (both kernel calls are tpu_custom_calls), a kernel output
off the float64 reference fails it, and the interpreter is left as it was found."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.constants import REPO_ROOT

MIB = 2**20
PAGE = 64 * 2 * 128 * 2 * 2  # one page, K and V: 64 tokens x 2 KV heads per device x 128 x bf16
SMALL = {"decode": [[1, 130]] * 3,       # 3 sequences of 131 tokens: 3 pages each
         "prefill": [[200, 0]],          # one 200-token prompt: 4 pages
         "mixed": [[1, 130], [100, 60]]}  # a decode (3 pages) + a chunk to 160 tokens (3)


def _step(out: str, name: str) -> str:
    return re.search(rf"^{name} step: .*?(?=^\S)", out, re.S | re.M)[0]


def test_small_steps_count_the_pages_the_grids_fetch():
    code = ("import sys; from benchmarks import bench_tpu_step as b; "
            f"sys.exit(b.main({{k: [tuple(s) for s in v] for k, v in {json.dumps(SMALL)}.items()}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    decode, prefill, mixed = (_step(out, n) for n in ("decode", "prefill", "mixed"))
    assert f"live KV {9 * PAGE / MIB:.2f} MiB (9 pages)" in decode
    # decode: every page once, by both kernels; rows: G=4 query heads vs one of a 16-row block
    assert "new 0.56 MiB = 1.00x live, v1 0.56 MiB = 1.00x live" in decode
    assert "rows per KV fetch: new decode 4 (real 4); v1 16 (real 1)" in decode
    # prefill: 64-token query blocks see 64, 128, 192, 200 positions: 1+2+3+4 pages of 4; the
    # previous kernel's 16-row blocks 4x1 + 4x2 + 4x3 + 1x4 = 28 pages
    assert "new 0.62 MiB = 2.50x live, v1 1.75 MiB = 7.00x live, new / v1 = 0.36" in prefill
    # 256 rows (64 tokens x 4 heads) per fetch; real: (64x1 + 64x2 + 64x3 + 8x4) / 10 pages x 4
    assert "new prefill 256 (real 166.4); v1 16 (real 14.9)" in prefill
    # mixed: the decode's 3 pages + the chunk's blocks (tokens 60-123: 2 pages, 124-159: 3)
    assert "new 0.50 MiB = 1.33x live" in mixed
    assert "new decode 4 (real 4); prefill 256 (real" in mixed
    for step in (decode, prefill, mixed):
        assert "TPU export with 2 tpu_custom_call" in step
        assert "copies 0.00, pool reads 0.00 MiB" in step  # the kernel reads the pool in place
    # prefill's step: the kernel's 2.5x + its 256 tokens' K/V written (padding included)
    assert out.strip().splitlines()[-2:] == [
        "decode step KV bytes / live KV bytes = 1.01x",
        "prefill step KV bytes / live KV bytes = 3.50x, rows per KV fetch = 256"]


def test_an_output_off_the_reference_fails_and_the_interpreter_is_restored(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    from benchmarks import bench_tpu_step as bench

    original = interpreter.DMA.execute_read
    reference = bench.dense_reference
    monkeypatch.setattr(bench, "dense_reference", lambda *a: reference(*a) + 0.1)
    with pytest.raises(AssertionError, match="float64 reference"):
        bench.measure([(1, 70)])
    assert interpreter.DMA.execute_read is original
    assert bench._ACTIVE is None
    with bench.counting_dmas((2, 64, 2, 128)) as counter:
        assert interpreter.DMA.execute_read is not original
    assert interpreter.DMA.execute_read is original
    assert counter.fetches == [] and counter.bytes == 0
