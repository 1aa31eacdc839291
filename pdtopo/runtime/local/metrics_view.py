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

from pdtopo.runtime.engine.metrics import EngineMetrics

SUMMED = ("num_running", "num_queue", "gen_throughput", "free_pages", "total_pages")


class GaugeBoard:
    """Per-engine gauge values, summed into the shared EngineMetrics gauges."""

    def __init__(self, base: EngineMetrics) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, float]] = {g: {} for g in SUMMED}

    def set(self, gauge: str, engine: str, value: float) -> None:
        with self._lock:
            self._values[gauge][engine] = float(value)
            getattr(self.base, gauge).set(sum(self._values[gauge].values()))
            if gauge in ("free_pages", "total_pages"):
                free = sum(self._values["free_pages"].values())
                total = sum(self._values["total_pages"].values())
                self.base.token_usage.set(1.0 - free / total if total else 0.0)


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
        for gauge in SUMMED:
            setattr(self, gauge, _Slot(board, gauge, engine))
        self.token_usage = _Ignored()

    def __getattr__(self, name: str) -> Any:  # histograms, counters, request_finished, render
        return getattr(self._base, name)
