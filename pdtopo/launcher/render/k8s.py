"""Render a PD TPU deployment as Kubernetes objects for GKE (pure; `write_k8s_dir` writes them).

`render_k8s(plan, groups, settings, config_text=, token=, api_key=)` takes the k8s form of the
plan (`pdtopo.launcher.plan.k8s.k8s_plan`) and returns {file name: object}; `to_yaml` dumps one
object deterministically (sorted keys, block strings). One file per object, numbered so that
`kubectl apply -f RUN/k8s/` creates the Secret and ConfigMap first:

  00-secret-<prefix>-token          deployment token (+ proxy API key), generated per render
  01-configmap-<prefix>-run         config.yaml + plan.json, mounted at k8s.run_dir in every pod
  05-networkpolicy-<prefix>-*       ingress fences: the deployment's pods accept traffic only
                                    from each other (by pod labels: the transfer library binds
                                    random ports), the proxy also from clients on its port, and
                                    the metrics ports from k8s.monitoring_namespace
  10-service-<prefix>-bootstrap|proxy       ClusterIP Services
  10-service-<prefix>-prefill|decode-kv     headless Services: transfer + side-channel ports
  20-deployment-<prefix>-bootstrap|proxy    one pod each
  30-leaderworkerset-<prefix>-prefill|decode  one group per instance, one pod per process

Server pods find their plan entry through `$(PDTOPO_GROUP_INDEX)` / `$(PDTOPO_WORKER_INDEX)`,
env vars filled from the LWS pod labels by the downward API, which Kubernetes expands in the
container command and env (see plan/k8s.py for the address and port mapping).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import yaml

from pdtopo.config.credentials import API_KEY_ENV
from pdtopo.config.run_files import CONFIG_FILE, PLAN_FILE, TOKEN_ENV
from pdtopo.launcher.plan.expand import Plan, Process
from pdtopo.launcher.plan.k8s import (
    GROUP_REF,
    GROUP_VAR,
    WORKER_REF,
    WORKER_VAR,
    K8sSettings,
    RoleGroup,
)
from pdtopo.launcher.plan.tpu_env import accelerator_spec

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
TOKEN_KEY = "token"
API_KEY_KEY = "proxy-api-key"
CONFIG_HASH_ANNOTATION = "pdtopo.io/config-sha256"
RUN_VOLUME = "run"
K8S_DIR = "k8s"
# plan port kind -> container port name (IANA service names: <= 15 chars, [a-z0-9-])
PORT_NAMES = {"http": "http", "transfer": "transfer", "zmq": "zmq", "tpu_process": "tpu-process",
              "coordinator": "coordinator", "control": "control", "prometheus": "prometheus"}


def labels(s: K8sSettings, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pdtopo", "app.kubernetes.io/instance": s.prefix,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "pdtopo"}


def _selector(s: K8sSettings, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": s.prefix, "app.kubernetes.io/component": component}


def _meta(s: K8sSettings, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": s.namespace, "labels": labels(s, component)}


def _ports(ports: dict[str, int]) -> list[dict[str, Any]]:
    order = list(PORT_NAMES)
    return [{"name": PORT_NAMES[k], "containerPort": int(ports[k]), "protocol": "TCP"}
            for k in sorted(ports, key=order.index)]


def _env(s: K8sSettings, env: dict[str, str], *, indices: bool,
         api_key: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if indices:  # first: later entries and the command refer to them as $(NAME)
        for var, label in ((GROUP_VAR, LWS_GROUP_LABEL), (WORKER_VAR, LWS_WORKER_LABEL)):
            out.append({"name": var, "valueFrom": {"fieldRef": {
                "apiVersion": "v1", "fieldPath": f"metadata.labels['{label}']"}}})
    secret = s.name("token")
    out.append({"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret,
                                                                  "key": TOKEN_KEY}}})
    if api_key:
        out.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": secret, "key": API_KEY_KEY}}})
    out += [{"name": k, "value": str(env[k])} for k in sorted(env)]
    return out


def _container(s: K8sSettings, name: str, command: list[str], env: list[dict[str, Any]],
               ports: dict[str, int]) -> dict[str, Any]:
    return {
        "name": name, "image": s.image, "imagePullPolicy": s.image_pull_policy,
        "command": list(command), "env": env, "ports": _ports(ports),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "volumeMounts": [{"name": RUN_VOLUME, "mountPath": s.run_dir, "readOnly": True}],
    }


def _pod_template(s: K8sSettings, component: str, container: dict[str, Any],
                  config_hash: str, *, tpu: dict[str, Any] | None = None,
                  metrics_port: int | None = None) -> dict[str, Any]:
    """`metrics_port`: where the pod serves Prometheus /metrics (the prometheus.io/*
    annotations that annotation-based scrape configs discover pods by)."""
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": RUN_VOLUME, "configMap": {"name": s.name("run")}}],
    }
    if tpu is not None:
        spec["nodeSelector"] = tpu["node_selector"]
        spec["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists",
                                "effect": "NoSchedule"}]
        chips = str(tpu["chips"])
        container["resources"] = {"requests": {TPU_RESOURCE: chips},
                                  "limits": {TPU_RESOURCE: chips}}
    annotations = {CONFIG_HASH_ANNOTATION: config_hash}
    if metrics_port is not None:
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                            "prometheus.io/port": str(metrics_port)})
    return {"metadata": {"labels": labels(s, component), "annotations": annotations},
            "spec": spec}


def _server_template(group: RoleGroup, leader: bool, config_hash: str,
                     node_selector: dict[str, str]) -> dict[str, Any]:
    s = group.settings
    worker: int | str = 0 if leader or group.size == 1 else WORKER_REF
    container = _container(s, group.role, group.command(GROUP_REF, worker),
                           _env(s, group.env(GROUP_REF, worker), indices=True,
                                api_key=group.api_key),
                           group.ports(worker))
    serves = leader or group.size == 1  # followers serve no /metrics
    return _pod_template(s, group.role, container, config_hash,
                         tpu={"node_selector": node_selector, "chips": group.chips},
                         metrics_port=group.ports(worker).get("http") if serves else None)


def leader_worker_set(group: RoleGroup, config_hash: str,
                      node_selector: dict[str, str]) -> dict[str, Any]:
    s = group.settings
    template: dict[str, Any] = {"size": group.size, "restartPolicy": "RecreateGroupOnPodRestart",
                                "workerTemplate": _server_template(group, group.size == 1,
                                                                   config_hash, node_selector)}
    if group.size > 1:
        template["leaderTemplate"] = _server_template(group, True, config_hash, node_selector)
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
            "metadata": _meta(s, group.lws, group.role),
            "spec": {"replicas": group.instances, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": template}}


def _deployment(s: K8sSettings, proc: Process, config_hash: str,
                api_key: bool = False) -> dict[str, Any]:
    container = _container(s, proc.role, proc.command,
                           _env(s, proc.env, indices=False, api_key=api_key), proc.ports)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(s, proc.host, proc.role),
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": _selector(s, proc.role)},
                     "template": _pod_template(s, proc.role, container, config_hash,
                                               metrics_port=proc.ports.get("prometheus"))}}


def _service(s: K8sSettings, name: str, component: str, ports: dict[str, int],
             selector: dict[str, str], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"],
                   "protocol": "TCP"} for p in _ports(ports)],
    }
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    else:
        spec["type"] = "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(s, name, component),
            "spec": spec}


def _policy(s: K8sSettings, name: str, pods: dict[str, str],
            ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(s, s.name(name), "network-policy"),
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def network_policies(s: K8sSettings, proxy: Process,
                     groups: list[RoleGroup]) -> list[dict[str, Any]]:
    """Ingress policies (they add up): every pod of the deployment from the deployment's own
    pods on any port; the proxy pod from anywhere on its HTTP port; the servers' /metrics
    (their HTTP ports) and the router's prometheus port from the monitoring namespace."""
    mine = {"app.kubernetes.io/instance": s.prefix}
    out = [_policy(s, "same-deployment", mine, [{"from": [{"podSelector": {"matchLabels":
                                                                           mine}}]}]),
           _policy(s, "proxy-clients", _selector(s, "proxy"),
                   [{"ports": [{"protocol": "TCP", "port": int(proxy.ports["http"])}]}])]
    if s.monitoring_namespace:
        ports = sorted({int(g.leader_ports["http"]) for g in groups}
                       | ({int(proxy.ports["prometheus"])} if "prometheus" in proxy.ports
                          else set()))
        out.append(_policy(s, "metrics", mine, [{
            "from": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": s.monitoring_namespace}}}],
            "ports": [{"protocol": "TCP", "port": p} for p in ports]}]))
    return out


def config_hash(config_text: str, plan_json: str) -> str:
    return hashlib.sha256((config_text + "\0" + plan_json).encode()).hexdigest()


def render_k8s(plan: Plan, groups: list[RoleGroup], s: K8sSettings, *, config_text: str,
               token: str, api_key: str | None = None) -> dict[str, dict[str, Any]]:
    """{file name: Kubernetes object} of the deployment (see the module docstring)."""
    acc = accelerator_spec(plan.accelerator, plan.platform)
    node_selector = {GKE_ACCELERATOR_LABEL: str(acc.gke_accelerator),
                     GKE_TOPOLOGY_LABEL: str(acc.gke_topology)}
    plan_json = plan.to_json()
    digest = config_hash(config_text, plan_json)
    procs = plan.by_name()
    secret_data = {TOKEN_KEY: token}
    if api_key:
        secret_data[API_KEY_KEY] = api_key
    objects: dict[str, dict[str, Any]] = {}

    def add(order: int, obj: dict[str, Any]) -> None:
        objects[f"{order:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj

    add(0, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(s, s.name("token"), "token"), "stringData": secret_data})
    add(1, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(s, s.name("run"), "run"),
            "data": {CONFIG_FILE: config_text, PLAN_FILE: plan_json}})
    for policy in network_policies(s, procs["proxy"], groups):
        add(5, policy)
    for role in ("bootstrap", "proxy"):
        proc = procs[role]
        add(10, _service(s, proc.host, role, proc.ports, _selector(s, role)))
        add(20, _deployment(s, proc, digest, api_key=API_KEY_ENV in proc.secret_env))
    for group in groups:
        kv = {k: v for k, v in group.leader_ports.items() if k in ("transfer", "zmq")}
        add(10, _service(s, f"{group.lws}-kv", group.role, kv, {LWS_NAME_LABEL: group.lws},
                         headless=True))
        add(30, leader_worker_set(group, digest, node_selector))
    return dict(sorted(objects.items()))


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # every object spelled out, no &id anchors
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=True, default_flow_style=False, width=100)


def write_k8s_dir(run_dir: Path, objects: dict[str, dict[str, Any]]) -> Path:
    """RUN/k8s/<file> per object; the Secret's file is mode 0600. Returns the directory."""
    out = Path(run_dir) / K8S_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, obj in objects.items():
        path = out / name
        if obj["kind"] == "Secret":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(to_yaml(obj))
        else:
            path.write_text(to_yaml(obj))
    return out
