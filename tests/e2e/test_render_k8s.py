"""`pdtopo render --format k8s`: golden GKE manifests, schema validation, the pod <-> plan entry
mapping, refusals. Regenerate the golden files with
PDTOPO_REGEN_GOLDEN=1 python -m pytest tests/e2e/test_render_k8s.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdtopo.cli import main
from pdtopo.config.credentials import derived_api_key
from pdtopo.launcher.plan.k8s import GROUP_VAR, WORKER_VAR, pod_name
from pdtopo.launcher.render.k8s import config_hash, to_yaml
from pdtopo.runtime.settings import TOKEN_ENV, load_process_context
from tests.support.constants import GOLDEN_DIR
from tests.support.golden import neutral_text

GOLDEN = GOLDEN_DIR / "k8s"
REGEN = os.environ.get("PDTOPO_REGEN_GOLDEN") == "1"
K8S_VERSION = "1.31"  # schemas bundled with kubernetes-validate (offline)
BASE = ["model=tiny_llama", "launcher.compilation_cache_dir=null"]

# LeaderWorkerSet v1 (CRD, not in the core schemas). Fields, types and enums taken from
# kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go: LeaderWorkerSetSpec
# {replicas int32 (default 1), leaderWorkerTemplate (required), rolloutStrategy, startupPolicy
# enum LeaderCreated|LeaderReady, networkConfig.subdomainPolicy enum Shared|UniquePerReplica};
# LeaderWorkerTemplate {leaderTemplate, workerTemplate (required; both corev1.PodTemplateSpec,
# validated below as core PodTemplates), size int32 (min 1, default 1), restartPolicy enum
# Default|RecreateGroupOnPodRestart|RecreateGroupAfterStart|None, subGroupPolicy,
# volumeClaimTemplates, persistentVolumeClaimRetentionPolicy}.
_OBJ = {"type": "object"}
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["leaderWorkerTemplate"], "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": _OBJ,
                "networkConfig": {"type": "object", "additionalProperties": False, "properties": {
                    "subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "leaderTemplate": _OBJ, "workerTemplate": _OBJ,
                        "size": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart",
                                                   "RecreateGroupAfterStart", "None"]},
                        "subGroupPolicy": _OBJ, "volumeClaimTemplates": {"type": "array"},
                        "persistentVolumeClaimRetentionPolicy": _OBJ,
                    },
                },
            },
        },
    },
}


def _render(tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    assert main(["render", "--format", "k8s", *BASE, *overrides, f"hydra.run.dir={run}"]) == 0
    return run


def _objects(run: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((run / "k8s").iterdir())}


def _kind(objects: dict[str, dict], kind: str) -> list[dict]:
    return [o for o in objects.values() if o["kind"] == kind]


@pytest.mark.parametrize("topology", ["1p1d_v6e16", "1p1d_v6e8"])
def test_k8s_manifests_golden(tmp_path, topology):
    run = _render(tmp_path, f"topology={topology}")
    token = (run / "token").read_text().strip()
    assert (run / "plan.json").is_file() and (run / "config.yaml").is_file()  # usual files too
    names = sorted(p.name for p in (run / "k8s").iterdir())
    secret = next(run / "k8s" / n for n in names if "-secret-" in n)
    assert secret.stat().st_mode & 0o077 == 0  # the token file is private
    assert token in secret.read_text()
    gdir = GOLDEN / topology
    if REGEN:
        gdir.mkdir(parents=True, exist_ok=True)
        for old in gdir.iterdir():
            old.unlink()
    config = (run / "config.yaml").read_text()
    assert "bind_host: null" in config  # pods listen on their own plan address
    cm = next(p for p in (run / "k8s").iterdir() if "-configmap-" in p.name)
    digest = config_hash(config, yaml.safe_load(cm.read_text())["data"]["plan.json"])
    for name in names:
        text = neutral_text((run / "k8s" / name).read_text(),
                            {token: "TOKEN", derived_api_key(token): "DERIVED_API_KEY"})
        obj = yaml.safe_load(text)
        if obj["kind"] == "ConfigMap":  # the composed config: RUN/config.yaml, not golden (it
            assert obj["data"]["config.yaml"] == config  # changes with every new config key)
            obj["data"]["config.yaml"] = "CONFIG"
            text = to_yaml(obj)
        text = neutral_text(text, {digest: "CONFIG_SHA256"})
        if obj["kind"] in ("Deployment", "LeaderWorkerSet"):
            assert "pdtopo.io/config-sha256: CONFIG_SHA256" in text  # pods roll on a new config
        if REGEN:
            (gdir / name).write_text(text)
        assert text == (gdir / name).read_text(), f"{gdir / name} differs (PDTOPO_REGEN_GOLDEN=1)"
    assert names == sorted(p.name for p in gdir.iterdir())


@pytest.mark.parametrize("topology", ["1p1d_v6e16", "1p1d_v6e8", "2p2d", "1p2d_v6e8_hetero"])
def test_k8s_manifests_validate_against_schemas(tmp_path, topology):
    objects = _objects(_render(tmp_path, f"topology={topology}"))
    kinds = sorted(o["kind"] for o in objects.values())
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "LeaderWorkerSet",
                     "LeaderWorkerSet", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy",
                     "Secret", "Service", "Service", "Service", "Service"]
    for obj in objects.values():
        if obj["kind"] == "LeaderWorkerSet":
            jsonschema.validate(obj, LWS_SCHEMA)
            lwt = obj["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:  # a corev1.PodTemplateSpec: validate as a core PodTemplate
                    wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                               "metadata": {"name": obj["metadata"]["name"]},
                               "template": lwt[key]}
                    kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # the validator does reject what the API server would: not a check that cannot fail
    bad = json.loads(json.dumps(_kind(objects, "Deployment")[0]))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    lws = json.loads(json.dumps(_kind(objects, "LeaderWorkerSet")[0]))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lws, LWS_SCHEMA)


def test_heterogeneous_roles_get_their_own_chips_and_mesh(tmp_path):
    """1p2d_v6e8_hetero: the prefill set asks for 4 TPU chips per pod and runs tp=4, the decode
    set 2 chips per pod in 2 replicas with tp=2 (each role from its own topology section)."""
    objects = _objects(_render(tmp_path, "topology=1p2d_v6e8_hetero"))
    plan = json.loads(_kind(objects, "ConfigMap")[0]["data"]["plan.json"])
    sets = {o["metadata"]["name"]: o for o in _kind(objects, "LeaderWorkerSet")}
    got = {}
    for name, lws in sets.items():
        role = "prefill" if "prefill" in name else "decode"
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        pod = (tmpl.get("leaderTemplate") or tmpl["workerTemplate"])["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        got[role] = (lws["spec"]["replicas"], int(limits["google.com/tpu"]))
    assert got == {"prefill": (1, 4), "decode": (2, 2)}
    meshes = {p["name"]: p["mesh"]["tp"] for p in plan["processes"]
              if p["role"] in ("prefill", "decode")}
    assert meshes == {"prefill_0": 4, "decode_0": 2, "decode_1": 2}


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a command argument or env value."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def _pod(container: dict, group: int, worker: int) -> tuple[list[str], dict[str, str], dict]:
    """What the container runs in the pod (group, worker): command and env after expansion."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if e["name"] in (GROUP_VAR, WORKER_VAR):
            label = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = str(group if "group-index" in label else worker)
        elif "value" in e:
            env[e["name"]] = _expand(e["value"], env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return [_expand(a, env) for a in container["command"]], env, ports


@pytest.mark.parametrize("topology,instances,size", [("1p1d_v6e16", 1, 2), ("2p2d", 2, 1)])
def test_every_pod_finds_its_plan_entry(tmp_path, topology, instances, size):
    """Expanding the LWS pod templates for every (group, worker) gives exactly the plan entry
    of that process: its name, env, ports and DNS address; the runtime loads its context."""
    objects = _objects(_render(tmp_path, f"topology={topology}"))
    cm = _kind(objects, "ConfigMap")[0]
    mount = tmp_path / "mount"
    mount.mkdir()
    for key, text in cm["data"].items():
        (mount / key).write_text(text)
    plan = json.loads(cm["data"]["plan.json"])
    procs = {p["name"]: p for p in plan["processes"]}
    seen = set()
    for lws in _kind(objects, "LeaderWorkerSet"):
        spec, name, ns = lws["spec"], lws["metadata"]["name"], lws["metadata"]["namespace"]
        assert spec["replicas"] == instances
        assert spec["leaderWorkerTemplate"]["size"] == size
        lwt = spec["leaderWorkerTemplate"]
        for g in range(instances):
            for w in range(size):
                tmpl = lwt["leaderTemplate"] if w == 0 and "leaderTemplate" in lwt \
                    else lwt["workerTemplate"]
                container = tmpl["spec"]["containers"][0]
                command, env, ports = _pod(container, g, w)
                pname = command[command.index("--process") + 1]
                proc = procs[pname]
                seen.add(pname)
                assert proc["address"] == f"{pod_name(name, g, w)}.{name}.{ns}.svc.cluster.local"
                assert proc["instance_id"] == f"{proc['role']}_{g}" and proc["leader"] == (w == 0)
                assert {k: v for k, v in env.items()
                        if k not in (GROUP_VAR, WORKER_VAR)} == proc["env"]
                assert "TPU_VISIBLE_CHIPS" not in env  # GKE's device plugin sets it
                assert ports == {k.replace("_", "-"): v for k, v in proc["ports"].items()}
                tpu = container["resources"]["limits"]["google.com/tpu"]
                assert container["resources"]["requests"]["google.com/tpu"] == tpu
                assert int(tpu) == len(proc["chips"])
                assert command[:3] == ["python", "-m", "pdtopo.runtime.server"]
                ctx = load_process_context(mount, pname)
                assert ctx.bind_host == proc["address"]  # listens on its own pod FQDN
                if size > 1:
                    leader = procs[f"{proc['role']}_{g}_p0"]
                    assert proc["distributed"]["coordinator"] == \
                        f"{leader['address']}:{leader['ports']['coordinator']}"
                    assert env["CLOUD_TPU_TASK_ID"] == str(w)
                    assert env["TPU_PROCESS_ADDRESSES"].split(",")[w].startswith(
                        proc["address"] + ":")
    servers = {n for n, p in procs.items() if p["role"] in ("prefill", "decode")}
    assert seen == servers  # every server process has a pod, and no pod is left without one
    # the router reaches the P/D leaders by their pod DNS names; bootstrap/proxy via Services
    router = " ".join(procs["proxy"]["command"])
    for p in procs.values():
        if p["role"] in ("prefill", "decode"):
            assert (f"http://{p['address']}:{p['ports']['http']}" in router) == p["leader"]
    assert plan["bootstrap_url"] == \
        f"http://{_kind(objects, 'Service')[0]['metadata']['name']}.default.svc.cluster.local:8998"
    assert not re.search(r"\b(10\.130|127\.0\.0)\.", cm["data"]["plan.json"])  # no host IPs


def test_secret_token_and_api_key_reach_the_pods(tmp_path):
    run = _render(tmp_path, "topology=1p1d_v6e8", "proxy.api_key=sekrit-key",
                  "k8s.namespace=serving", "k8s.name=pd", "k8s.image=registry.example/pd:1")
    objects = _objects(run)
    secret = _kind(objects, "Secret")[0]
    assert secret["metadata"] == {**secret["metadata"], "name": "pd-token", "namespace": "serving"}
    assert secret["stringData"] == {"token": (run / "token").read_text().strip(),
                                    "proxy-api-key": "sekrit-key"}
    cm = _kind(objects, "ConfigMap")[0]
    assert "sekrit-key" not in json.dumps(cm)  # only in the Secret
    proxy = next(o for o in _kind(objects, "Deployment") if o["metadata"]["name"] == "pd-proxy")
    c = proxy["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert refs == {TOKEN_ENV: {"name": "pd-token", "key": "token"},
                    "PDTOPO_PROXY_API_KEY": {"name": "pd-token", "key": "proxy-api-key"}}
    assert c["image"] == "registry.example/pd:1"
    assert c["command"][2:4] == ["pdtopo.launcher.programs.nodelay_exec", "--"]
    assert c["command"][6] == "pdtopo.launcher.programs.router_entry"
    assert "sekrit-key" not in " ".join(c["command"])


def test_cpu_topology_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["render", "--format", "k8s", "topology=1p1d_cpu", f"hydra.run.dir={run}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "topology.platform" in err and "'cpu'" in err and "TPU" in err
    assert not run.exists()  # nothing written


@pytest.mark.parametrize("overrides,key", [
    (["topology=2p2d", "+topology.decode.port_overrides={1: {http: 39000}}"],
     "topology.decode.port_overrides.1"),
    (["topology=1p1d_v6e8", "k8s.name=Bad_Name"], "k8s.name"),
    (["topology=1p1d_v6e8", "k8s.namespace=a.b"], "k8s.namespace"),
    (["topology=1p1d_v6e8", "k8s.monitoring_namespace=Mon_1"], "k8s.monitoring_namespace"),
    (["topology=1p1d_v6e8", "proxy.api_key_file=/etc/key"], "proxy.api_key_file"),
    (["topology=colocated_cpu"], "topology.platform"),
])
def test_bad_k8s_input_refused(tmp_path, capsys, overrides, key):
    run = tmp_path / "run"
    assert main(["render", "--format", "k8s", *overrides, f"hydra.run.dir={run}"]) == 2
    assert key in capsys.readouterr().err
    assert not run.exists()


def test_unknown_format_refused(tmp_path, capsys):
    assert main(["render", "--format", "helm", "topology=1p1d_v6e8",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert "--format" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_bootstrap_pod_command_serves_from_the_configmap(tmp_path):
    """The bootstrap Deployment's command (with --host, here 127.0.0.1 instead of 0.0.0.0)
    runs the real bootstrap server from the ConfigMap's files and answers /health."""
    import subprocess
    import sys
    import time

    import httpx

    from pdtopo.ports import free_port

    port = free_port()
    run = _render(tmp_path, "topology=1p1d_v6e8", f"topology.bootstrap.port={port}")
    objects = _objects(run)
    mount = tmp_path / "mount"
    mount.mkdir()
    for key, text in _kind(objects, "ConfigMap")[0]["data"].items():
        (mount / key).write_text(text)
    boot = next(o for o in _kind(objects, "Deployment") if o["metadata"]["name"].endswith(
        "-bootstrap"))
    command = boot["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--host", "0.0.0.0"]
    command = [sys.executable, *command[1:-1], "127.0.0.1"]
    command[command.index("--run-dir") + 1] = str(mount)
    token = (run / "token").read_text().strip()
    proc = subprocess.Popen(command, env={**os.environ, TOKEN_ENV: token},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, ok = time.monotonic() + 30, False
        while time.monotonic() < deadline and not ok:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert ok, "bootstrap did not answer /health"
        listed = httpx.get(f"http://127.0.0.1:{port}/list",
                           headers={"Authorization": f"Bearer {token}"}, timeout=2)
        assert listed.status_code == 200  # the Secret's token is the one it checks
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _pod_labels(objects) -> list[dict]:
    out = []
    for obj in objects.values():
        if obj["kind"] == "Deployment":
            out.append(obj["spec"]["template"]["metadata"]["labels"])
        elif obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            out += [lwt[k]["metadata"]["labels"] for k in ("leaderTemplate", "workerTemplate")
                    if k in lwt]
    return out


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_network_policies_fence_the_deployment(tmp_path):
    objects = _objects(_render(tmp_path, "topology=1p1d_v6e16"))
    policies = {o["metadata"]["name"]: o for o in _kind(objects, "NetworkPolicy")}
    prefix = "pdtopo-1p1d-v6e16"
    same, clients, metrics = (policies[f"{prefix}-{n}"] for n in ("same-deployment",
                                                                   "proxy-clients", "metrics"))
    pods = _pod_labels(objects)
    assert len(pods) == 6  # bootstrap, proxy, P and D: a leader and a worker template each
    for labels in pods:  # every pod is fenced, and admits every other pod of the deployment
        assert _selects(same["spec"]["podSelector"], labels)
        assert _selects(same["spec"]["ingress"][0]["from"][0]["podSelector"], labels)
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies.values())
    proxy_service = next(o for o in _kind(objects, "Service")
                         if o["metadata"]["name"].endswith("proxy"))
    http = next(p["port"] for p in proxy_service["spec"]["ports"] if p["name"] == "http")
    assert clients["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": http}]}]
    proxy_pods = [labels for labels in pods if labels["app.kubernetes.io/component"] == "proxy"]
    assert [_selects(clients["spec"]["podSelector"], labels) for labels in pods].count(True) \
        == len(proxy_pods) == 1
    rule = metrics["spec"]["ingress"][0]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    annotated = set()
    for obj in objects.values():
        templates = ([obj["spec"]["template"]] if obj["kind"] == "Deployment" else
                     list(obj["spec"]["leaderWorkerTemplate"].values())
                     if obj["kind"] == "LeaderWorkerSet" else [])
        for t in templates:
            if isinstance(t, dict) and "prometheus.io/port" in t["metadata"]["annotations"]:
                annotated.add(int(t["metadata"]["annotations"]["prometheus.io/port"]))
    assert {p["port"] for p in rule["ports"]} == annotated  # what is scraped is let in
    off = _objects(_render(tmp_path / "off", "topology=1p1d_v6e16",
                           "k8s.monitoring_namespace=null"))
    assert len(_kind(off, "NetworkPolicy")) == 2
