"""Static splits against the planner, on the simulator (pure).

    splits = static_splits(budget)                         # every P:D split the budget holds
    cmp = compare(trace, params, budget, settings, start=Counts(2, 2), slo=slo, duration_s=T)
    cmp.planned.goodput_rps / cmp.static[Counts(2, 2)].goodput_rps, cmp.best_static

A split is full when neither role can take one more instance within the budget (chips and
bounds); `static_splits` lists the full ones (with no chip budget: every split the bounds
allow). `compare` runs each of them and the planner started from `start`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdtopo.bench.settings import Slo as BenchSlo
from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.settings import PlannerSettings
from pdtopo.planner.simulate import SimParams, SimResult, simulate
from pdtopo.planner.trace import SimRequest


def static_splits(budget: Budget) -> list[Counts]:
    """Every full split (module docstring), fewest P first."""
    def most(role: str) -> int:
        lo, hi = budget.bounds(role)
        per = budget.prefill_chips if role == "prefill" else budget.decode_chips
        cap = hi if hi is not None else (budget.chips // per if budget.chips else lo)
        return max(lo, cap)

    out = []
    for p in range(budget.bounds("prefill")[0], most("prefill") + 1):
        for d in range(budget.bounds("decode")[0], most("decode") + 1):
            c = Counts(p, d)
            if budget.refusal(c) is None and all(budget.refusal(c.add(r, 1)) is not None
                                                 for r in ("prefill", "decode")):
                out.append(c)
    return out


@dataclass
class Comparison:
    static: dict[Counts, SimResult]
    planned: SimResult
    start: Counts

    @property
    def best_static(self) -> SimResult:
        return max(self.static.values(), key=lambda r: r.goodput_rps)

    def ratio(self, against: SimResult) -> float:
        return self.planned.goodput_rps / against.goodput_rps if against.goodput_rps \
            else float("inf")


def compare(trace: Sequence[SimRequest], params: SimParams, budget: Budget,
            settings: PlannerSettings, *, start: Counts, slo: BenchSlo, duration_s: float,
            splits: Sequence[Counts] | None = None) -> Comparison:
    static = {c: simulate(trace, params, c, slo=slo, duration_s=duration_s)
              for c in (splits if splits is not None else static_splits(budget))}
    if start not in static:
        static[start] = simulate(trace, params, start, slo=slo, duration_s=duration_s)
    planned = simulate(trace, params, start, slo=slo, duration_s=duration_s, planner=settings,
                       budget=budget)
    return Comparison(static, planned, start)
