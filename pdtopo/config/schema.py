"""Typed schema of the topology DSL and proxy config group (OmegaConf structured configs).

`conf/topology/*.yaml` is merged onto `TopologySchema` and `conf/proxy/*.yaml` onto
`ProxySchema`; that merge type-checks every value and rejects unknown keys. The dataclasses are
also registered in Hydra's ConfigStore (`pdtopo_topology_schema`, `pdtopo_proxy_schema`) so tools can look them up by name.
`typed_topology(cfg)` / `typed_proxy(cfg)` are what the planner calls; they raise
`TopologyError` naming the offending key and value. Semantic checks (chips, ports, accelerator
splits) live in `pdtopo.launcher.plan.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

MODES = ("pd", "colocated", "local", "dp")  # dp: colocated instances behind the router
PLATFORMS = ("tpu", "cpu")
PROXY_KINDS = ("rust", "gateway", "mini_lb")
# The routing policies each proxy offers (sglang-router 0.3 and smg 1.13: `launch_router
# --help`); `manual` routes by a client header, `bucket` (prefill only) by prompt length.
PROXY_POLICIES = {
    "rust": {"policy": ("random", "round_robin", "cache_aware", "power_of_two", "manual",
                        "bucket"),
             "decode_policy": ("random", "round_robin", "cache_aware", "power_of_two",
                               "manual")},
    "gateway": {"policy": ("random", "round_robin", "cache_aware", "power_of_two", "manual",
                           "bucket", "consistent_hashing", "prefix_hash", "least_load"),
                "decode_policy": ("random", "round_robin", "cache_aware", "power_of_two",
                                  "manual", "consistent_hashing", "prefix_hash", "least_load")},
    "mini_lb": {"policy": ("random",), "decode_policy": ("random",)},
}
PORT_KINDS = ("http", "transfer", "zmq")
# what topology.<role>.port_overrides may set: the server ports, and on TPU the
# TPU_PROCESS_PORT of a one-process instance
OVERRIDE_PORT_KINDS = (*PORT_KINDS, "tpu_process")
# supervisord kills a program this many seconds after asking it to stop (every program's
# stopwaitsecs); a proxy's own shutdown grace must end before that
PROGRAM_STOP_WAIT_S = 15


class TopologyError(ValueError):
    """A topology/config value that cannot be planned or launched.

    `key` is the full config key (e.g. `topology.prefill.chips`), `value` the offending value.
    """

    def __init__(self, key: str, value: Any, message: str) -> None:
        self.key = key
        self.value = value
        self.message = message
        super().__init__(f"{key}={value!r}: {message}")


@dataclass
class HostSchema:
    name: str = "localhost"
    address: str = "127.0.0.1"  # IP literal or DNS name other hosts reach this one at
    chips: int | None = None    # chips on this host (null: the accelerator's chips per host)


@dataclass
class PlacementSchema:
    """Where a singleton program (bootstrap server, proxy) runs and listens."""

    host: str = "localhost"
    port: int = 8998
    prometheus_port: int | None = None


@dataclass
class PortBasesSchema:
    http_base: int = 30000
    transfer_base: int = 31000
    zmq_base: int = 32000
    tpu_process_base: int = 8476
    coordinator_base: int = 33000  # jax.distributed coordinator (process 0 of a multi-process instance)
    control_base: int = 34000      # leader -> followers broadcast (leader of a multi-process instance)


@dataclass
class RoleEngineSchema:
    """Per-role engine values (null = use `engine.*`): page_size and kv_dtype, which P and D
    must agree on, and the pool size num_pages, which may differ (e.g. a P pool sized for its
    prefix cache, a D pool for its decode batch)."""

    page_size: int | None = None
    kv_dtype: str | None = None
    num_pages: int | None = None


@dataclass
class RoleSchema:
    """One server role (prefill, decode or colocated)."""

    instances: int = 1
    processes_per_instance: int = 1  # N > 1: one instance = one N-process JAX cluster
    chips_per_instance: int = 1
    chips_per_process: int | None = None  # null: chips_per_instance / processes_per_instance
    # explicit host chip ids, one list per process (instance-major), replaces chips_per_*
    chips: list[list[int]] | None = None
    mesh: dict[str, int] = field(default_factory=lambda: {"tp": 1})  # the whole instance's mesh
    host: str | None = None
    hosts: list[str] | None = None  # one host per process (instance-major), replaces `host`
    # instance index -> {http|transfer|zmq|tpu_process: port}; replaces base + k for that
    # instance (`pdtopo scale` writes one per instance, so running programs keep their ports)
    port_overrides: dict[int, dict[str, int]] = field(default_factory=dict)
    engine: RoleEngineSchema = field(default_factory=RoleEngineSchema)


@dataclass
class TopologySchema:
    name: str = "unnamed"
    mode: str = "pd"
    platform: str = "cpu"
    accelerator: str = "cpu-2"
    hosts: list[HostSchema] = field(default_factory=lambda: [HostSchema()])
    bootstrap: PlacementSchema = field(default_factory=PlacementSchema)
    proxy: PlacementSchema = field(
        default_factory=lambda: PlacementSchema(port=8000, prometheus_port=29100)
    )
    ports: PortBasesSchema = field(default_factory=PortBasesSchema)
    prefill: RoleSchema = field(default_factory=RoleSchema)
    decode: RoleSchema = field(default_factory=RoleSchema)
    colocated: RoleSchema = field(default_factory=RoleSchema)
    # mode local: chips of the in-process prefill / decode engines, e.g. "4", "2x2", ["2", "2"]
    # (pdtopo.config.local_slices); the prefill/decode role sections are not used then
    prefill_slices: Any = None
    decode_slices: Any = None


@dataclass
class ProxySchema:
    kind: str = "rust"
    policy: str = "round_robin"
    decode_policy: str = "round_robin"
    api_key: str | None = None       # prefer ${oc.env:VAR} or api_key_file to a literal
    api_key_file: str | None = None  # file whose first line is the key (read at proxy start)
    request_timeout_s: int = 600
    health_check_interval_s: int = 2
    health_failure_threshold: int = 2  # rust, gateway: failed checks in a row before a worker is out
    health_check_timeout_s: int = 2    # rust, gateway: a health check slower than this failed
    retries: int | None = None        # rust, gateway: null = router default, 0 = --disable-retries
    # rust, gateway: false = --disable-circuit-breaker (default: the router charges a PD pair's
    # failure to both workers, so a dead D opens every P's circuit)
    circuit_breaker: bool = False
    shutdown_grace_s: int = 10        # gateway: how long a stopping proxy lets requests finish
    # gateway: seconds between its polls of every worker's load (null: its own default, 10 s,
    # whose stale view sends a burst of new requests all to one worker)
    load_monitor_interval_s: int | None = None
    # rust: TCP_NODELAY on the client connections the router accepts (pdtopo.launcher.programs.nodelay_exec);
    # "auto" = when a C compiler is there, true = required, false = off
    client_nodelay: Any = "auto"
    # rust, gateway: more router flags, appended to pdtopo's (e.g. ["--worker-wedge-secs",
    # "30"]); a flag pdtopo sets itself is refused at plan time
    extra_args: list[str] = field(default_factory=list)


def _typed(schema: type, node: Any, prefix: str) -> Any:
    if node is None:
        raise TopologyError(prefix, None, "missing config section")
    try:
        # plain container: a structured node may carry keys added with open_dict/`+key=`
        plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
            else node
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        full = f"{prefix}.{key}" if key else prefix
        value = getattr(exc, "value", None)
        if value is None and isinstance(node, DictConfig) and key:
            value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TopologyError(full, value, f"invalid value or unknown key ({reason})") from None


def typed_topology(cfg: DictConfig) -> TopologySchema:
    return _typed(TopologySchema, cfg.get("topology"), "topology")


def typed_proxy(cfg: DictConfig) -> ProxySchema:
    return _typed(ProxySchema, cfg.get("proxy"), "proxy")


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="pdtopo_topology_schema", node=TopologySchema)
    cs.store(name="pdtopo_proxy_schema", node=ProxySchema)


register_schemas()
