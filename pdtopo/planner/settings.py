"""The `planner` config node as typed settings (an OmegaConf structured config, every field
`MISSING`: the defaults are conf/planner/default.yaml's).

`PlannerSettings.from_config(node, *more)` merges the composed `planner` node (and any partial
nodes after it) onto the schema through pdtopo.config.settings, which type-checks every value,
refuses unknown keys and applies the `planner.*` RULES; then the bounds are checked against each
other (min <= max) and `capacity.source=profile` must name a profile. Every bad value raises
`TopologyError` naming `planner.<key>` and the value, before anything starts.
`PlannerSettings.with_defaults(values)` is conf's defaults with `values` merged on (tests and
the simulator build settings this way, no default repeated in Python).

`settings.budget(host_chips, prefill_chips, decode_chips)` is the `Budget` the decision core
checks every target against: the chips the planner may hold (`chips` per host, or every chip
of the hosts), the chips one instance of each role holds, and the instance bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omegaconf import MISSING, DictConfig

from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import conf_defaults, typed_settings
from pdtopo.planner.budget import Budget

ROLES = ("prefill", "decode")


@dataclass
class RoleBounds:
    min: int = MISSING          # never fewer instances of the role (>= 1)
    max: int | None = MISSING   # never more (null: as many as the budget holds)


@dataclass
class PlannerSlo:
    """The limits of `bench.slo` (by default the same values) and the share of requests they
    must hold for: `percentile` 90 means the p90 TTFT and the p90 ITL."""

    ttft_ms: float | None = MISSING
    itl_ms: float | None = MISSING
    percentile: int = MISSING


@dataclass
class Hysteresis:
    min_change_interval_s: float = MISSING
    margin: float = MISSING
    backoff_s: float = MISSING


@dataclass
class CapacitySettings:
    source: str = MISSING          # live | profile | auto
    profile: str | None = MISSING  # a tune dir or a profile JSON (pdtopo/planner/profile.py)


@dataclass
class PlannerSettings:
    enabled: bool = MISSING
    mode: str = MISSING            # act | recommend
    interval_s: float = MISSING
    chips: int | None = MISSING    # per host (null: every chip of the topology's hosts)
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    slo: PlannerSlo = field(default_factory=PlannerSlo)
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    capacity: CapacitySettings = field(default_factory=CapacitySettings)

    @classmethod
    def from_config(cls, node: DictConfig | dict | None, *more: DictConfig | dict
                    ) -> PlannerSettings:
        """Typed, checked settings of a whole `planner` node (`more`: partial nodes on top)."""
        s = typed_settings(cls, "planner", node, *more)
        for role in ROLES:
            bounds = getattr(s, role)
            if bounds.max is not None and bounds.max < bounds.min:
                raise TopologyError(f"planner.{role}.max", bounds.max,
                                    f"must be >= planner.{role}.min ({bounds.min})")
        if s.capacity.source == "profile" and not s.capacity.profile:
            raise TopologyError("planner.capacity.profile", s.capacity.profile,
                                "capacity.source=profile needs a profile: a `pdtopo tune` "
                                "result dir or a planner profile JSON")
        return s

    @classmethod
    def with_defaults(cls, values: DictConfig | dict | None = None) -> PlannerSettings:
        """conf's `planner` defaults with `values` (a partial node) merged on."""
        return cls.from_config(conf_defaults("planner"), values or {})

    def budget(self, host_chips: Sequence[int], prefill_chips: int = 1,
               decode_chips: int = 1) -> Budget:
        """The budget on hosts of `host_chips` chips each, for instances of `prefill_chips` /
        `decode_chips` chips: `chips` per host (capped at what a host has), summed."""
        per_host = [c if self.chips is None else min(c, self.chips) for c in host_chips]
        return Budget(chips=sum(per_host), prefill_chips=prefill_chips,
                      decode_chips=decode_chips, min_prefill=self.prefill.min,
                      max_prefill=self.prefill.max, min_decode=self.decode.min,
                      max_decode=self.decode.max)
