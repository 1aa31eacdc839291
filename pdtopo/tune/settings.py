"""The `tune` config node as typed settings (an OmegaConf structured config, every field
`MISSING`: the defaults are the `tune:` node of conf/config.yaml).

`TuneSettings.from_config(node, *more)` merges the composed `tune` node (and any partial nodes
after it) onto the schema through pdtopo.config.settings, which type-checks every value,
refuses unknown keys and applies the `tune.*` RULES; `kinds` may be one name or a list and
becomes a tuple. A bad value raises `TopologyError` naming `tune.<key>` and the value, before
anything starts. `TuneSettings.with_defaults(values)` is conf's defaults with `values` merged on
(tests build settings this way, no default repeated in Python).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omegaconf import MISSING, DictConfig

from pdtopo.config.settings import conf_defaults, plain_node, typed_settings


@dataclass(frozen=True)
class TuneSettings:
    chips: int | None = MISSING       # the budget (null: every chip of the topology's hosts)
    goodput_target: float = MISSING   # fraction of requests within bench.slo at a passing rate
    start_rate: float = MISSING       # requests/s of the first run of every candidate
    growth: float = MISSING           # rate factor while runs pass
    precision: float = MISSING        # bisect until (fail - pass) / fail is below this
    max_runs_per_candidate: int = MISSING
    max_candidates: int = MISSING
    dry_run: bool = MISSING           # list candidates with their plans, start nothing
    dir: str = MISSING                # results (stable across reruns: resumable)
    kinds: tuple[str, ...] = MISSING  # which families of candidates (config.settings.TUNE_KINDS)

    @classmethod
    def from_config(cls, node: DictConfig | dict | None, *more: DictConfig | dict
                    ) -> TuneSettings:
        """Typed, checked settings of a whole `tune` node (`more`: partial nodes on top)."""
        layers = [_kinds_as_list(n) for n in (node, *more)]
        s = typed_settings(cls, "tune", *layers)
        return replace(s, kinds=tuple(s.kinds))

    @classmethod
    def with_defaults(cls, values: DictConfig | dict | None = None) -> TuneSettings:
        """conf's `tune` defaults with `values` (a partial node) merged on."""
        return cls.from_config(conf_defaults("tune"), values or {})


def _kinds_as_list(node: DictConfig | dict | None) -> dict | None:
    """`node` as a plain dict whose `kinds`, if one name (`tune.kinds=pd`), is a list of it."""
    if node is None:
        return None
    plain = plain_node(node)
    if isinstance(plain.get("kinds"), str):
        plain["kinds"] = [plain["kinds"]]
    return plain
