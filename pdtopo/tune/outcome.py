"""What `pdtopo tune` learned about one candidate: its planner verdict, its result-store key,
the rate search, the launch time or error, and the stored run of every rate measured.

pdtopo.tune.run fills one `Outcome` per candidate while it searches; pdtopo.tune.report reads
them into the ranking (a module of its own, so the report needs nothing from the run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdtopo.tune.candidates import Checked
from pdtopo.tune.search import SearchResult


@dataclass
class Outcome:
    """What tune learned about one candidate."""

    checked: Checked
    key: str = ""
    search: SearchResult | None = None
    launch_s: float | None = None
    error: str | None = None
    records: dict[float, dict[str, Any]] = field(default_factory=dict)  # rate -> stored run
