"""Fault injection for the KV data plane (`disaggregation.fault_injection_prob`).

`FaultInjector(prob, seed).check(what)` raises `InjectedTransferFault` with probability `prob`
(seeded RNG, thread-safe), so an injected fault travels exactly the path of a real failure.
"""

from __future__ import annotations

import random
import threading

from pdtopo.config.settings import check_value
from pdtopo.runtime.disagg.transport.base import KVTransferError


class InjectedTransferFault(KVTransferError):
    """A transfer failure injected on purpose (fault_injection_prob > 0)."""


class FaultInjector:
    def __init__(self, prob: float = 0.0, seed: int = 0) -> None:
        self.prob = check_value("disaggregation.fault_injection_prob", prob)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = 0

    def check(self, what: str) -> None:
        if self.prob <= 0.0:
            return
        with self._lock:
            hit = self._rng.random() < self.prob
            if hit:
                self.injected += 1
        if hit:
            raise InjectedTransferFault(
                f"injected transfer fault in {what} (fault_injection_prob={self.prob})",
                status=500)
