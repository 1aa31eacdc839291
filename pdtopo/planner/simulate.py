"""A discrete-event model of a PD deployment, with the planner's own decision code in the loop
(pure Python, deterministic: the trace carries the randomness, seeded).

    result = simulate(trace, params, Counts(1, 1))                          # a static split
    result = simulate(trace, params, Counts(1, 1), planner=settings, budget=budget)  # planned
    result.stats["goodput"]["rps"], result.stats["ttft_ms"]["p99"], result.decisions

The model:
- router: each request goes, on arrival, to the next serving P and the next serving D in round
  robin (sglang-router's default policy; it posts to both at once);
- P: a FIFO queue; a step takes up to `chunk_tokens` prompt tokens from the head (chunked
  prefill: several prompts, the last one possibly in part) and lasts tokens / prefill tokens/s
  + `step_overhead_s`; a finished prompt's KV goes to its D after `transfer_base_s` +
  transfer_s_per_token x prompt tokens;
- D: continuous batching; at each step boundary it admits arrived requests up to the batch cap
  (the first token, P's, is emitted then, as pdtopo's D does); a step of batch b lasts the
  profile's step time at b and gives each running request one token;
- planner: every `interval_s` the instances' windows become an `Observation` (the same fields
  the /metrics parser fills) and `plan_step` decides; a scale out holds its chips for
  `startup_s` before the instance is serving; a scale in takes the instance out of the router
  at once, lets it finish every request it was given, then `drain_s` to stop (the role's last
  instance, as `pdtopo scale` shrinks a role); a role change drains the instance with the
  least left to do, then starts up in the new role. One change at a time, as the planner says.
Host noise (calibration, off by default): with `jitter`, every P step, KV transfer and D step
lasts its modelled time times a multiplier drawn (seeded by `jitter_seed`) from `jitter`, e.g.
measured step times divided by their median (benchmarks/bench_planner.py's validation); with
`jitter_unit_s` (the span the multipliers were measured on, e.g. one decode gap) a duration
of n such units takes the mean of n draws, as independent stalls average out over it.
D's overlap scheduling (off by default: `emit_lag_s` 0): D reads a step's tokens back, and
emits them, only once it has dispatched the next step, so a decode token leaves D
`emit_lag_s` after its step ends, except a request's first token (emitted when D admits it)
and its last (a request's certain last token is not carried into a next step: emitted at
once). The step times do not change; each request's first gap grows by the lag and its last
shrinks by it (measured as the mean step less the last gap, benchmarks/bench_planner.py).
KV pages, preemption, prefix caching, P's held-KV budget and network contention are not
modelled. Requests not done `tail_s` after the last arrival count as timed out. Statistics
are pdtopo.bench.stats.summarize over the trace's span (goodput: requests within both SLOs
per second, the same definition as `pdtopo bench`).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdtopo.bench.loadgen import RequestResult
from pdtopo.bench.settings import Slo as BenchSlo
from pdtopo.bench.stats import percentile, summarize
from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.capacity import InstanceProfile, LiveCapacity
from pdtopo.planner.decide import Decision, finished, started
from pdtopo.planner.observe import PERCENTILES, InstanceObservation, Observation
from pdtopo.planner.settings import PlannerSettings
from pdtopo.planner.step import PlannerMemory, plan_step
from pdtopo.planner.trace import SimRequest


@dataclass(frozen=True)
class SimParams:
    profile: InstanceProfile           # every instance, P and D (the same slice of chips)
    chunk_tokens: int = 2048           # a P step's prompt tokens (engine.max_prefill_tokens)
    step_overhead_s: float = 0.002     # a P step's cost beyond its tokens
    transfer_base_s: float = 0.002     # a KV transfer's cost beyond its tokens
    startup_s: float = 20.0            # a new instance: start -> serving
    drain_s: float = 2.0               # a drained instance: last request done -> chips free
    tail_s: float = 120.0              # simulated past the last arrival
    jitter: tuple[float, ...] = ()     # duration multipliers to draw from (() = none)
    jitter_seed: int = 0
    jitter_unit_s: float = 0.0         # the span a multiplier was measured on (0: one per duration)
    emit_lag_s: float = 0.0            # D's overlap read-back: a decode token leaves this late


@dataclass
class _Req:
    req: SimRequest
    d: _Instance | None = None
    remaining: int = 0                 # prompt tokens P has still to prefill
    token_times: list[float] = field(default_factory=list)
    end: float | None = None


@dataclass
class _Window:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0
    ttft: list[float] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)   # (step s, batch)
    queue_at_start: int = 0


class _Instance:
    def __init__(self, name: str, role: str, state: str) -> None:
        self.name, self.role, self.state = name, role, state
        self.queue: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.busy = False
        self.outstanding = 0           # requests given to it and not done with it
        self.window = _Window()
        self.on_drained: Callable[[], None] | None = None


@dataclass
class SimResult:
    label: str
    stats: dict                        # pdtopo.bench.stats.summarize
    decisions: list[Decision]          # every interval's decision (planned runs)
    counts: list[tuple[float, Counts]]  # the plan's counts, from t = 0, at each change

    @property
    def goodput_rps(self) -> float:
        return float(self.stats["goodput"]["rps"] or 0.0)

    @property
    def actions(self) -> list[Decision]:
        return [d for d in self.decisions if d.action != "none"]

    def latency(self, kind: str, p: int = 99) -> float | None:
        return (self.stats.get(f"{kind}_ms") or {}).get(f"p{p}")


def _weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    ordered = sorted(pairs)
    total = sum(w for _, w in ordered)
    rank, seen = q / 100 * total, 0
    for value, w in ordered:
        seen += w
        if seen >= rank:
            return value
    return ordered[-1][0]


class _Sim:
    def __init__(self, trace: Sequence[SimRequest], params: SimParams, start: Counts,
                 planner: PlannerSettings | None, budget: Budget | None) -> None:
        self.p, self.trace, self.planner, self.budget = params, trace, planner, budget
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.instances: list[_Instance] = []
        self.names = {"prefill": itertools.count(), "decode": itertools.count()}
        for role in ("prefill", "decode"):
            for _ in range(start.of(role)):
                self._new(role, "serving")
        self.rr = {"prefill": 0, "decode": 0}
        self.reqs: list[_Req] = []
        self.counts = start
        self.timeline = [(0.0, start)]
        self.decisions: list[Decision] = []
        self.memory = PlannerMemory(live=LiveCapacity(max_batch=params.profile.max_batch))
        self.done = 0
        self.rng = random.Random(params.jitter_seed)

    # -- plumbing
    def noise(self, duration: float = 0.0) -> float:
        """A multiplier for `duration`: one draw, or with `jitter_unit_s` the mean of one draw
        per unit of it (independent stalls average out over a longer span of host work)."""
        if not self.p.jitter:
            return 1.0
        n = max(1, round(duration / self.p.jitter_unit_s)) if self.p.jitter_unit_s > 0 else 1
        return sum(self.rng.choice(self.p.jitter) for _ in range(n)) / n

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def _new(self, role: str, state: str) -> _Instance:
        inst = _Instance(f"{role}_{next(self.names[role])}", role, state)
        self.instances.append(inst)
        return inst

    def serving(self, role: str) -> list[_Instance]:
        return [i for i in self.instances if i.role == role and i.state == "serving"]

    # -- requests
    def arrive(self, r: _Req) -> None:
        p, d = (self._pick(role) for role in ("prefill", "decode"))
        r.d = d
        r.remaining = r.req.input_len
        p.outstanding += 1
        d.outstanding += 1
        p.queue.append(r)
        self.p_kick(p)

    def _pick(self, role: str) -> _Instance:
        pool = self.serving(role)
        if not pool:  # the planner never takes the last one of a role away
            raise RuntimeError(f"no serving {role} instance at t={self.now:.1f}")
        self.rr[role] += 1
        return pool[self.rr[role] % len(pool)]

    def p_kick(self, inst: _Instance) -> None:
        if inst.busy or not inst.queue:
            return
        budget, tokens, done = self.p.chunk_tokens, 0, 0
        for r in inst.queue:
            take = min(r.remaining, budget)
            r.remaining -= take
            tokens += take
            budget -= take
            if r.remaining == 0:
                done += 1
            if budget == 0:
                break
        finished_now = [inst.queue.popleft() for _ in range(done)]
        inst.running = finished_now
        inst.busy = True
        step = tokens / self.p.profile.prefill_tps + self.p.step_overhead_s
        step *= self.noise(step)
        self.at(self.now + step, self.p_step_end, inst, tokens, finished_now)

    def p_step_end(self, inst: _Instance, tokens: int, done: list[_Req]) -> None:
        inst.busy = False
        inst.running = []
        w = inst.window
        w.prompt_tokens += tokens
        for r in done:
            w.finished += 1
            w.ttft.append(self.now - r.req.arrival)
            latency = (self.p.transfer_base_s +
                       self.p.profile.transfer_s_per_token * r.req.input_len)
            latency *= self.noise(latency)
            assert r.d is not None
            self.at(self.now + latency, self.d_receive, r.d, r)
            self._release(inst)
        self.p_kick(inst)

    def d_receive(self, inst: _Instance, r: _Req) -> None:
        inst.queue.append(r)
        self.d_kick(inst)

    def d_kick(self, inst: _Instance) -> None:
        if inst.busy:
            return
        while inst.queue and len(inst.running) < self.p.profile.max_batch:
            r = inst.queue.popleft()
            r.token_times.append(self.now)
            inst.window.ttft.append(self.now - r.req.arrival)
            if len(r.token_times) >= r.req.output_len:
                self._finish(inst, r)
            else:
                inst.running.append(r)
        if not inst.running:
            return
        batch = len(inst.running)
        step = self.p.profile.step_s(batch)
        step *= self.noise(step)
        inst.busy = True
        self.at(self.now + step, self.d_step_end, inst, step)

    def d_step_end(self, inst: _Instance, step: float) -> None:
        inst.busy = False
        w = inst.window
        w.decode_tokens += len(inst.running)
        w.steps.append((step, len(inst.running)))
        still, lag = [], self.p.emit_lag_s
        for r in inst.running:
            if len(r.token_times) + 1 >= r.req.output_len:  # the last: emitted at once
                r.token_times.append(max(self.now, r.token_times[-1]))
                self._finish(inst, r)
            else:
                r.token_times.append(self.now + lag)
                still.append(r)
        inst.running = still
        self.d_kick(inst)

    def _finish(self, inst: _Instance, r: _Req) -> None:
        r.end = self.now
        inst.window.finished += 1
        self.done += 1
        self._release(inst)

    def _release(self, inst: _Instance) -> None:
        inst.outstanding -= 1
        if inst.state == "draining" and inst.outstanding == 0 and inst.on_drained:
            callback, inst.on_drained = inst.on_drained, None
            self.at(self.now + self.p.drain_s, callback)

    # -- the planner
    def observe(self, interval: float) -> Observation:
        out = []
        for inst in self.instances:
            if inst.state not in ("serving", "draining"):
                continue
            w = inst.window
            queue = len(inst.queue)
            ttft = {f"p{q}": percentile(w.ttft, q) * 1e3 if w.ttft else None
                    for q in PERCENTILES}
            itl = {f"p{q}": _weighted_percentile(w.steps, q) * 1e3 if w.steps else None
                   for q in PERCENTILES}
            out.append(InstanceObservation(
                name=inst.name, role=inst.role, queue_depth=queue,
                waiting_s=queue / (w.finished / interval) if w.finished else None,
                prompt_tps=w.prompt_tokens / interval, decode_tps=w.decode_tokens / interval,
                requests_per_s=w.finished / interval, running=len(inst.running),
                ttft_ms=ttft, itl_ms=itl, busy=w.queue_at_start > 0 and queue > 0))
            inst.window = _Window(queue_at_start=queue)
        return Observation(self.now, interval, tuple(out))

    def tick(self) -> None:
        assert self.planner is not None and self.budget is not None
        obs = self.observe(self.planner.interval_s)
        profile = self.p.profile if self.planner.capacity.source != "live" else None
        decision, self.memory = plan_step(obs, self.counts, self.budget, self.planner,
                                          self.memory, self.now, profile)
        self.decisions.append(decision)
        if decision.act:
            self.memory = self.memory.with_state(started(self.memory.state, decision,
                                                         self.now))
            self.act(decision)
        if self.done < len(self.reqs):
            self.at(self.now + self.planner.interval_s, self.tick)

    def act(self, d: Decision) -> None:
        self.counts = d.target
        self.timeline.append((self.now, d.target))
        assert d.role is not None
        if d.action == "scale_out":
            self.start(d.role)
        elif d.action == "scale_in":
            self.drain(self.serving(d.role)[-1], self.complete)  # scale shrinks from the end
        else:
            assert d.from_role is not None  # the instance with the least left to do
            inst = min(self.serving(d.from_role), key=lambda i: i.outstanding)
            self.drain(inst, lambda: self.start(d.role or ""))

    def start(self, role: str) -> None:
        inst = self._new(role, "starting")

        def up() -> None:
            inst.state = "serving"
            self.complete()

        self.at(self.now + self.p.startup_s, up)

    def drain(self, inst: _Instance, then: Callable[[], None]) -> None:
        inst.state = "draining"

        def stopped() -> None:
            inst.state = "stopped"
            then()

        if inst.outstanding == 0:
            self.at(self.now + self.p.drain_s, stopped)
        else:
            inst.on_drained = stopped

    def complete(self) -> None:
        self.memory = self.memory.with_state(finished(self.memory.state, self.now, ok=True))

    # -- the run
    def run(self) -> list[RequestResult]:
        for req in self.trace:
            r = _Req(req)
            self.reqs.append(r)
            self.at(req.arrival, self.arrive, r)
        if self.planner is not None:
            self.at(self.planner.interval_s, self.tick)
        horizon = (self.trace[-1].arrival if self.trace else 0.0) + self.p.tail_s
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            if t > horizon:
                break
            self.now = t
            fn(*args)
        return [self._result(r) for r in self.reqs]

    @staticmethod
    def _result(r: _Req) -> RequestResult:
        req = r.req
        res = RequestResult(req.index, req.tag, req.input_len, req.output_len,
                            start=req.arrival, end=r.end if r.end is not None else 0.0,
                            token_times=r.token_times, prompt_tokens=req.input_len)
        if r.end is None:
            res.error = "timeout"
        return res


def simulate(trace: Sequence[SimRequest], params: SimParams, start: Counts, *,
             slo: BenchSlo, duration_s: float, planner: PlannerSettings | None = None,
             budget: Budget | None = None, label: str | None = None) -> SimResult:
    """Run `trace` on `start` instances; with `planner` (and its `budget`) the planner
    re-balances as it would live. `duration_s`: the span goodput is counted over."""
    if planner is not None and budget is None:
        raise ValueError("a planned run needs the planner's budget")
    sim = _Sim(trace, params, start, planner, budget)
    results = sim.run()
    name = label or (f"planned from {start}" if planner is not None else f"static {start}")
    return SimResult(name, summarize(results, duration_s, slo, by_tag=False),
                     sim.decisions, sim.timeline)
