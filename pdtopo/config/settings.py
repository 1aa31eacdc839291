"""Typed settings of the runtime config groups: engine, kernels, disaggregation, local,
bootstrap, server and launcher (OmegaConf structured configs, like the topology schema).

Defaults live in one place, conf/config.yaml: every field here is required (`MISSING`), so a
composed config supplies it and code never repeats a default. `runtime_settings(cfg, role)`
merges each group onto its dataclass (type-checking values, refusing unknown keys), applies the
role's `topology.<role>.engine.*` overrides to the engine group (a P and a D may differ), checks
the ranges below and returns one frozen `RuntimeSettings`. Every problem is a `TopologyError`
naming the full key and value. The launcher validates with these objects at plan time and every
runtime process reads them (`ProcessContext.settings`): one set of rules for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pdtopo.config.schema import TopologyError

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "pallas", "gather")
KERNEL_IMPLS = ("auto", "pallas", "xla")
# the server threads `server.fault_inject_thread` can kill (pdtopo.runtime.worker_threads)
FAULT_THREADS = ("scheduler", "side_channel", "kv_sweep", "bootstrap_keeper", "lockstep_control")


@dataclass(frozen=True)
class EngineSettings:
    dtype: str = MISSING
    kv_dtype: str = MISSING
    page_size: int = MISSING
    num_pages: int = MISSING
    kv_memory_fraction: float | None = MISSING
    max_model_len: int = MISSING
    max_new_tokens_default: int = MISSING
    max_new_tokens_limit: int = MISSING
    max_running_requests: int = MISSING
    max_prefill_tokens: int = MISSING
    attention_impl: str = MISSING
    seed: int = MISSING
    served_model_name: str | None = MISSING
    prefix_cache: bool = MISSING


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
    side_channel_curve: Any = MISSING  # "auto" | true | false
    side_channel_max_peers: int = MISSING
    side_channel_peer_idle_s: float = MISSING
    resolve_threads: int = MISSING


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _at_least(n: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: _is_int(v) and v >= n), f"an integer >= {n:g}"


_POSITIVE = (lambda v: _is_number(v) and v > 0), "a number > 0"
_OPTIONAL_AT_LEAST_1 = (lambda v: v is None or (_is_int(v) and v >= 1)), \
    "null or an integer >= 1"

# "group.key": (check, what the value must be)
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "engine.dtype": ((lambda v: v in DTYPES), f"one of {', '.join(DTYPES)}"),
    "engine.kv_dtype": ((lambda v: v in DTYPES), f"one of {', '.join(DTYPES)}"),
    "engine.page_size": _at_least(1),
    "engine.num_pages": _at_least(2),
    "engine.kv_memory_fraction": ((lambda v: v is None or (_is_number(v) and 0 < v < 1)),
                                  "null or a number in (0, 1)"),
    "engine.max_model_len": _at_least(1),
    "engine.max_new_tokens_default": _at_least(1),
    "engine.max_new_tokens_limit": _at_least(1),
    "engine.max_running_requests": _at_least(1),
    "engine.max_prefill_tokens": _at_least(1),
    "engine.attention_impl": ((lambda v: v in ATTENTION_IMPLS),
                              f"one of {', '.join(ATTENTION_IMPLS)}"),
    "kernels.impl": ((lambda v: v in KERNEL_IMPLS), f"one of {', '.join(KERNEL_IMPLS)}"),
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
    "launcher.prometheus_scrape_interval_s": _POSITIVE,
    "launcher.startsecs": _at_least(0),
    "launcher.startretries": _at_least(0),
}


def _typed_group(schema: type, node: Any, prefix: str) -> Any:
    if node is None:
        raise TopologyError(prefix, None, "missing config section")
    try:
        plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
            else dict(node)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        value = getattr(exc, "value", None)
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


def _check(group: str, settings: Any) -> None:
    for f in fields(settings):
        if f"{group}.{f.name}" in RULES:
            check_value(f"{group}.{f.name}", getattr(settings, f.name))


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
    settings = _typed_group(GROUPS[group], node, group)
    _check(group, settings)
    return settings


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
