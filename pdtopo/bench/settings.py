"""The `bench` config node as typed settings (an OmegaConf structured config, every field
`MISSING`: the defaults are conf/bench/default.yaml's).

`BenchSettings.from_config(node, *more)` merges the composed `bench` node (and any partial
nodes after it) onto the schema through pdtopo.config.settings, which type-checks every value,
refuses unknown keys and applies the `bench.*` RULES; then `request_rate` null becomes inf,
`token_id_range` a tuple, and the fields are checked against each other. Every bad value raises
`TopologyError` naming `bench.<key>` and the value, before any request is sent.
`BenchSettings.with_defaults(values)` is conf's defaults with `values` merged on (tests and
benchmarks build settings this way, no default repeated in Python).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig

from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import conf_defaults, typed_settings


@dataclass
class Slo:
    """Goodput counts the requests within both limits (null: no limit)."""

    ttft_ms: float | None = MISSING
    itl_ms: float | None = MISSING  # per-request p99 inter-token latency


@dataclass
class Multiturn:
    """`bench.workload: multiturn`: `system_prompts` shared system prompts of `system_len`
    tokens; `conversations` conversations of `turns` turns each; a turn's prompt is the
    conversation so far (system prompt, earlier user messages and answers) plus a new user
    message of `user_len` tokens."""

    system_prompts: int = MISSING
    system_len: int = MISSING
    conversations: int = MISSING
    turns: int = MISSING
    user_len: int = MISSING


@dataclass
class BenchSettings:
    num_requests: int = MISSING
    warmup_requests: int = MISSING
    request_rate: float | None = MISSING  # null (or "inf") is inf after from_config
    arrival: str = MISSING
    max_concurrency: int = MISSING
    seed: int = MISSING
    timeout_s: float = MISSING
    input_len: int = MISSING
    input_len_range: float = MISSING
    output_len: int = MISSING
    output_len_range: float = MISSING
    token_id_range: tuple[int, int] = MISSING
    dataset: str | None = MISSING
    workload: str = MISSING
    multiturn: Multiturn = field(default_factory=Multiturn)
    ignore_eos: bool = MISSING
    temperature: float = MISSING
    slo: Slo = field(default_factory=Slo)
    progress: bool = MISSING
    output: str | None = MISSING

    @classmethod
    def from_config(cls, node: DictConfig | dict | None, *more: DictConfig | dict
                    ) -> BenchSettings:
        """Typed, checked settings of a whole `bench` node (`more`: partial nodes on top)."""
        s = typed_settings(cls, "bench", node, *more)
        if s.request_rate is None:
            s.request_rate = math.inf
        s.token_id_range = tuple(s.token_id_range)
        if s.workload == "multiturn" and s.dataset:
            raise TopologyError("bench.workload", s.workload,
                                f"a multiturn workload is generated: it cannot be combined "
                                f"with bench.dataset={s.dataset!r} (drop one of them)")
        return s

    @classmethod
    def with_defaults(cls, values: DictConfig | dict | None = None) -> BenchSettings:
        """conf's `bench` defaults with `values` (a partial node) merged on."""
        return cls.from_config(conf_defaults("bench"), values or {})

    @property
    def num_workload_requests(self) -> int:
        """Requests of the measured run: num_requests, or conversations x turns (multiturn,
        chat)."""
        if self.workload in ("multiturn", "chat"):
            return self.multiturn.conversations * self.multiturn.turns
        return self.num_requests

    def to_dict(self) -> dict[str, Any]:
        """The settings as the metrics JSON records them (plain JSON values)."""
        out = asdict(self)
        out["token_id_range"] = list(self.token_id_range)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out
