"""The highest request rate a candidate serves within the SLOs (pure; no I/O).

    result = find_max_rate(measure, settings)   # measure(rate) -> goodput fraction

Grow: run at `start_rate`, `start_rate * growth`, ... while the goodput fraction is at least
`goodput_target`. The first failing rate bounds the search from above; bisect between the last
passing and the first failing rate until their gap is below `precision` of the failing one or
the run budget (`max_runs_per_candidate`) is spent. If even `start_rate` fails, bisect down
from it (towards 0). The answer is the last passing rate (0 when none passed) and whether an
upper bound was found (`bounded`: False means the candidate passed at every rate tried, so its
capacity is at least the answer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdtopo.tune.settings import TuneSettings


@dataclass
class SearchResult:
    best_rate: float                          # highest passing rate (0: none passed)
    fail_rate: float | None                   # lowest failing rate seen (None: none failed)
    runs: list[tuple[float, float]] = field(default_factory=list)  # (rate, goodput fraction)

    @property
    def bounded(self) -> bool:
        return self.fail_rate is not None


def find_max_rate(measure: Callable[[float], float], s: TuneSettings) -> SearchResult:
    res = SearchResult(best_rate=0.0, fail_rate=None)

    def run(rate: float) -> bool:
        goodput = measure(rate)
        res.runs.append((rate, goodput))
        ok = goodput >= s.goodput_target
        if ok:
            res.best_rate = max(res.best_rate, rate)
        else:
            res.fail_rate = rate if res.fail_rate is None else min(res.fail_rate, rate)
        return ok

    rate = s.start_rate
    while len(res.runs) < s.max_runs_per_candidate:
        if not run(rate):
            break
        rate *= s.growth
    while len(res.runs) < s.max_runs_per_candidate and res.fail_rate is not None:
        lo, hi = res.best_rate, res.fail_rate
        if (hi - lo) / hi < s.precision:
            break
        run((lo + hi) / 2)
    return res
