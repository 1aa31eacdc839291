"""Kubernetes form of a plan: the same programs, addressed by in-cluster DNS names.

`k8s_plan(plan, cfg)` takes the validated `Plan` of a PD TPU topology and returns
`(Plan, [RoleGroup])`: the plan that the pods read (its `plan.json` goes into the ConfigMap)
and, per server role, the facts one LeaderWorkerSet needs. Pure: no I/O.

Mapping (docs/topology.md, "Kubernetes"):
- role R (prefill, decode) -> one LeaderWorkerSet `<prefix>-R`, one group per instance
  (`replicas = instances`), one pod per process (`size = processes_per_instance`). Process
  `R_g` / `R_g_pW` is the pod of group g, worker index W: `<lws>-g` (the leader, W = 0) or
  `<lws>-g-W`, whose address is `<pod>.<lws>.<namespace>.svc.<cluster_domain>` (LWS's own
  headless Service `<lws>` is the pods' subdomain; it publishes not-ready pods, and the pod's
  own FQDN is in its /etc/hosts, so a program can bind it at once).
- every pod of a role uses the ports of the role's first plan process (pods have their own
  IPs; one pod template serves every group), the leader also `coordinator` and `control`.
- bootstrap and proxy: a Deployment behind a ClusterIP Service `<prefix>-bootstrap|proxy`,
  addressed `<service>.<namespace>.svc.<cluster_domain>`, listening on 0.0.0.0.
- environment: the plan's, minus what GKE provides (`TPU_VISIBLE_CHIPS`: the TPU device plugin
  exposes exactly the pod's chips, numbered from 0), with TPU_PROCESS_ADDRESSES naming pods.
Pod templates are the same functions evaluated with `$(PDTOPO_GROUP_INDEX)` /
`$(PDTOPO_WORKER_INDEX)` in place of g and W; Kubernetes expands those references in the
command and env from the downward API (the LWS group-index / worker-index pod labels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.credentials import API_KEY_DERIVED_ENV, API_KEY_ENV
from pdtopo.config.schema import TopologyError, typed_proxy, typed_topology
from pdtopo.config.settings import group_settings
from pdtopo.launcher.plan.expand import Plan, Process, process_name, router_command
from pdtopo.launcher.plan.tpu_env import Accelerator, accelerator_spec

SERVER_ROLES = ("prefill", "decode")
GROUP_VAR = "PDTOPO_GROUP_INDEX"
WORKER_VAR = "PDTOPO_WORKER_INDEX"
GROUP_REF = f"$({GROUP_VAR})"
WORKER_REF = f"$({WORKER_VAR})"
# set per container by GKE's TPU device plugin; the topology's host chip ids mean nothing there
GKE_PROVIDED_ENV = ("TPU_VISIBLE_CHIPS",)
LISTEN_ALL = "0.0.0.0"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class K8sSettings:
    """The `k8s:` config section (conf/config.yaml)."""

    namespace: str = "default"
    prefix: str = "pdtopo"
    image: str = "pdtopo:latest"
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    run_dir: str = "/etc/pdtopo"
    python: str = "python"
    monitoring_namespace: str | None = "monitoring"

    @classmethod
    def from_cfg(cls, cfg: DictConfig, topology: str) -> K8sSettings:
        sel = lambda key, default: OmegaConf.select(cfg, f"k8s.{key}", default=default)  # noqa: E731
        name = sel("name", None)
        prefix = str(name) if name else default_prefix(topology)
        s = cls(namespace=str(sel("namespace", cls.namespace)), prefix=prefix,
                image=str(sel("image", cls.image) or ""),
                image_pull_policy=str(sel("image_pull_policy", cls.image_pull_policy)),
                cluster_domain=str(sel("cluster_domain", cls.cluster_domain)),
                run_dir=str(sel("run_dir", cls.run_dir)), python=str(sel("python", cls.python)),
                monitoring_namespace=(None if sel("monitoring_namespace", cls.monitoring_namespace)
                                      is None else str(sel("monitoring_namespace", None))))
        s.check()
        return s

    def check(self) -> None:
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise TopologyError("k8s.namespace", self.namespace,
                                "must be a DNS label (lowercase letters, digits, '-')")
        # the longest derived name is a worker pod's hostname <prefix>-decode-<g>-<w> (<= 63)
        if not _DNS_LABEL.match(self.prefix) or len(self.prefix) > 40:
            raise TopologyError("k8s.name", self.prefix, "object name prefix must be a DNS "
                                "label of at most 40 characters starting with a letter")
        if not self.image.strip():
            raise TopologyError("k8s.image", self.image, "a container image with pdtopo is needed")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise TopologyError("k8s.image_pull_policy", self.image_pull_policy,
                                "must be Always, IfNotPresent or Never")
        if not _DNS_SUBDOMAIN.match(self.cluster_domain):
            raise TopologyError("k8s.cluster_domain", self.cluster_domain, "not a DNS name")
        ns = self.monitoring_namespace
        if ns is not None and (not _DNS_LABEL.match(ns) or len(ns) > 63):
            raise TopologyError("k8s.monitoring_namespace", ns,
                                "must be a DNS label or null (no scraping from outside)")
        if not self.run_dir.startswith("/"):
            raise TopologyError("k8s.run_dir", self.run_dir, "must be an absolute path")

    def name(self, part: str) -> str:
        return f"{self.prefix}-{part}"

    def service_address(self, part: str) -> str:
        return f"{self.name(part)}.{self.namespace}.svc.{self.cluster_domain}"


def default_prefix(topology: str) -> str:
    """`pdtopo-<topology name>` as a DNS label (`1p1d_v6e16` -> `pdtopo-1p1d-v6e16`)."""
    slug = re.sub(r"[^a-z0-9]+", "-", topology.lower()).strip("-")
    return f"pdtopo-{slug}"[:40].rstrip("-")


def pod_name(lws: str, group: int | str, worker: int | str) -> str:
    """LWS pod names: the leader `<lws>-<group>`, worker W `<lws>-<group>-<W>`."""
    return f"{lws}-{group}" if str(worker) == "0" else f"{lws}-{group}-{worker}"


@dataclass(frozen=True)
class RoleGroup:
    """One LeaderWorkerSet: a server role's instances (groups) and processes (pods)."""

    role: str
    lws: str
    instances: int
    size: int
    chips: int                      # google.com/tpu per pod
    module: str                     # python -m entry of the server
    leader_ports: dict[str, int]
    worker_ports: dict[str, int]
    base_env: dict[str, str]        # the role's env without per-pod values
    settings: K8sSettings = field(repr=False)
    api_key: bool = False           # the pods get the proxy API key from the Secret

    def address(self, group: int | str, worker: int | str) -> str:
        s = self.settings
        return f"{pod_name(self.lws, group, worker)}.{self.lws}.{s.namespace}.svc.{s.cluster_domain}"

    def process(self, group: int | str, worker: int | str) -> str:
        return process_name(self.role, group, worker, self.size)  # type: ignore[arg-type]

    def ports(self, worker: int | str) -> dict[str, int]:
        return dict(self.leader_ports if str(worker) == "0" else self.worker_ports)

    def env(self, group: int | str, worker: int | str) -> dict[str, str]:
        """Environment of the process (group, worker); placeholders allowed for both."""
        env = dict(self.base_env)
        tpu = self.leader_ports.get("tpu_process")
        if tpu is not None:
            env["TPU_PROCESS_PORT"] = str(tpu)
            env["TPU_PROCESS_ADDRESSES"] = (
                f"localhost:{tpu}" if self.size == 1 else
                ",".join(f"{self.address(group, m)}:{tpu}" for m in range(self.size)))
            env["CLOUD_TPU_TASK_ID"] = str(worker)
        return env

    def command(self, group: int | str, worker: int | str) -> list[str]:
        s = self.settings
        return [s.python, "-m", self.module, "--run-dir", s.run_dir,
                "--process", self.process(group, worker)]


def _refuse(plan: Plan, acc: Accelerator) -> None:
    if plan.platform != "tpu":
        raise TopologyError("topology.platform", plan.platform,
                            "`--format k8s` writes manifests for GKE TPU node pools; a cpu "
                            "topology has none (render a tpu topology, e.g. topology=1p1d_v6e8)")
    if plan.mode != "pd":
        raise TopologyError("topology.mode", plan.mode,
                            "`--format k8s` renders PD deployments (mode pd) only")
    if not acc.gke_accelerator or not acc.gke_topology:
        raise TopologyError("topology.accelerator", acc.name, "has no GKE node labels")


def _role_group(plan: Plan, cfg: DictConfig, role: str, s: K8sSettings) -> RoleGroup:
    procs = [p for p in plan.processes if p.role == role]
    spec = getattr(typed_topology(cfg), role)
    extra = sorted(i for i in spec.port_overrides if int(i) != 0)
    if extra:
        raise TopologyError(f"topology.{role}.port_overrides.{extra[0]}",
                            dict(spec.port_overrides[extra[0]]),
                            "every instance of a role runs from one LeaderWorkerSet pod "
                            "template and shares its ports; only instance 0's overrides apply "
                            "(to all instances)")
    size = spec.processes_per_instance
    first = procs[0]
    base_env = {k: v for k, v in first.env.items() if k not in GKE_PROVIDED_ENV}
    return RoleGroup(role=role, lws=s.name(role), instances=spec.instances, size=size,
                     chips=len(first.chips), module=first.command[2],
                     leader_ports=dict(first.ports),
                     worker_ports={k: v for k, v in first.ports.items()
                                   if k not in ("coordinator", "control")},
                     base_env=base_env, settings=s, api_key=API_KEY_ENV in first.secret_env)


def _server(group: RoleGroup, template: Process, g: int, w: int) -> Process:
    address = group.address(g, w)
    ports = group.ports(w)
    distributed = None
    if group.size > 1:
        distributed = {"coordinator": f"{group.address(g, 0)}:{group.leader_ports['coordinator']}",
                       "num_processes": group.size, "process_id": w,
                       "local_device_ids": list(range(group.chips))}
    return replace(template, name=group.process(g, w), host=pod_name(group.lws, g, w),
                   address=address, instance_id=f"{group.role}_{g}",
                   chips=list(range(group.chips)), ports=ports, env=group.env(g, w),
                   command=group.command(g, w),
                   health_url=f"http://{address}:{ports['http']}/health",
                   cpu_affinity=None, distributed=distributed, leader=w == 0,
                   port_keys={}, secret_env=_from_secret(template))


def _from_secret(proc: Process) -> dict[str, str]:
    return {API_KEY_ENV: "<from the Secret>"} if API_KEY_ENV in proc.secret_env else {}


def k8s_plan(plan: Plan, cfg: DictConfig) -> tuple[Plan, list[RoleGroup], K8sSettings]:
    """The plan the pods of a GKE deployment read, its LWS groups and the k8s settings."""
    acc = accelerator_spec(plan.accelerator, plan.platform)
    _refuse(plan, acc)
    proxy_cfg = typed_proxy(cfg)
    if proxy_cfg.api_key_file:
        raise TopologyError("proxy.api_key_file", proxy_cfg.api_key_file,
                            "a host file is not in the proxy pod: give proxy.api_key (it goes "
                            "into the deployment's Secret) for --format k8s")
    if OmegaConf.select(cfg, "planner.enabled", default=False):
        raise TopologyError("planner.enabled", True, "the live planner runs under supervisord "
                            "and acts through `pdtopo scale`; the manifests have no planner "
                            "and fixed replica counts (scale a LeaderWorkerSet's replicas by "
                            "hand, or run the planner with mode=recommend on a supervisord "
                            "deployment of the same topology): set planner.enabled=false")
    s = K8sSettings.from_cfg(cfg, plan.topology)
    by_name = plan.by_name()
    groups = [_role_group(plan, cfg, role, s) for role in SERVER_ROLES]
    servers: dict[str, list[Process]] = {}
    for group in groups:
        servers[group.role] = [
            _server(group, by_name[process_name(group.role, g, w, group.size)], g, w)
            for g in range(group.instances) for w in range(group.size)]
    boot = by_name["bootstrap"]
    boot_addr = s.service_address("bootstrap")
    boot = replace(boot, host=s.name("bootstrap"), address=boot_addr,
                   command=[s.python, "-m", boot.command[2], "--run-dir", s.run_dir,
                            "--process", "bootstrap", "--host", LISTEN_ALL],
                   health_url=f"http://{boot_addr}:{boot.ports['http']}/health",
                   cpu_affinity=None, port_keys={})
    prox = by_name["proxy"]
    prox_addr = s.service_address("proxy")
    leaders = {r: [p for p in servers[r] if p.leader] for r in SERVER_ROLES}
    prox = replace(prox, host=s.name("proxy"), address=prox_addr,
                   command=router_command(s.python, proxy_cfg, LISTEN_ALL, prox.ports,
                                          leaders["prefill"], leaders["decode"],
                                          max_body_bytes=group_settings(
                                              cfg, "server").max_body_bytes,
                                          derived_key=API_KEY_DERIVED_ENV in prox.env),
                   health_url=f"http://{prox_addr}:{prox.ports['http']}/health",
                   cpu_affinity=None, port_keys={}, secret_env=_from_secret(prox))
    processes = [boot, *servers["prefill"], *servers["decode"], prox]
    out = Plan(topology=plan.topology, mode=plan.mode, platform=plan.platform,
               accelerator=plan.accelerator, bootstrap_url=boot.url, proxy_url=prox.url,
               processes=processes, warnings=list(plan.warnings))
    return out, groups, s

