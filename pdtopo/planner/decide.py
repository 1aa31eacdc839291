"""The planner's decision: from one interval's load, the per-instance capacity, the current
counts, the budget and the hysteresis state to one `Decision` (pure: no I/O, no clock).

    load = estimate_load(obs, slo, previous_load, peak_half_life_s)
    decision = decide(load, counts, capacity, budget, settings, state, now)
    state = started(state, decision, now)        # when the caller acts on it
    state = finished(state, now, ok=True)        # when the action is done (ok=False: failed)

The load of the next interval, per role in tokens/s: what the instances processed in the last
one plus the backlog spread over BACKLOG_INTERVALS intervals (requests waiting x mean prompt /
output length, from tokens and requests finished). `needed[role]` = load / one instance's
capacity (fractional instances). With n instances of a role and the margin m:

- over:  needed > n (1 + m), or the role's latency percentile is past the SLO (P: TTFT while
         requests wait there; D: ITL): it needs one more;
- slack: n > its minimum and the recent peak's needed < (n - 1)(1 - m): it can give one up
         (the peak halves every hysteresis.min_change_interval_s unless the load comes back:
         a burst between two quiet windows does not read as slack);
- spare: n > its minimum, needed < n - 1 and no SLO pressure: one fewer still serves the
         current load within the SLO (no margin: the other role is past its own).

One change at a time, the most loaded role first: scale out an over role if the budget takes
one more instance, else a role change from the other role when that one can spare one (a P's
chips restarted as a D or the reverse), else nothing ("budget full"). With nothing over, a
role with slack scales in (the one with the most slack). Never below one P and one D (nor the
bounds). Before any of it: no change while one is under way (`state.in_flight`), within
`hysteresis.min_change_interval_s` of the last change, or within the back-off after failed
ones (`hysteresis.backoff_s`, doubled per failure in a row, at most 8x). The band between
"over" and "slack" is what keeps a load at the threshold from flapping. `mode` (act |
recommend) is carried on the decision: the rules are the same, `decision.act` says whether
to carry it out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from pdtopo.planner.budget import ROLES, Budget, Counts, other
from pdtopo.planner.capacity import Capacity, Slo
from pdtopo.planner.observe import Observation
from pdtopo.planner.settings import PlannerSettings

ACTIONS = ("none", "scale_out", "scale_in", "role_change")
MAX_BACKOFF_FACTOR = 8
BACKLOG_INTERVALS = 3  # the backlog counts as load spread over this many intervals


@dataclass(frozen=True)
class Load:
    """The next interval's load, tokens/s per role, and what it was estimated from."""

    prompt_tps: float
    decode_tps: float
    prompt_peak: float = 0.0           # the recent peak, decaying (what a scale in must fit)
    decode_peak: float = 0.0
    mean_prompt_len: float | None = None
    mean_output_len: float | None = None
    pressure: tuple[str, ...] = ()     # roles past their SLO with requests waiting
    notes: tuple[str, ...] = ()        # why, per role in `pressure`

    def of(self, role: str) -> float:
        return self.prompt_tps if role == "prefill" else self.decode_tps

    def peak(self, role: str) -> float:
        return self.prompt_peak if role == "prefill" else self.decode_peak


def _mean(tokens_per_s: float, requests_per_s: float, previous: float | None) -> float | None:
    return tokens_per_s / requests_per_s if requests_per_s > 0 else previous


def estimate_load(obs: Observation, slo: Slo, previous: Load | None = None,
                  peak_half_life_s: float = 60.0) -> Load:
    """The load of the next interval (module docstring); `previous` supplies the mean
    lengths when no request finished in this one, and the peaks, which halve every
    `peak_half_life_s` unless the load reaches them again."""
    prompt_len = _mean(obs.total("prefill", "prompt_tps"),
                       obs.total("prefill", "requests_per_s"),
                       previous.mean_prompt_len if previous else None)
    output_len = _mean(obs.total("decode", "decode_tps"), obs.total("decode", "requests_per_s"),
                       previous.mean_output_len if previous else None)
    horizon = max(obs.interval_s * BACKLOG_INTERVALS, 1e-9)
    prompt = obs.total("prefill", "prompt_tps") \
        + obs.total("prefill", "queue_depth") * (prompt_len or 0.0) / horizon
    decode = obs.total("decode", "decode_tps") \
        + obs.total("decode", "queue_depth") * (output_len or 0.0) / horizon
    pressure, notes = [], []
    p = slo.percentile
    ttft_p = obs.worst("prefill", "ttft", p)
    if slo.ttft_ms is not None and ttft_p is not None and ttft_p > slo.ttft_ms \
            and obs.total("prefill", "queue_depth") > 0:
        pressure.append("prefill")
        notes.append(f"prefill TTFT p{p} {ttft_p:.0f} ms > {slo.ttft_ms:g} ms with "
                     f"{obs.total('prefill', 'queue_depth'):.0f} waiting")
    itl_d = obs.worst("decode", "itl", p)
    if slo.itl_ms is not None and itl_d is not None and itl_d > slo.itl_ms:
        pressure.append("decode")
        notes.append(f"decode ITL p{p} {itl_d:.0f} ms > {slo.itl_ms:g} ms")
    decay = 0.5 ** (obs.interval_s / peak_half_life_s) if peak_half_life_s > 0 else 0.0
    prompt_peak = max(prompt, previous.prompt_peak * decay if previous else 0.0)
    decode_peak = max(decode, previous.decode_peak * decay if previous else 0.0)
    return Load(prompt, decode, prompt_peak, decode_peak, prompt_len, output_len,
                tuple(pressure), tuple(notes))


@dataclass(frozen=True)
class PlannerState:
    """What the decision remembers between intervals (the caller keeps it)."""

    last_change_at: float | None = None   # when the last change started
    in_flight: str | None = None          # the change under way (its label), if any
    failures: int = 0                     # failed changes in a row
    last_failure_at: float | None = None


def started(state: PlannerState, decision: Decision, now: float) -> PlannerState:
    """The caller began carrying out `decision` at `now`."""
    return replace(state, last_change_at=now, in_flight=decision.label)


def finished(state: PlannerState, now: float, ok: bool) -> PlannerState:
    """The change under way ended at `now`; a failure counts toward the back-off."""
    if ok:
        return replace(state, in_flight=None, failures=0)
    return replace(state, in_flight=None, failures=state.failures + 1, last_failure_at=now)


@dataclass(frozen=True)
class Decision:
    at: float
    action: str                  # none | scale_out | scale_in | role_change
    role: str | None             # scale_out / scale_in: the role; role_change: the new role
    from_role: str | None        # role_change: the role an instance leaves
    current: Counts
    target: Counts
    reason: str
    load: Load
    capacity: Capacity
    needed: dict[str, float | None]   # instances each role needs (fractional; None: unknown)
    mode: str                    # act | recommend

    @property
    def act(self) -> bool:
        """Carry it out: mode act and a change to make."""
        return self.mode == "act" and self.action != "none"

    @property
    def label(self) -> str:
        if self.action == "role_change":
            return f"role_change({self.from_role}->{self.role})"
        return self.action if self.action == "none" else f"{self.action}({self.role})"

    @property
    def capacity_source(self) -> str:
        return self.capacity.source

    def to_dict(self) -> dict:
        """One JSON line of RUN/planner.log."""
        return {"at": self.at, "action": self.action, "label": self.label, "role": self.role,
                "from_role": self.from_role, "mode": self.mode, "act": self.act,
                "current": self.current.to_dict(), "target": self.target.to_dict(),
                "reason": self.reason, "load": asdict(self.load),
                "capacity": self.capacity.to_dict(), "capacity_source": self.capacity_source,
                "needed": self.needed}


def needed_instances(load: Load, capacity: Capacity, peak: bool = False
                     ) -> dict[str, float | None]:
    """Instances of each role the load (`peak`: its recent peak) needs; None: unknown."""
    out: dict[str, float | None] = {}
    for role in ROLES:
        cap = capacity.of(role)
        tokens = load.peak(role) if peak else load.of(role)
        out[role] = None if cap is None or cap.tokens_per_s <= 0 \
            else tokens / cap.tokens_per_s
    return out


def hold(state: PlannerState, settings: PlannerSettings, now: float) -> str | None:
    """Why no change may start now (None: one may)."""
    if state.in_flight:
        return f"{state.in_flight} is under way"
    h = settings.hysteresis
    if state.last_change_at is not None and now - state.last_change_at < h.min_change_interval_s:
        return (f"hysteresis: {now - state.last_change_at:.0f} s since the last change "
                f"(planner.hysteresis.min_change_interval_s={h.min_change_interval_s:g})")
    if state.failures and state.last_failure_at is not None:
        wait = h.backoff_s * min(MAX_BACKOFF_FACTOR, 2 ** (state.failures - 1))
        if now - state.last_failure_at < wait:
            return (f"backing off for {wait:g} s after {state.failures} failed change(s) "
                    f"({now - state.last_failure_at:.0f} s so far)")
    return None


def _fmt(needed: float | None) -> str:
    return "?" if needed is None else f"{needed:.2f}"


def decide(load: Load, counts: Counts, capacity: Capacity, budget: Budget,
           settings: PlannerSettings, state: PlannerState, now: float) -> Decision:
    """The decision of one interval (module docstring)."""
    needed = needed_instances(load, capacity)
    at_peak = needed_instances(load, capacity, peak=True)
    m = settings.hysteresis.margin

    def make(action: str, reason: str, role: str | None = None, from_role: str | None = None,
             target: Counts = counts) -> Decision:
        return Decision(now, action, role, from_role, counts, target, reason, load, capacity,
                        needed, settings.mode)

    held = hold(state, settings, now)
    if held:
        return make("none", held)
    over, slack, spare = [], [], []
    for role in ROLES:
        n, need = counts.of(role), needed[role]
        if need is not None and n > budget.bounds(role)[0] and need < n - 1 \
                and role not in load.pressure:
            spare.append(role)
        if role in load.pressure or (need is not None and need > n * (1 + m)):
            over.append(role)
        elif (peak := at_peak[role]) is not None and n > budget.bounds(role)[0] \
                and peak < (n - 1) * (1 - m):
            slack.append(role)
    status = ", ".join(f"{r} needs {_fmt(needed[r])} of {counts.of(r)}" for r in ROLES)
    if load.notes:
        status += "; " + "; ".join(load.notes)
    if not any(capacity.of(r) for r in ROLES) and not over:
        return make("none", f"no capacity estimate yet ({capacity.source})")
    refusals = []
    # most loaded first: the SLO-pressed role, then the higher needed / current
    for role in sorted(over, key=lambda r: (r not in load.pressure,
                                            -(needed[r] or 0.0) / counts.of(r))):
        grown = counts.add(role, 1)
        why = budget.refusal(grown)
        if why is None:
            return make("scale_out", f"{role} over capacity: {status}", role, target=grown)
        moved = grown.add(other(role), -1)
        if other(role) in spare and budget.refusal(moved) is None:
            return make("role_change", f"{role} over capacity, {other(role)} can spare one "
                        f"and {why}: {status}", role, other(role), target=moved)
        refusals.append(f"{role} over capacity but {why} and {other(role)} cannot spare one")
    if refusals:
        return make("none", "; ".join(refusals) + f": {status}")
    for role in sorted(slack, key=lambda r: (at_peak[r] or 0.0) - counts.of(r)):
        shrunk = counts.add(role, -1)
        if budget.refusal(shrunk) is None:
            return make("scale_in", f"{role} has slack: {status}", role, target=shrunk)
    return make("none", f"within capacity: {status}")
