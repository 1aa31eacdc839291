"""`pdtopo tune`: goodput-constrained search over the topologies a chip budget allows.

settings.py (the `tune` config node) -> candidates.py (pure: which topologies, as overrides,
validated by the planner) -> search.py (pure: the highest rate that meets the goodput target)
-> store.py (results on disk, resumable) -> run.py (launch, bench, stop per candidate) ->
report.py (ranking, summary files, best topology file and its diff).
"""
