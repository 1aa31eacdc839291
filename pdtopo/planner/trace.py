"""Request traces for the simulator: phases of Poisson arrivals, seeded (pure).

    trace = phased_trace([Phase("prompt", 60, rate=3.0, input_len=4000, output_len=40),
                          Phase("decode", 60, rate=6.0, input_len=200, output_len=400)], seed=0)

Lengths are uniform in [len (1 - spread), len (1 + spread)], as bench's input_len_range.
`SHIFTING_PHASES` is the prompt-heavy / decode-heavy / prompt-heavy shape of issue 49.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate: float           # requests/s (Poisson)
    input_len: int
    output_len: int
    spread: float = 0.2   # lengths uniform within +-spread


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival: float
    input_len: int
    output_len: int
    tag: str


def _length(rng: random.Random, mean: int, spread: float) -> int:
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.randint(lo, hi)


def phased_trace(phases: Sequence[Phase], seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    out: list[SimRequest] = []
    start = 0.0
    for ph in phases:
        t = start
        while ph.rate > 0:
            t += rng.expovariate(ph.rate)
            if t >= start + ph.duration_s:
                break
            out.append(SimRequest(len(out), t, _length(rng, ph.input_len, ph.spread),
                                  _length(rng, ph.output_len, ph.spread), ph.name))
        start += ph.duration_s
    return out


def trace_span(phases: Sequence[Phase]) -> float:
    return sum(p.duration_s for p in phases)
