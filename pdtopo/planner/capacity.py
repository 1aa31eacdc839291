"""What one instance can serve within the SLOs (pure).

An `InstanceProfile` is what an instance does flat out: a P's prompt tokens/s, a D's decode
tokens/s at measured batch sizes (hence its step time per batch size), its batch cap and the
KV transfer per prompt token. It comes from a measurement (pdtopo.planner.profile reads a
`pdtopo tune` result dir or a profile JSON) or from the live metrics (`LiveCapacity`).

`capacity_from_profile(profile, slo, prompt_len)` turns it into the per-instance `Capacity`
the decision counts in, each role in tokens/s:

- prefill: the prompt tokens/s at the highest utilisation at which the TTFT percentile stays
  within the SLO. A P is a queue with service time S = prompt_len / prefill_tps; its TTFT at
  the q-th percentile is taken as S + tail(q) * rho * S / (2 (1 - rho)) (the M/D/1 mean wait,
  times the exponential tail's -ln(1 - q)), within T = ttft_ms less the KV transfer. Solving
  for rho gives a / (1 + a), a = 2 (T - S) / (tail(q) S), kept in [MIN_UTILIZATION,
  MAX_UTILIZATION] (no TTFT limit: MAX_UTILIZATION).
- decode: the tokens/s of the largest batch (up to the cap) whose step time is within the ITL
  limit, times DECODE_UTILIZATION (a batch's size varies around its mean).

`LiveCapacity` learns a profile from observations: a P's prompt tokens/s over windows it was
busy throughout (requests waiting at both scrapes; a higher rate when not busy raises it too),
a D's step time (ITL p50) at the batch sizes it ran. `select_capacity(source, ...)` picks per
role: live, the profile, or auto (live once measured, the profile until then), and says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdtopo.planner.observe import Observation

MAX_UTILIZATION = 0.9     # of a P's prompt tokens/s, whatever the SLO allows
MIN_UTILIZATION = 0.05    # an SLO at or below the bare prefill time still counts this much
DECODE_UTILIZATION = 0.9  # of a D's tokens/s at the largest batch within the ITL limit
LIVE_POINTS = 32          # (batch, step) points a live estimate keeps
LIVE_SMOOTHING = 0.5      # weight of a new busy window in the live prefill rate
DEFAULT_MAX_BATCH = 32    # a D's batch cap when neither profile nor caller says (the engine's)


@dataclass(frozen=True)
class Slo:
    """The planner's limits (planner.slo): ms, None for no limit; `percentile` 50 | 90 | 99."""

    ttft_ms: float | None
    itl_ms: float | None
    percentile: int = 90


@dataclass(frozen=True)
class InstanceProfile:
    """One instance flat out. `decode_tps`: (batch size, tokens/s of one D at that batch),
    ascending by batch. Step time between two measured batch sizes is interpolated linearly;
    below the first it is the first's; above the last, extended along the last two points (one
    point: tokens/s stays flat, the cautious reading)."""

    prefill_tps: float
    decode_tps: tuple[tuple[int, float], ...]
    max_batch: int
    transfer_s_per_token: float = 0.0
    chips: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        if not self.prefill_tps > 0 or not self.decode_tps or self.max_batch < 1 \
                or any(b < 1 or not tps > 0 for b, tps in self.decode_tps):
            raise ValueError(f"not a usable instance profile: {self}")

    def step_s(self, batch: float) -> float:
        pts = [(float(b), b / tps) for b, tps in sorted(self.decode_tps)]
        if batch <= pts[0][0]:
            return pts[0][1]
        if len(pts) == 1:
            return pts[0][1] * batch / pts[0][0]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):  # noqa: B905
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return max(t1, t1 + (t1 - t0) * (batch - b1) / (b1 - b0))

    def decode_rate(self, batch: float) -> float:
        return batch / self.step_s(batch)

    def to_dict(self) -> dict:
        return {"prefill_tps": self.prefill_tps,
                "decode_tps": [list(p) for p in self.decode_tps], "max_batch": self.max_batch,
                "transfer_s_per_token": self.transfer_s_per_token, "chips": self.chips,
                "source": self.source}


@dataclass(frozen=True)
class RoleCapacity:
    tokens_per_s: float   # one instance, within the SLO
    source: str           # profile | live
    detail: str           # how it was derived, for the log


@dataclass(frozen=True)
class Capacity:
    prefill: RoleCapacity | None
    decode: RoleCapacity | None

    def of(self, role: str) -> RoleCapacity | None:
        return self.prefill if role == "prefill" else self.decode

    @property
    def source(self) -> str:
        """e.g. "prefill=live decode=profile" ("none" for a role without an estimate)."""
        return " ".join(f"{r}={c.source if c else 'none'}"
                        for r, c in (("prefill", self.prefill), ("decode", self.decode)))

    def to_dict(self) -> dict:
        return {r: None if c is None else {"tokens_per_s": c.tokens_per_s, "source": c.source,
                                           "detail": c.detail}
                for r, c in (("prefill", self.prefill), ("decode", self.decode))}


def tail(percentile: int) -> float:
    return -math.log(1 - percentile / 100)


def prefill_utilization(service_s: float, limit_s: float | None, percentile: int) -> float:
    if limit_s is None:
        return MAX_UTILIZATION
    if limit_s <= service_s:
        return MIN_UTILIZATION
    a = 2 * (limit_s - service_s) / (tail(percentile) * service_s)
    return min(MAX_UTILIZATION, max(MIN_UTILIZATION, a / (1 + a)))


def prefill_capacity(profile: InstanceProfile, slo: Slo, prompt_len: float | None,
                     source: str) -> RoleCapacity:
    if not prompt_len:
        return RoleCapacity(profile.prefill_tps * MAX_UTILIZATION, source,
                            f"{MAX_UTILIZATION:.0%} of {profile.prefill_tps:.0f} tok/s "
                            "(no prompt length seen yet)")
    service = prompt_len / profile.prefill_tps
    limit = None if slo.ttft_ms is None else \
        slo.ttft_ms / 1e3 - profile.transfer_s_per_token * prompt_len
    u = prefill_utilization(service, limit, slo.percentile)
    return RoleCapacity(profile.prefill_tps * u, source,
                        f"{u:.0%} of {profile.prefill_tps:.0f} tok/s for {prompt_len:.0f}-token "
                        f"prompts (TTFT p{slo.percentile} <= {slo.ttft_ms} ms)")


def decode_capacity(profile: InstanceProfile, slo: Slo, source: str) -> RoleCapacity:
    batch = profile.max_batch
    if slo.itl_ms is not None:
        limit = slo.itl_ms / 1e3
        while batch > 1 and profile.step_s(batch) > limit:
            batch -= 1
    tps = profile.decode_rate(batch) * DECODE_UTILIZATION
    within = "" if slo.itl_ms is None or profile.step_s(batch) <= slo.itl_ms / 1e3 \
        else ", over the ITL limit even alone"
    return RoleCapacity(tps, source, f"batch {batch} at {profile.step_s(batch) * 1e3:.1f} ms "
                        f"a step (ITL <= {slo.itl_ms} ms){within}, {DECODE_UTILIZATION:.0%} "
                        f"of {profile.decode_rate(batch):.0f} tok/s")


def capacity_from_profile(profile: InstanceProfile, slo: Slo, prompt_len: float | None,
                          source: str = "profile") -> Capacity:
    return Capacity(prefill_capacity(profile, slo, prompt_len, source),
                    decode_capacity(profile, slo, source))


@dataclass(frozen=True)
class LiveCapacity:
    """What the metrics have shown so far: a P's busy prompt tokens/s (None: never seen
    busy) and recent (batch, step seconds) points of the D instances."""

    prefill_tps: float | None = None
    decode_points: tuple[tuple[float, float], ...] = ()
    max_batch: int | None = None  # the D's batch cap (engine.max_running_requests), if known

    def update(self, obs: Observation) -> LiveCapacity:
        rate = self.prefill_tps
        for p in obs.of("prefill"):
            if p.busy and p.prompt_tps > 0:
                rate = p.prompt_tps if rate is None else \
                    (1 - LIVE_SMOOTHING) * rate + LIVE_SMOOTHING * p.prompt_tps
            elif rate is not None and p.prompt_tps > rate:
                rate = p.prompt_tps
        points = list(self.decode_points)
        for d in obs.of("decode"):
            step = d.latency("itl", 50)
            if d.running >= 1 and step and d.decode_tps > 0:
                points.append((d.running, step / 1e3))
        return replace(self, prefill_tps=rate, decode_points=tuple(points[-LIVE_POINTS:]))

    @property
    def decode_measured(self) -> bool:
        """Two batch sizes seen (a slope), or one at the batch cap."""
        sizes = {round(b) for b, _ in self.decode_points}
        return len(sizes) >= 2 or (self.max_batch is not None and bool(sizes)
                                   and max(sizes) >= self.max_batch)

    def profile(self, fallback_batch: int) -> InstanceProfile | None:
        """The live numbers as a profile (steps averaged per batch size and kept
        non-decreasing); None before any D point."""
        if not self.decode_points:
            return None
        by_size: dict[int, list[float]] = {}
        for b, step in self.decode_points:
            by_size.setdefault(max(1, round(b)), []).append(step)
        pts, worst = [], 0.0
        for b in sorted(by_size):
            worst = max(worst, sum(by_size[b]) / len(by_size[b]))
            pts.append((b, b / worst))
        return InstanceProfile(prefill_tps=self.prefill_tps or 1.0, decode_tps=tuple(pts),
                               max_batch=self.max_batch or fallback_batch, source="live")


def select_capacity(source: str, profile: InstanceProfile | None, live: LiveCapacity,
                    slo: Slo, prompt_len: float | None) -> Capacity:
    """Per role: `live`, `profile`, or `auto` (live where it has measured, else the profile,
    else live's cautious reading). A role with neither has no capacity (None)."""
    base = capacity_from_profile(profile, slo, prompt_len) if profile is not None else None
    live_p = None
    if live.prefill_tps is not None:  # only a P's rate matters to its capacity
        busy = InstanceProfile(live.prefill_tps, ((1, 1.0),), 1, source="live")
        live_p = prefill_capacity(busy, slo, prompt_len, "live")
    measured = live.profile(profile.max_batch if profile is not None else DEFAULT_MAX_BATCH)
    live_d = decode_capacity(measured, slo, "live") if measured is not None else None
    if source == "profile":
        return base or Capacity(None, None)
    if source == "live":
        return Capacity(live_p, live_d)
    return Capacity(live_p or (base.prefill if base else None),
                    (live_d if live.decode_measured else None) or (base.decode if base else None)
                    or live_d)
