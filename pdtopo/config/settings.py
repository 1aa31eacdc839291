"""Typed settings of the config groups: the runtime groups engine, kernels, disaggregation,
local, bootstrap, server and launcher, and the `bench`, `tune` and `planner` nodes (their
dataclasses live in pdtopo.bench.settings, pdtopo.tune.settings and pdtopo.planner.settings).
OmegaConf structured configs, like the topology schema.

Defaults live in one place, conf/ (conf/config.yaml, conf/bench/default.yaml): every field of
these dataclasses is required (`MISSING`), so a composed config supplies it and code never
repeats a default; `conf_defaults(group)` hands those values to code that builds settings
without composing a config itself (tests, benchmarks). `typed_settings(schema, prefix, *nodes)`
merges the nodes onto a dataclass (type-checking values, refusing unknown keys) and checks every
field, nested dataclasses included, against the one table of RULES ("group.key" -> check);
`runtime_settings(cfg, role)` does that for each runtime group, applies the role's
`topology.<role>.engine.*` overrides to the engine group (a P and a D may differ) and returns
one frozen `RuntimeSettings`. Every problem is a `TopologyError` naming the full key and value.
The launcher validates with these objects at plan time and every runtime process reads them
(`ProcessContext.settings`): one set of rules for both.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on TPU, float32 elsewhere


def resolved_dtype(name: str, platform: str) -> str:
    """The dtype an engine on `platform` ("tpu", "cpu", ...) runs for engine.dtype / kv_dtype
    `name`: "auto" is bfloat16 on TPU (float32 only when asked for) and float32 elsewhere."""
    if str(name) == "auto":
        return "bfloat16" if platform == "tpu" else "float32"
    return str(name)
# engine.kv_memory_fraction=auto on TPU: the pool takes this much of each chip's memory, less
# what the model runner counts beside it (the largest step's buffers, the sampler, P's reserve)
AUTO_KV_MEMORY_FRACTION = 0.9


def resolved_kv_memory_fraction(value: Any, platform: str) -> float | None:
    """The fraction of device memory an engine on `platform` sizes its KV pool from, for
    engine.kv_memory_fraction `value`: "auto" is AUTO_KV_MEMORY_FRACTION on TPU and null (the
    pool is engine.num_pages) elsewhere."""
    if str(value) == "auto":
        return AUTO_KV_MEMORY_FRACTION if platform == "tpu" else None
    return None if value is None else float(value)


ATTENTION_IMPLS = ("auto", "pallas", "pallas_interpret", "gather")
KERNEL_IMPLS = ("auto", "pallas", "xla")
# the server threads `server.fault_inject_thread` can kill (pdtopo.runtime.worker_threads)
FAULT_THREADS = ("scheduler", "side_channel", "kv_sweep", "bootstrap_keeper", "lockstep_control")
ARRIVALS = ("poisson", "fixed")          # bench.arrival
WORKLOADS = ("synthetic", "multiturn", "chat")   # bench.workload
TUNE_KINDS = ("colocated", "dp", "pd")   # tune.kinds: the candidate families
PLANNER_MODES = ("act", "recommend")     # planner.mode
CAPACITY_SOURCES = ("live", "profile", "auto")   # planner.capacity.source
SLO_PERCENTILES = (50, 90, 99)           # planner.slo.percentile (bench's p50 / p90 / p99)


@dataclass(frozen=True)
class EngineSettings:
    dtype: str = MISSING
    kv_dtype: str = MISSING
    page_size: int = MISSING
    num_pages: int = MISSING
    kv_memory_fraction: Any = MISSING  # "auto" | null | (0, 1): resolved_kv_memory_fraction
    max_model_len: int = MISSING
    max_new_tokens_default: int = MISSING
    max_new_tokens_limit: int = MISSING
    max_running_requests: int = MISSING
    max_prefill_tokens: int = MISSING
    mixed_steps: bool = MISSING
    overlap_schedule: bool = MISSING
    attention_impl: str = MISSING
    seed: int = MISSING
    served_model_name: str | None = MISSING
    prefix_cache: bool = MISSING
    host_kv_pages: int = MISSING
    fault_inject_step_error_after: int | None = MISSING  # testing (engine/step_errors.py)


@dataclass(frozen=True)
class KernelSettings:
    impl: str = MISSING


@dataclass(frozen=True)
class DisaggregationSettings:
    transfer_backend: str = MISSING
    kv_timeout_s: float = MISSING
    sender_expiry_s: float = MISSING
    max_held_kv_pages: int = MISSING
    held_kv_wait_s: float = MISSING
    pull_workers: int = MISSING
    transfer_sockets: int = MISSING
    transfer_size_mb: float = MISSING
    transfer_raw_buffers: Any = MISSING  # "auto" | true | false
    side_channel_max_bytes: int = MISSING
    fault_injection_prob: float = MISSING
    decode_prefix_cache: bool = MISSING
    d2h_staging: bool = MISSING
    side_channel_curve: Any = MISSING  # "auto" | true | false
    side_channel_max_peers: int = MISSING
    side_channel_peer_idle_s: float = MISSING
    resolve_threads: int = MISSING
    migration: bool | str = MISSING   # false | true | replay


@dataclass(frozen=True)
class LocalSettings:
    transfer_backlog: int = MISSING
    decode_backlog: int | None = MISSING
    fault_inject_thread: str | None = MISSING
    fault_inject_after_steps: int = MISSING


@dataclass(frozen=True)
class BootstrapSettings:
    heartbeat_interval_s: float = MISSING
    heartbeat_ttl_s: float = MISSING
    register_timeout_s: float = MISSING


@dataclass(frozen=True)
class ServerSettings:
    bind_host: str | None = MISSING
    keep_alive_s: float = MISSING
    http_auth: Any = MISSING  # "auto" | true | false (pdtopo.config.credentials)
    max_body_bytes: int = MISSING  # servers and the proxy answer 413 past it (pdtopo.body_limit)
    fault_inject_thread: str | None = MISSING  # testing: one of FAULT_THREADS, or null
    fault_inject_after_steps: int = MISSING


@dataclass(frozen=True)
class LauncherSettings:
    health_timeout_s: float = MISSING
    startsecs: int = MISSING
    startretries: int = MISSING
    compilation_cache_dir: str | None = MISSING
    server_module: str = MISSING
    allow_incompatible_roles: bool = MISSING
    drain_timeout_s: float = MISSING
    migrate_after_s: float | None = MISSING
    prometheus_scrape_interval_s: float = MISSING
    router_watch: bool = MISSING


@dataclass(frozen=True)
class RuntimeSettings:
    engine: EngineSettings
    kernels: KernelSettings
    disaggregation: DisaggregationSettings
    local: LocalSettings
    bootstrap: BootstrapSettings
    server: ServerSettings
    launcher: LauncherSettings


# config group -> its schema (the fields of RuntimeSettings, in order)
GROUPS: dict[str, type] = {
    "engine": EngineSettings, "kernels": KernelSettings,
    "disaggregation": DisaggregationSettings, "local": LocalSettings,
    "bootstrap": BootstrapSettings, "server": ServerSettings, "launcher": LauncherSettings,
}


Rule = tuple[Callable[[Any], bool], str]  # (check, what the value must be)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _at_least(n: float) -> Rule:
    return (lambda v: _is_int(v) and v >= n), f"an integer >= {n:g}"


def _number(test: Callable[[float], bool], want: str, nullable: bool = False) -> Rule:
    """A number (never a bool; NaN fails every test) passing `test`; or null if `nullable`."""
    return (lambda v: (nullable and v is None) or (_is_number(v) and test(v))), \
        f"null or {want}" if nullable else want


def _one_of(choices: tuple[str, ...]) -> Rule:
    return (lambda v: v in choices), f"one of {', '.join(choices)}"


_POSITIVE = _number(lambda v: v > 0, "a number > 0")
_OPTIONAL_AT_LEAST_1 = (lambda v: v is None or (_is_int(v) and v >= 1)), \
    "null or an integer >= 1"
_FRACTION_BELOW_1 = _number(lambda v: 0 <= v < 1, "a number in [0, 1)")
_SLO_MS = _number(lambda v: v >= 0, "a number of ms >= 0", nullable=True)

# "group.key": (check, what the value must be)
RULES: dict[str, Rule] = {
    "engine.dtype": _one_of(DTYPES),
    "engine.kv_dtype": _one_of(DTYPES),
    "engine.page_size": _at_least(1),
    "engine.num_pages": _at_least(2),
    "engine.kv_memory_fraction": ((lambda v: v is None or v == "auto"
                                   or (_is_number(v) and 0 < v < 1)),
                                  "auto, null or a number in (0, 1)"),
    "engine.max_model_len": _at_least(1),
    "engine.max_new_tokens_default": _at_least(1),
    "engine.max_new_tokens_limit": _at_least(1),
    "engine.max_running_requests": _at_least(1),
    "engine.max_prefill_tokens": _at_least(1),
    "engine.host_kv_pages": _at_least(0),
    "engine.fault_inject_step_error_after": _OPTIONAL_AT_LEAST_1,
    "engine.attention_impl": _one_of(ATTENTION_IMPLS),
    "kernels.impl": _one_of(KERNEL_IMPLS),
    "disaggregation.transfer_backend": ((lambda v: v == "jax"), "jax"),
    "disaggregation.kv_timeout_s": _POSITIVE,
    "disaggregation.sender_expiry_s": _POSITIVE,
    "disaggregation.max_held_kv_pages": _at_least(1),
    "disaggregation.held_kv_wait_s": _POSITIVE,
    "disaggregation.transfer_size_mb": _POSITIVE,
    "disaggregation.transfer_sockets": _at_least(1),
    "disaggregation.pull_workers": _at_least(1),
    "disaggregation.side_channel_max_bytes": _at_least(1024),
    "disaggregation.fault_injection_prob": ((lambda v: _is_number(v) and 0 <= v <= 1),
                                            "a number in [0, 1]"),
    "disaggregation.side_channel_curve": ((lambda v: v == "auto" or isinstance(v, bool)),
                                          "auto, true or false"),
    "disaggregation.side_channel_max_peers": _at_least(1),
    "disaggregation.side_channel_peer_idle_s": _POSITIVE,
    "disaggregation.resolve_threads": _at_least(1),
    "disaggregation.migration": ((lambda v: isinstance(v, bool) or v == "replay"),
                                 "true, false or replay"),
    "disaggregation.transfer_raw_buffers": ((lambda v: v == "auto" or isinstance(v, bool)),
                                            "auto, true or false"),
    "local.transfer_backlog": _at_least(1),
    "local.decode_backlog": _OPTIONAL_AT_LEAST_1,
    "local.fault_inject_after_steps": _at_least(1),
    "bootstrap.heartbeat_interval_s": _POSITIVE,
    "bootstrap.heartbeat_ttl_s": _POSITIVE,
    "bootstrap.register_timeout_s": _POSITIVE,
    "server.keep_alive_s": _POSITIVE,
    "server.http_auth": ((lambda v: v == "auto" or isinstance(v, bool)), "auto, true or false"),
    "server.max_body_bytes": _at_least(1024),
    "server.fault_inject_thread": ((lambda v: v is None or v in FAULT_THREADS),
                                   f"null or one of {', '.join(FAULT_THREADS)}"),
    "server.fault_inject_after_steps": _at_least(1),
    "launcher.health_timeout_s": _POSITIVE,
    "launcher.drain_timeout_s": _POSITIVE,
    "launcher.migrate_after_s": _number(lambda v: v >= 0, "a number >= 0", nullable=True),
    "launcher.prometheus_scrape_interval_s": _POSITIVE,
    "launcher.startsecs": _at_least(0),
    "launcher.startretries": _at_least(0),
    # pdtopo.bench.settings.BenchSettings
    "bench.num_requests": _at_least(1),
    "bench.warmup_requests": _at_least(0),
    "bench.request_rate": ((lambda v: v is None or (_is_number(v) and v > 0)),
                           "a number > 0, or inf (null: inf)"),
    "bench.arrival": _one_of(ARRIVALS),
    "bench.max_concurrency": _at_least(1),
    "bench.seed": _at_least(0),
    "bench.timeout_s": _number(lambda v: v >= 0.001, "a number >= 0.001"),
    "bench.input_len": _at_least(1),
    "bench.input_len_range": _FRACTION_BELOW_1,
    "bench.output_len": _at_least(1),
    "bench.output_len_range": _FRACTION_BELOW_1,
    "bench.token_id_range": ((lambda v: len(v) == 2 and all(_is_int(i) for i in v)
                              and 0 <= v[0] < v[1]), "[low, high) with 0 <= low < high"),
    "bench.workload": _one_of(WORKLOADS),
    "bench.multiturn.system_prompts": _at_least(1),
    "bench.multiturn.system_len": _at_least(1),
    "bench.multiturn.conversations": _at_least(1),
    "bench.multiturn.turns": _at_least(1),
    "bench.multiturn.user_len": _at_least(1),
    "bench.temperature": _number(lambda v: v >= 0, "a number >= 0"),
    "bench.slo.ttft_ms": _SLO_MS,
    "bench.slo.itl_ms": _SLO_MS,
    # pdtopo.tune.settings.TuneSettings
    "tune.chips": _OPTIONAL_AT_LEAST_1,
    "tune.goodput_target": _number(lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "tune.start_rate": _number(lambda v: v > 0, "a number > 0 (requests/s)"),
    "tune.growth": _number(lambda v: v > 1, "a number > 1"),
    "tune.precision": _number(lambda v: 0 < v < 1, "a number in (0, 1)"),
    "tune.max_runs_per_candidate": _at_least(1),
    "tune.max_candidates": _at_least(1),
    "tune.kinds": ((lambda v: len(v) > 0 and all(k in TUNE_KINDS for k in v)),
                   f"a non-empty list of {', '.join(TUNE_KINDS)}"),
    "tune.dir": ((lambda v: bool(v)), "a directory path"),
    # pdtopo.planner.settings.PlannerSettings (the bounds' min <= max: checked there)
    "planner.mode": _one_of(PLANNER_MODES),
    "planner.interval_s": _number(lambda v: v >= 0.1, "a number of seconds >= 0.1"),
    "planner.chips": _OPTIONAL_AT_LEAST_1,
    "planner.prefill.min": _at_least(1),
    "planner.prefill.max": _OPTIONAL_AT_LEAST_1,
    "planner.decode.min": _at_least(1),
    "planner.decode.max": _OPTIONAL_AT_LEAST_1,
    "planner.slo.ttft_ms": _SLO_MS,
    "planner.slo.itl_ms": _SLO_MS,
    "planner.slo.percentile": ((lambda v: v in SLO_PERCENTILES and not isinstance(v, bool)),
                               f"one of {', '.join(map(str, SLO_PERCENTILES))}"),
    "planner.hysteresis.min_change_interval_s": _number(lambda v: v >= 0, "a number >= 0"),
    "planner.hysteresis.margin": _FRACTION_BELOW_1,
    "planner.hysteresis.backoff_s": _number(lambda v: v >= 0, "a number >= 0"),
    "planner.capacity.source": _one_of(CAPACITY_SOURCES),
}


def plain_node(node: DictConfig | dict) -> dict[str, Any]:
    """A config node as a plain dict (resolved): what the merges below take."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)


def _value_at(layers: list[Any], key: str) -> Any:
    """The value at `key` in the last layer that has one (what an error names)."""
    for layer in reversed(layers):
        value = OmegaConf.select(OmegaConf.create(layer), key, default=None)
        if value is not None:
            return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return None


def _typed_group(schema: type, prefix: str, *nodes: Any) -> Any:
    if not nodes or any(node is None for node in nodes):
        raise TopologyError(prefix, None, "missing config section")
    layers = [plain_node(node) for node in nodes]
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), *layers))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        value = getattr(exc, "value", None)
        if value is None and key:
            value = _value_at(layers, key)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TopologyError(f"{prefix}.{key}" if key else prefix, value,
                            f"invalid value, missing or unknown key ({reason})") from None


def check_value(key: str, value: Any) -> Any:
    """`value` if it satisfies the rule of `key` ("group.name"); TopologyError otherwise.
    Classes that take these settings as plain arguments check them with the same rules."""
    check, want = RULES[key]
    if not check(value):
        raise TopologyError(key, value, f"must be {want}")
    return value


def _check(prefix: str, settings: Any) -> None:
    for f in fields(settings):
        key, value = f"{prefix}.{f.name}", getattr(settings, f.name)
        if is_dataclass(value):
            _check(key, value)
        elif key in RULES:
            check_value(key, value)


def typed_settings(schema: type, prefix: str, *nodes: Any) -> Any:
    """`nodes` (DictConfig or dicts; later ones win) merged onto the dataclass `schema`, typed
    and checked against RULES under `prefix` (e.g. "bench"): the machinery of every group."""
    settings = _typed_group(schema, prefix, *nodes)
    _check(prefix, settings)
    return settings


@functools.cache
def _conf_group(group: str) -> Any:
    return OmegaConf.to_container(compose_config([])[group], resolve=True)


def conf_defaults(group: str) -> dict[str, Any]:
    """The values conf/ gives `group` (the config composed with no overrides, resolved): the
    defaults of code that builds settings without a composed config (tests, benchmarks).
    Composed once per process; each call returns a fresh copy."""
    return copy.deepcopy(_conf_group(group))


def role_engine_overrides(cfg: DictConfig, role: str | None) -> dict[str, Any]:
    """The non-null `topology.<role>.engine.*` values (what that role's processes change)."""
    node = OmegaConf.select(cfg, f"topology.{role}.engine", default=None) if role else None
    if not node:
        return {}
    values = OmegaConf.to_container(node, resolve=True)
    return {k: v for k, v in values.items() if v is not None}


def group_settings(cfg: DictConfig | dict, group: str, role: str | None = None) -> Any:
    """One group's typed, checked settings (`engine` with `role`'s overrides applied)."""
    node = cfg.get(group)
    if group == "engine" and role is not None and node is not None:
        node = {**OmegaConf.to_container(node, resolve=True), **role_engine_overrides(cfg, role)}
    return typed_settings(GROUPS[group], group, node)


def engine_settings(node: DictConfig | dict | EngineSettings) -> EngineSettings:
    """EngineSettings from an `engine:` node (already typed: returned as it is)."""
    if isinstance(node, EngineSettings):
        return node
    return group_settings({"engine": node}, "engine")


def runtime_settings(cfg: DictConfig, role: str | None = None) -> RuntimeSettings:
    """Every runtime group of a composed config, typed and checked (see module docstring)."""
    return RuntimeSettings(**{g: group_settings(cfg, g, role) for g in GROUPS})


def register_schemas() -> None:
    cs = ConfigStore.instance()
    for group, schema in GROUPS.items():
        cs.store(name=f"pdtopo_{group}_schema", node=schema)


register_schemas()
