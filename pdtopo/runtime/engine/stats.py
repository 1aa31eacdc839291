"""The scheduler's counters and the stats snapshot other threads read (`StatsMixin`, mixed into
the `Scheduler` like overlap.py).

Data flow. The scheduler thread bumps the counters as it works (`num_forward`,
`num_generated`, ...) and calls `publish_stats()` once per step: one dict built from the
counters, the queues, the pool (kv_pages.py), the runner's attention path (`attention`, e.g.
"gather (pallas refused: ...)": attention_fallback.py) and the role mixins' `extra_stats()`,
swapped in under a lock, and the Prometheus gauges (metrics.py) set from it. HTTP handlers read the
latest dict with `stats()` (/pdtopo/state, /get_load).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from pdtopo.runtime.engine.attention_fallback import AttentionPath, attention_label

EVICTABLE_REFRESH_S = 0.5  # how often a busy scheduler recounts the pages only its cache holds


def token_usage(stats: dict[str, Any]) -> float:
    """sglang's `token_usage`: the share of the pool requests hold. Pages only the prefix cache
    holds do not count (they are free on demand): a P with a warm cache is not a busy P, and
    routers that leave out workers above a usage ceiling must not see it as one."""
    total = max(1, stats["total_pages"])
    return max(0.0, (total - stats["free_pages"] - stats.get("evictable_pages", 0)) / total)


class StatsMixin:
    """Counters and the published snapshot; the Scheduler provides the rest (`pages`,
    `running`, `waiting`, `reqs`, `metrics`, ...)."""

    def init_stats(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self.num_forward = 0
        self.num_generated = 0
        self.num_prefill_tokens = 0
        self.num_mixed_steps = 0      # steps that carried decodes and prompt chunks together
        self.num_decode_steps = 0     # decode-only steps run (synchronous, launched or ahead)
        self.num_overlapped_steps = 0  # of which dispatched before the previous one landed
        self.num_preemptions = 0
        self.num_cached_tokens = 0    # prompt tokens whose KV came from the prefix cache
        self._tput_window: deque[tuple[float, int]] = deque()
        self._evictable: tuple[float, int] = (-1e9, 0)  # (when counted, tree-only pages)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return dict(self._stats)

    def _evictable_pages(self, now: float) -> int:
        """Pages only the prefix cache holds (it frees them on demand). With no request alive
        that is the whole tree; otherwise the count walks the tree, so it is refreshed at most
        every EVICTABLE_REFRESH_S (a load signal, read by routers every few seconds)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        if not self.reqs:
            self._evictable = (now, cache.num_pages)
        elif now - self._evictable[0] >= EVICTABLE_REFRESH_S:
            self._evictable = (now, cache.num_evictable())
        return min(self._evictable[1], cache.num_pages)

    def attention_paths(self) -> list[AttentionPath]:
        """The attention the runner serves with (after warmup: the kernel, or the gather path
        auto fell back to); empty for a runner that does not say."""
        path = getattr(self.runner, "attention_path", None)
        return [path()] if path is not None else []

    def extra_stats(self) -> dict[str, Any]:
        """More counters for the same snapshot (the PD mixins add theirs)."""
        return {}

    def publish_stats(self) -> None:
        now = time.monotonic()
        win = self._tput_window
        win.append((now, self.num_generated))
        while len(win) > 2 and now - win[0][0] > 5.0:
            win.popleft()
        dt = now - win[0][0]
        tput = (self.num_generated - win[0][1]) / dt if dt > 0 else 0.0
        num_tokens = sum(r.seq_len for r in self.running) + sum(r.seq_len for r in self.waiting)
        evictable = self._evictable_pages(now)
        stats = {
            "free_pages": self.allocator.num_free,
            "total_pages": self.allocator.num_total,
            "page_size": self.page_size,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_reqs": len(self.reqs),
            "num_tokens": num_tokens,
            "num_forward": self.num_forward,
            "num_generated": self.num_generated,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_mixed_steps": self.num_mixed_steps,
            "num_decode_steps": self.num_decode_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
            "num_preemptions": self.num_preemptions,
            "prefix_cache": self.prefix_cache is not None,
            "tree_pages": self.prefix_cache.num_pages if self.prefix_cache is not None else 0,
            "cached_tokens": self.num_cached_tokens,
            "evicted_pages": self.prefix_cache.num_evicted if self.prefix_cache is not None else 0,
            "evictable_pages": evictable,
            **self.pages.host_stats(),
            # checked only when idle, and again only after the pool changed (the full check
            # runs in tests at any time)
            "page_problems": None if self.reqs else self.pages.idle_problems(),
            "gen_throughput": tput,
            "alive": self.alive,
            "attention": attention_label(self.attention_paths()),
            **self.extra_stats(),
        }
        with self._stats_lock:  # one replacement: a reader never sees half of a snapshot
            self._stats = stats
        m = self.metrics
        m.num_running.set(stats["num_running"])
        m.num_queue.set(stats["num_waiting"])
        m.gen_throughput.set(tput)
        m.free_pages.set(stats["free_pages"])
        m.total_pages.set(stats["total_pages"])
        m.token_usage.set(token_usage(stats))
        m.tree_pages.set(stats["tree_pages"])
        m.set_host_tier(stats)
        m.evictable_pages.set(stats["evictable_pages"])
        m.set_cache_hits(self.num_cached_tokens, self.num_cached_tokens + self.num_prefill_tokens)
