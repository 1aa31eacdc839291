"""Closed-loop client loads through a router, for tests and benchmarks that change a running
deployment under load (drain, scale, the planner): `workers` threads, each sending one
/generate at a time until stopped; every answer is checked (status 200, the asked-for number
of tokens): `ok` counts them, `failures` says what went wrong.

    ClosedLoopLoad    the threads and the checking; a subclass says what to send (`body`)
                      and how long to wait after each answer (`pause`)
    PhasedLoad        a mix that changes while it runs (the planner's test and benchmark):
                      `phase` = prompt (300-token prompts, 2-token answers), decode (8-token
                      prompts, 64-token answers) or trickle (one thread, a short request every
                      0.3 s)
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx


class ClosedLoopLoad:
    """A context manager: the threads start on enter and stop, joined, on exit."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.url = url
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(workers)]

    def body(self, worker: int, n: int) -> tuple[dict[str, Any], int] | None:
        """The n-th request of `worker` and its answer's length (None: send nothing now)."""
        raise NotImplementedError

    def label(self) -> str:
        return ""

    def pause(self) -> float:
        return 0.0

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop_event.is_set():
            made = self.body(i, n)
            if made is None:
                time.sleep(0.2)
                continue
            body, out = made
            n += 1
            prefix = f"{self.label()}: " if self.label() else ""
            try:
                resp = httpx.post(f"{self.url}/generate", json=body, timeout=120)
                good = resp.status_code == 200 and len(resp.json()["output_ids"]) == out
                detail = f"{prefix}{resp.status_code}: {resp.text[:200]}"
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                good, detail = False, f"{prefix}{exc!r}"
            with self.lock:
                if good:
                    self.ok += 1
                else:
                    self.failures.append(detail)
            if self.pause():
                time.sleep(self.pause())

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(150)


class PhasedLoad(ClosedLoopLoad):
    def __init__(self, url: str, workers: int = 4) -> None:
        super().__init__(url, workers)
        self.phase = "prompt"

    def body(self, worker: int, n: int) -> tuple[dict[str, Any], int] | None:
        if self.phase == "trickle" and worker > 0:
            return None
        prompt_len, out = {"prompt": (300, 2), "decode": (8, 64)}.get(self.phase, (16, 8))
        ids = [(7 * (1000 * worker + n) + j) % 200 + 3 for j in range(prompt_len)]
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": out, "temperature": 0,
                                                      "ignore_eos": True}}, out

    def label(self) -> str:
        return self.phase

    def pause(self) -> float:
        return 0.3 if self.phase == "trickle" else 0.0
