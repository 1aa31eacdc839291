"""The `tune` config node as a checked dataclass.

`TuneSettings.from_config(node)` returns typed settings; a bad value raises `TuneConfigError`
naming `tune.<key>` and the value, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf


class TuneConfigError(ValueError):
    def __init__(self, key: str, value: Any, message: str) -> None:
        self.key, self.value = key, value
        super().__init__(f"tune.{key}={value!r}: {message}")


@dataclass(frozen=True)
class TuneSettings:
    chips: int | None = None          # the budget (null: every chip of the topology's hosts)
    goodput_target: float = 0.9       # fraction of requests within bench.slo at a passing rate
    start_rate: float = 1.0           # requests/s of the first run of every candidate
    growth: float = 2.0               # rate factor while runs pass
    precision: float = 0.1            # bisect until (fail - pass) / fail is below this
    max_runs_per_candidate: int = 6
    max_candidates: int = 12
    dry_run: bool = False             # list candidates with their plans, start nothing
    dir: str = "tune"                 # results (stable across reruns: resumable)
    kinds: tuple[str, ...] = ("colocated", "dp", "pd")  # which families of candidates

    @classmethod
    def from_config(cls, node: DictConfig | dict | None) -> TuneSettings:
        data: dict[str, Any] = {}
        if node is not None:
            raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
                else dict(node)
            data = dict(raw)  # type: ignore[arg-type]
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise TuneConfigError(key, data[key], f"unknown key; known: {sorted(known)}")
        if "kinds" in data:
            kinds = data["kinds"]
            data["kinds"] = (kinds,) if isinstance(kinds, str) else tuple(kinds or ())
        for key, kind in (("goodput_target", float), ("start_rate", float), ("growth", float),
                          ("precision", float), ("max_runs_per_candidate", int),
                          ("max_candidates", int)):
            if key in data:
                value = data[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                        (kind is int and not float(value).is_integer()):
                    raise TuneConfigError(key, value, f"must be a number"
                                          f"{' (a whole one)' if kind is int else ''}")
                data[key] = kind(value)
        if "chips" in data and data["chips"] is not None and (
                isinstance(data["chips"], bool) or not isinstance(data["chips"], int)):
            raise TuneConfigError("chips", data["chips"], "a positive number of chips, or null")
        s = cls(**data)
        s.check()
        return s

    def check(self) -> None:
        if self.chips is not None and (not isinstance(self.chips, int) or self.chips < 1):
            raise TuneConfigError("chips", self.chips, "a positive number of chips, or null")
        if not 0 < self.goodput_target <= 1:
            raise TuneConfigError("goodput_target", self.goodput_target, "must be in (0, 1]")
        if not self.start_rate > 0:
            raise TuneConfigError("start_rate", self.start_rate, "must be > 0 requests/s")
        if not self.growth > 1:
            raise TuneConfigError("growth", self.growth, "must be > 1")
        if not 0 < self.precision < 1:
            raise TuneConfigError("precision", self.precision, "must be in (0, 1)")
        if self.max_runs_per_candidate < 1:
            raise TuneConfigError("max_runs_per_candidate", self.max_runs_per_candidate,
                                  "must be at least 1")
        if self.max_candidates < 1:
            raise TuneConfigError("max_candidates", self.max_candidates, "must be at least 1")
        bad = [k for k in self.kinds if k not in ("colocated", "dp", "pd")]
        if bad or not self.kinds:
            raise TuneConfigError("kinds", list(self.kinds),
                                  "a non-empty list of colocated, dp, pd")
        if not str(self.dir):
            raise TuneConfigError("dir", self.dir, "a directory path")
