"""One planner interval end to end, as the planner program and the simulator run it (pure):
the load, the live capacity learned so far, the capacity the settings pick, the decision.

    memory = PlannerMemory(live=LiveCapacity(max_batch=32))
    decision, memory = plan_step(obs, counts, budget, settings, memory, now, profile)
    if decision.act:
        memory = memory.with_state(started(memory.state, decision, now))
        ... carry it out ...
        memory = memory.with_state(finished(memory.state, later, ok))

`profile` is the measured `InstanceProfile` (pdtopo.planner.profile), None without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.capacity import InstanceProfile, LiveCapacity, Slo, select_capacity
from pdtopo.planner.decide import Decision, Load, PlannerState, decide, estimate_load
from pdtopo.planner.observe import Observation
from pdtopo.planner.settings import PlannerSettings


@dataclass(frozen=True)
class PlannerMemory:
    """What the planner carries from one interval to the next."""

    state: PlannerState = field(default_factory=PlannerState)
    live: LiveCapacity = field(default_factory=LiveCapacity)
    load: Load | None = None

    def with_state(self, state: PlannerState) -> PlannerMemory:
        return replace(self, state=state)


def slo_of(settings: PlannerSettings) -> Slo:
    s = settings.slo
    return Slo(s.ttft_ms, s.itl_ms, s.percentile)


def plan_step(obs: Observation, counts: Counts, budget: Budget, settings: PlannerSettings,
              memory: PlannerMemory, now: float, profile: InstanceProfile | None = None
              ) -> tuple[Decision, PlannerMemory]:
    slo = slo_of(settings)
    load = estimate_load(obs, slo, memory.load,
                         peak_half_life_s=settings.hysteresis.min_change_interval_s)
    live = memory.live.update(obs)
    capacity = select_capacity(settings.capacity.source, profile, live, slo,
                               load.mean_prompt_len)
    decision = decide(load, counts, capacity, budget, settings, memory.state, now)
    return decision, replace(memory, live=live, load=load)
