"""Which topologies a chip budget allows, as Hydra overrides of the starting topology (pure).

    cands = candidate_overrides(topo, acc, budget, kinds)      # enumeration, no validation
    checked = check_candidates(cands, compose, cpus)            # the planner decides

Families, for every tensor-parallel size t (powers of two up to the budget):
  colocated  one colocated instance of t chips (the reference server);
  dp         n >= 2 colocated instances of t chips behind the router (mode dp: the fair
             baseline for PD, the same chips without disaggregation);
  pd         p prefill instances of t chips and d decode instances of t' chips (t' = t, or
             another size: the KV is resharded on the way, docs/topology.md#heterogeneous-p-and-d).
Each uses at most `budget` chips. A TPU topology keeps its accelerator (the planner checks
that chip blocks and meshes fit its hosts); a CPU one gets `cpu-<budget>` emulated chips. The
candidates are interleaved across families (largest first within one) and cut at
`max_candidates`. `check_candidates` expands every candidate's plan through the caller's
`compose(overrides)` (and the caller's model pre-flight); a candidate either refuses is kept
with the reason.

Units: on TPU a candidate is charged the chips its servers hold; on cpu-N the emulated chips
share the real cores, so it is charged the cores its servers are pinned to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest

from omegaconf import DictConfig

from pdtopo.config.schema import TopologyError, TopologySchema
from pdtopo.config.settings import TUNE_KINDS
from pdtopo.launcher.plan.expand import Plan, expand_plan
from pdtopo.launcher.plan.tpu_env import Accelerator

SERVING = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class Candidate:
    slug: str                 # stable id, part of the results path: colocated-tp1, pd-1p1-1d1
    kind: str                 # colocated | dp | pd
    label: str                # for people: "1P tp=1 + 1D tp=1"
    chips: int                # chips of the budget it holds
    overrides: tuple[str, ...]


@dataclass
class Checked:
    candidate: Candidate
    plan: Plan | None = None
    error: str | None = None
    units: int = 0            # chips (TPU) or cores (cpu-N) it is charged
    cfg: DictConfig | None = field(default=None, repr=False)


def _tps(budget: int) -> list[int]:
    out, t = [], 1
    while t <= budget:
        out.append(t)
        t *= 2
    return out


def _role(role: str, instances: int, tp: int) -> list[str]:
    k = f"topology.{role}"
    return [f"{k}.instances={instances}", f"{k}.chips_per_instance={tp}",
            f"{k}.processes_per_instance=1", f"{k}.chips_per_process=null",
            f"{k}.chips=null", f"{k}.hosts=null", f"{k}.port_overrides={{}}",
            f"{k}.mesh={{tp:{tp}}}"]


def candidate_overrides(topo: TopologySchema, acc: Accelerator, budget: int,
                        kinds: Sequence[str] = TUNE_KINDS,
                        max_candidates: int | None = None) -> list[Candidate]:
    base = [f"topology.accelerator=cpu-{budget}"] if acc.platform == "cpu" else []
    families: dict[str, list[Candidate]] = {"colocated": [], "dp": [], "pd": []}
    for t in reversed(_tps(budget)):
        families["colocated"].append(Candidate(
            f"colocated-tp{t}", "colocated", f"colocated tp={t}", t,
            (*base, "topology.mode=colocated", *_role("colocated", 1, t))))
        for n in range(budget // t, 1, -1):
            families["dp"].append(Candidate(
                f"dp{n}-tp{t}", "dp", f"{n}x colocated tp={t} behind the router", n * t,
                (*base, "topology.mode=dp", *_role("colocated", n, t))))
        for td in reversed(_tps(budget)):  # decode's TP: equal first, then resharded
            for p in range(budget // t, 0, -1):
                for d in range((budget - p * t) // td, 0, -1):
                    families["pd"].append(Candidate(
                        f"pd-{p}p{t}-{d}d{td}", "pd", f"{p}P tp={t} + {d}D tp={td}",
                        p * t + d * td, (*base, "topology.mode=pd", *_role("prefill", p, t),
                                         *_role("decode", d, td))))
    for fam in families.values():
        # stable: larger TP first among equal chip counts; P and D of one TP before mixed ones
        fam.sort(key=lambda c: -c.chips)
    picked = [families[k] for k in TUNE_KINDS if k in kinds]
    merged = [c for group in zip_longest(*picked) for c in group if c is not None]
    return merged[:max_candidates] if max_candidates else merged


def budget_of(topo: TopologySchema, acc: Accelerator, chips: int | None) -> int:
    """The chip budget: `tune.chips`, or every chip of the topology's one host. TopologyError
    naming the key when it cannot be met."""
    if len(topo.hosts) != 1:
        raise TopologyError("topology.hosts", [h.name for h in topo.hosts],
                            "pdtopo tune searches one-host topologies this release")
    host = topo.hosts[0]
    available = acc.num_chips if host.chips is None else int(host.chips)
    if chips is None:
        return available
    if acc.platform == "tpu" and chips > available:
        raise TopologyError("tune.chips", chips, f"the host of {topo.name!r} has "
                            f"{available} chips ({acc.name})")
    return chips


def units_of(plan: Plan, cpus: Sequence[int]) -> int:
    servers = [p for p in plan.processes if p.role in SERVING]
    if plan.platform == "cpu":
        cores = {c for p in servers for c in (p.cpu_affinity or cpus)}
        return max(1, len(cores))
    return sum(len(p.chips) for p in servers)


def check_candidates(cands: Sequence[Candidate], compose: Callable[[list[str]], DictConfig],
                     cpus: Sequence[int],
                     preflight: Callable[[DictConfig, Plan], object] | None = None
                     ) -> list[Checked]:
    """`preflight(cfg, plan)`: the launcher's model check (a TP the model cannot split is
    refused there, not after a start-up that fails)."""
    out = []
    for cand in cands:
        try:
            cfg = compose(list(cand.overrides))
            plan = expand_plan(cfg, cpus=list(cpus))
            if preflight is not None:
                preflight(cfg, plan)
        except TopologyError as exc:
            out.append(Checked(cand, error=str(exc)))
            continue
        out.append(Checked(cand, plan=plan, units=units_of(plan, cpus), cfg=cfg))
    return out
