"""The live P/D planner's pure core (issue 49): from what the instances' /metrics show and
what one instance can serve (a profile, or the live metrics), the P and D counts that meet the
SLOs within a chip budget, one change at a time, with hysteresis; and a discrete-event
simulator of a PD deployment that runs the same decision code.

    settings.py  the `planner` config node (conf/planner/default.yaml), typed and checked
    budget.py    Counts, Budget: what the planner may hold
    observe.py   /metrics text -> MetricsSample; two of them -> InstanceObservation;
                 Observation: every instance over one interval
    capacity.py  InstanceProfile (a measured instance), Capacity within the SLOs, LiveCapacity
    profile.py   a profile on disk: a `pdtopo tune` result dir or a profile JSON
    decide.py    Load, PlannerState, Decision; estimate_load, decide, started, finished
    step.py      PlannerMemory, plan_step: one interval end to end
    trace.py     phased request traces (seeded)
    simulate.py  the simulator; compare.py static splits against the planner

Nothing here starts, stops or scrapes a process: the planner program does that with these.
"""
