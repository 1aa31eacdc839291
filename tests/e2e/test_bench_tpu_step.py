"""benchmarks/bench_tpu_step.py counts what it claims: run as a script, its byte counts for an
8B-shaped layer equal the sizes worked out by hand, and the program it counts is a TPU program
(the export holds the kernel as a tpu_custom_call)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.constants import REPO_ROOT

MIB = 2**20


def test_counts_match_the_shapes():
    out = subprocess.run([sys.executable, "benchmarks/bench_tpu_step.py"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    # decode: 128 sequences x 32 pages of 64 tokens x 2 KV heads per device x 128 x bf16, K+V
    live = 128 * 32 * 64 * 2 * 128 * 2 * 2
    assert f"live KV {live / MIB:.1f} MiB" in out
    today = re.search(r"today:\s+([\d.]+) MiB = ([\d.]+)x live \(pool reads ([\d.]+), "
                      r"pool writes ([\d.]+), copies ([\d.]+), kernel reads ([\d.]+)", out)
    # the previous path gathered every page once, wrote the copy once, the kernel read it
    assert [float(today.group(i)) for i in (3, 5, 6)] == [live / MIB] * 3
    # the step's 128 new tokens written (K and V, 2 heads x 128 x bf16)
    assert float(today.group(4)) == round(128 * 2 * 2 * 128 * 2 / MIB, 1)
    assert float(today.group(2)) == 3.0
    assert "1 tpu_custom_call" in out
    last = out.strip().splitlines()[-1]
    ratio = float(re.fullmatch(r"decode step KV bytes / live KV bytes = ([\d.]+)x", last)[1])
    assert 1.0 <= ratio <= 1.3
