"""The `bench` config section as a checked dataclass.

`BenchSettings.from_config(node)` takes the composed `bench` node (DictConfig or dict) and
returns typed settings; every bad value raises `BenchConfigError` naming `bench.<key>` and
the value, before any request is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

ARRIVALS = ("poisson", "fixed")
WORKLOADS = ("synthetic", "multiturn")


class BenchConfigError(ValueError):
    def __init__(self, key: str, value: Any, message: str) -> None:
        self.key, self.value = key, value
        super().__init__(f"bench.{key}={value!r}: {message}")


@dataclass
class Slo:
    ttft_ms: float | None = 2000.0
    itl_ms: float | None = 200.0


@dataclass
class Multiturn:
    """`bench.workload: multiturn`: `system_prompts` shared system prompts of `system_len`
    tokens; `conversations` conversations of `turns` turns each; a turn's prompt is the
    conversation so far (system prompt, earlier user messages and answers) plus a new user
    message of `user_len` tokens."""

    system_prompts: int = 2
    system_len: int = 256
    conversations: int = 8
    turns: int = 3
    user_len: int = 32


@dataclass
class BenchSettings:
    num_requests: int = 64
    warmup_requests: int = 2
    request_rate: float = math.inf
    arrival: str = "poisson"
    max_concurrency: int = 32
    seed: int = 0
    timeout_s: float = 120.0
    input_len: int = 128
    input_len_range: float = 0.0
    output_len: int = 32
    output_len_range: float = 0.0
    token_id_range: tuple[int, int] = (32, 127)
    dataset: str | None = None
    workload: str = "synthetic"
    multiturn: Multiturn = field(default_factory=Multiturn)
    ignore_eos: bool = True
    temperature: float = 0.0
    slo: Slo = field(default_factory=Slo)
    progress: bool = True
    output: str | None = None

    @classmethod
    def from_config(cls, node: DictConfig | dict | None) -> BenchSettings:
        data: dict[str, Any] = {}
        if node is not None:
            raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
                else dict(node)
            data = dict(raw)  # type: ignore[arg-type]
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise BenchConfigError(key, data[key], f"unknown key; known: {sorted(known)}")
        slo = data.pop("slo", None) or {}
        if not isinstance(slo, dict) or set(slo) - {"ttft_ms", "itl_ms"}:
            raise BenchConfigError("slo", slo, "expected {ttft_ms: ms|null, itl_ms: ms|null}")
        turns = data.pop("multiturn", None) or {}
        mt_keys = {f.name for f in fields(Multiturn)}
        if not isinstance(turns, dict) or set(turns) - mt_keys:
            raise BenchConfigError("multiturn", turns, f"expected a mapping of {sorted(mt_keys)}")
        out = cls(**{k: v for k, v in data.items()})
        out.multiturn = Multiturn(**{k: _int(f"multiturn.{k}", v, 1) for k, v in turns.items()})
        out.slo = Slo(**{k: (None if v is None else _num(f"slo.{k}", v, 0.0)) for k, v in slo.items()})
        out._check()
        return out

    def _check(self) -> None:
        self.num_requests = _int("num_requests", self.num_requests, 1)
        self.warmup_requests = _int("warmup_requests", self.warmup_requests, 0)
        self.max_concurrency = _int("max_concurrency", self.max_concurrency, 1)
        self.seed = _int("seed", self.seed, 0)
        self.input_len = _int("input_len", self.input_len, 1)
        self.output_len = _int("output_len", self.output_len, 1)
        rate = math.inf if self.request_rate in (None, "inf", "Infinity") else self.request_rate
        self.request_rate = _num("request_rate", rate, 0.0)
        if self.request_rate <= 0:
            raise BenchConfigError("request_rate", rate, "must be > 0 (or inf)")
        if self.arrival not in ARRIVALS:
            raise BenchConfigError("arrival", self.arrival, f"expected one of {ARRIVALS}")
        self.timeout_s = _num("timeout_s", self.timeout_s, 0.001)
        for key in ("input_len_range", "output_len_range"):
            val = _num(key, getattr(self, key), 0.0)
            if val >= 1.0:
                raise BenchConfigError(key, val, "must be in [0, 1)")
            setattr(self, key, val)
        ids = self.token_id_range
        if not (isinstance(ids, (list, tuple)) and len(ids) == 2
                and all(isinstance(i, int) for i in ids) and 0 <= ids[0] < ids[1]):
            raise BenchConfigError("token_id_range", ids, "expected [low, high) with 0 <= low < high")
        self.token_id_range = (int(ids[0]), int(ids[1]))
        self.temperature = _num("temperature", self.temperature, 0.0)
        if self.workload not in WORKLOADS:
            raise BenchConfigError("workload", self.workload, f"expected one of {WORKLOADS}")
        if self.workload == "multiturn" and self.dataset:
            raise BenchConfigError("workload", self.workload,
                                   f"a multiturn workload is generated: it cannot be combined "
                                   f"with bench.dataset={self.dataset!r} (drop one of them)")

    @property
    def num_workload_requests(self) -> int:
        """Requests of the measured run: num_requests, or conversations x turns (multiturn)."""
        if self.workload == "multiturn":
            return self.multiturn.conversations * self.multiturn.turns
        return self.num_requests

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["slo"] = {"ttft_ms": self.slo.ttft_ms, "itl_ms": self.slo.itl_ms}
        out["multiturn"] = {f.name: getattr(self.multiturn, f.name) for f in fields(Multiturn)}
        out["token_id_range"] = list(self.token_id_range)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


def _int(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BenchConfigError(key, value, f"expected an integer >= {low}")
    return value


def _num(key: str, value: Any, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low \
            or math.isnan(value):
        raise BenchConfigError(key, value, f"expected a number >= {low}")
    return float(value)
