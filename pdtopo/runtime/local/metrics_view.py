"""Per-engine views of the process's one `EngineMetrics` (one Prometheus registry per process).

Every engine of a local process runs the ordinary scheduler, which sets the gauges
(num_running, free_pages, ...) after each step: with several engines they would overwrite each
other. `EngineMetricsView` hands an engine the shared histograms and counters unchanged and
gives it private gauge slots; each `set()` stores the engine's value and republishes the process
gauge as the sum over engines (token_usage: from the summed pages). Gauges are set under one
lock; prometheus-client metrics are thread-safe themselves.
"""

from __future__ import annotations

import threading
from typing import Any

from pdtopo.runtime.engine.metrics import HOST_COUNTERS, EngineMetrics

SUMMED = ("num_running", "num_queue", "gen_throughput", "free_pages", "total_pages",
          "tree_pages", "evictable_pages", "host_pages", "host_capacity")
_HIT_COUNTS = ("cache_cached", "cache_looked_up")  # per engine, for the process's hit rate


class GaugeBoard:
    """Per-engine gauge values, summed into the shared EngineMetrics gauges."""

    def __init__(self, base: EngineMetrics) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, float]] = {g: {} for g in SUMMED + _HIT_COUNTS}

    def set(self, gauge: str, engine: str, value: float) -> None:
        with self._lock:
            self._values[gauge][engine] = float(value)
            getattr(self.base, gauge).set(sum(self._values[gauge].values()))
            if gauge in ("free_pages", "total_pages", "evictable_pages"):
                free = sum(self._values["free_pages"].values())
                total = sum(self._values["total_pages"].values())
                evictable = sum(self._values["evictable_pages"].values())
                self.base.token_usage.set(max(0.0, 1.0 - (free + evictable) / total)
                                          if total else 0.0)

    def set_cache_hits(self, engine: str, cached: int, looked_up: int) -> None:
        """The process's hit rate from every engine's prompt tokens (cached / looked up)."""
        with self._lock:
            self._values["cache_cached"][engine] = float(cached)
            self._values["cache_looked_up"][engine] = float(looked_up)
            self.base.set_cache_hits(sum(self._values["cache_cached"].values()),
                                     sum(self._values["cache_looked_up"].values()))


class _Slot:
    def __init__(self, board: GaugeBoard, gauge: str, engine: str) -> None:
        self._board, self._gauge, self._engine = board, gauge, engine

    def set(self, value: float) -> None:
        self._board.set(self._gauge, self._engine, value)


class _Ignored:
    def set(self, value: float) -> None:  # token_usage: derived by GaugeBoard
        pass


class EngineMetricsView:
    """Looks like `EngineMetrics` to one engine's scheduler."""

    def __init__(self, board: GaugeBoard, engine: str) -> None:
        self._base = board.base
        self._board, self._engine = board, engine
        for gauge in SUMMED:
            setattr(self, gauge, _Slot(board, gauge, engine))
        self.token_usage = _Ignored()
        self._host_seen = dict.fromkeys(HOST_COUNTERS, 0)

    # the gauges go to this engine's slots, the counters grow by this engine's own deltas
    set_host_tier = EngineMetrics.set_host_tier

    def set_cache_hits(self, cached: int, looked_up: int) -> None:
        self._board.set_cache_hits(self._engine, cached, looked_up)

    def __getattr__(self, name: str) -> Any:  # histograms, counters, request_finished, render
        return getattr(self._base, name)
