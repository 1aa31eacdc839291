"""Who must show a credential over HTTP (server.http_auth), the derived proxy API key, the
401 a P/D server answers without one, and what the planner gives each program. Real ASGI app
and a real follower health server; no deployment (tests/e2e/test_http_auth_e2e.py runs one)."""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdtopo.config.compose import compose_config
from pdtopo.config.credentials import (
    API_KEY_DERIVED_ENV,
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    beyond_loopback,
    derived_api_key,
    http_auth_on,
    read_api_key,
)
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.programs.nodelay_exec import inner_command
from pdtopo.launcher.render.run_dir import new_token, write_run_dir
from pdtopo.runtime.api.http_auth import HttpAuthMiddleware, HttpGuard
from pdtopo.runtime.distributed.health import HealthServer

TOKEN = "deployment-token-0123456789abcdef"


@pytest.mark.parametrize(("host", "routable"), [
    (None, True), ("0.0.0.0", True), ("10.200.0.1", True), ("::", True), ("node-a", True),
    ("127.0.0.1", False), ("127.0.0.2", False), ("::1", False), ("localhost", False)])
def test_beyond_loopback(host, routable):
    assert beyond_loopback(host) is routable


def test_auto_guards_p_and_d_beyond_loopback_only():
    for role in ("prefill", "decode"):
        assert http_auth_on("auto", role, None) and http_auth_on("auto", role, "10.0.0.2")
        assert not http_auth_on("auto", role, "127.0.0.1")
        assert http_auth_on(True, role, "127.0.0.1")
        assert not http_auth_on(False, role, None)
    assert not http_auth_on("auto", "colocated", None, "colocated")  # the clients' entry point
    assert http_auth_on("auto", "colocated", None, "dp")  # behind the router: like P and D
    assert not http_auth_on("auto", "colocated", "127.0.0.1", "dp")
    assert http_auth_on(True, "colocated", "127.0.0.1") and http_auth_on(True, "local", None)
    for role in ("bootstrap", "proxy"):  # they have their own (token / API key)
        assert not http_auth_on(True, role, None)


def test_derived_key_is_stable_per_token_and_hides_it():
    key = derived_api_key(TOKEN)
    assert key == derived_api_key(TOKEN) and len(key) == 64
    assert key != derived_api_key(TOKEN + "x") and TOKEN not in key
    with pytest.raises(ValueError, match="PDTOPO_DEPLOYMENT_TOKEN"):
        derived_api_key("")


def test_read_api_key_sources(tmp_path):
    assert read_api_key({API_KEY_ENV: "k1", API_KEY_DERIVED_ENV: "1"}, TOKEN) == "k1"
    keyfile = tmp_path / "key"
    keyfile.write_text("k2\nignored\n")
    assert read_api_key({API_KEY_FILE_ENV: str(keyfile)}, None) == "k2"
    assert read_api_key({API_KEY_DERIVED_ENV: "1"}, TOKEN) == derived_api_key(TOKEN)
    assert read_api_key({}, TOKEN) is None
    with pytest.raises(ValueError, match=r"proxy.api_key_file=.*cannot read it"):
        read_api_key({API_KEY_FILE_ENV: str(tmp_path / "missing")}, None)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"proxy.api_key_file=.* is empty"):
        read_api_key({API_KEY_FILE_ENV: str(tmp_path / "empty")}, None)


def _ctx(setting="auto", role="prefill", bind_host=None, api_key="the-key", token=TOKEN):
    return SimpleNamespace(settings=SimpleNamespace(server=SimpleNamespace(http_auth=setting)),
                           role=role, bind_host=bind_host or "10.200.0.1", name=f"{role}_0",
                           api_key=api_key, token=token, plan={"mode": "pd"})


def test_guard_accepts_the_key_or_the_token_only():
    guard = HttpGuard.from_context(_ctx())
    assert guard.required
    assert guard.problem("Bearer the-key") is None
    assert guard.problem(f"bearer {TOKEN}") is None  # the scheme is case-insensitive
    assert "requires a credential" in guard.problem(None)
    assert "requires a credential" in guard.problem("Basic dXNlcjpwdw==")
    assert "requires a credential" in guard.problem("Bearer ")
    assert "wrong credential" in guard.problem("Bearer the-key-but-longer")
    assert not HttpGuard.from_context(_ctx(bind_host="127.0.0.1")).required  # loopback: off
    forced = HttpGuard.from_context(_ctx(setting=True, bind_host="127.0.0.1", api_key=None))
    assert forced.accepted == (TOKEN,)  # server.http_auth=true: loopback too


def test_a_guarded_server_without_any_credential_refuses_to_start():
    with pytest.raises(RuntimeError, match=r"server.http_auth='auto': prefill_0 \(listening on 10.200.0.1\)"):
        HttpGuard.from_context(_ctx(api_key=None, token=None))


@pytest.fixture
def guarded_app():
    app = FastAPI()
    seen = []

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.get("/metrics")
    def metrics():
        return {"ok": True}

    @app.post("/generate")
    def generate(body: dict):
        seen.append(body)
        return {"text": "fine"}

    app.add_middleware(HttpAuthMiddleware, guard=HttpGuard.from_context(_ctx()))
    with TestClient(app) as client:
        yield client, seen


def test_middleware_answers_401_before_any_route(guarded_app):
    client, seen = guarded_app
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    res = client.post("/generate", json={"text": "hi"})
    assert res.status_code == 401 and res.headers["www-authenticate"].startswith("Bearer")
    err = res.json()["error"]
    assert err["code"] == 401 and "Authorization: Bearer" in err["message"]
    assert seen == []  # the route never ran
    assert client.post("/generate", json={"text": "hi"},
                       headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/nowhere", headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = client.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer the-key"})
    assert ok.status_code == 200 and seen == [{"text": "hi"}]


def test_follower_state_needs_the_credential_health_does_not():
    server = HealthServer("127.0.0.1", 0, lambda: {"x": 1}, guard=HttpGuard.from_context(_ctx()))
    try:
        base = f"http://127.0.0.1:{server._httpd.server_address[1]}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/pdtopo/state", timeout=5)
        assert err.value.code == 401
        assert "requires a credential" in json.loads(err.value.read())["error"]["message"]
        req = urllib.request.Request(f"{base}/pdtopo/state",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as res:
            assert json.loads(res.read())["x"] == 1
        with pytest.raises(urllib.error.HTTPError) as err:  # still loading: 503, not 401
            urllib.request.urlopen(f"{base}/health", timeout=5)
        assert err.value.code == 503
    finally:
        server.close()


# ------------------------------------------------------------------ what the planner gives


def _plan(*overrides: str):
    return expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu", *overrides]),
                       cpus=[0, 1])


def test_loopback_plans_are_unchanged():
    plan = _plan()
    for proc in plan.processes:
        assert not {API_KEY_ENV, API_KEY_FILE_ENV, API_KEY_DERIVED_ENV} & {*proc.env,
                                                                          *proc.secret_env}
    assert inner_command(plan.by_name()["proxy"].command)[2] == "sglang_router.launch_router"


def test_beyond_loopback_p_d_and_router_share_the_derived_key():
    plan = _plan("server.bind_host=0.0.0.0").by_name()
    for name in ("prefill_0", "decode_0", "proxy"):
        assert plan[name].env[API_KEY_DERIVED_ENV] == "1", name
        assert API_KEY_ENV not in plan[name].secret_env
    assert inner_command(plan["proxy"].command)[2] == "pdtopo.launcher.programs.router_entry"
    assert API_KEY_DERIVED_ENV not in plan["bootstrap"].env


def test_a_configured_key_is_given_to_guarded_servers_in_their_secret_env(tmp_path):
    plan = _plan("server.bind_host=0.0.0.0", "proxy.api_key=s3cr3t").by_name()
    for name in ("prefill_0", "decode_0", "proxy"):
        assert plan[name].secret_env == {API_KEY_ENV: "s3cr3t"}, name
        assert API_KEY_DERIVED_ENV not in plan[name].env
    keyed = _plan("server.bind_host=0.0.0.0", f"proxy.api_key_file={tmp_path}/k").by_name()
    assert keyed["decode_0"].env[API_KEY_FILE_ENV] == f"{tmp_path}/k"  # a path, not the key


def test_http_auth_false_leaves_them_open_and_true_guards_loopback():
    open_plan = _plan("server.bind_host=0.0.0.0", "server.http_auth=false").by_name()
    assert API_KEY_DERIVED_ENV not in open_plan["prefill_0"].env
    forced = _plan("server.http_auth=true").by_name()
    assert forced["prefill_0"].env[API_KEY_DERIVED_ENV] == "1"


def test_mini_lb_cannot_front_guarded_servers():
    with pytest.raises(TopologyError) as err:
        _plan("server.bind_host=0.0.0.0", "proxy=mini_lb")
    assert err.value.key == "proxy.kind" and "mini_lb sends none" in str(err.value)
    assert _plan("server.bind_host=0.0.0.0", "proxy=mini_lb", "server.http_auth=false")


def test_bad_http_auth_value_names_the_key():
    with pytest.raises(TopologyError) as err:
        _plan("server.http_auth=maybe")
    assert "server.http_auth" in str(err.value)


def test_run_dir_holds_the_derived_key_private(tmp_path):
    cfg = compose_config(["model=tiny_llama", "topology=1p1d_cpu", "server.bind_host=0.0.0.0"])
    plan = expand_plan(cfg, run_dir=str(tmp_path), cpus=[0, 1])
    token = new_token()
    write_run_dir(tmp_path, cfg, plan, "[supervisord]\n", token)
    key_file = tmp_path / "api_key"
    assert key_file.read_text().strip() == derived_api_key(token)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    loop = tmp_path / "loop"
    loop.mkdir()
    cfg = compose_config(["model=tiny_llama", "topology=1p1d_cpu"])
    write_run_dir(loop, cfg, expand_plan(cfg, run_dir=str(loop), cpus=[0, 1]), "", token)
    assert not (loop / "api_key").exists()


def test_dp_workers_beyond_loopback_need_the_key_and_colocated_true_derives_one(tmp_path):
    dp = _plan("topology.mode=dp", "topology.colocated.instances=2", "topology.accelerator=cpu-2",
               "server.bind_host=0.0.0.0").by_name()
    for name in ("colocated_0", "colocated_1", "proxy"):
        assert dp[name].env[API_KEY_DERIVED_ENV] == "1", name
    cfg = compose_config(["model=tiny_llama", "topology=colocated_cpu", "server.http_auth=true"])
    plan = expand_plan(cfg, run_dir=str(tmp_path), cpus=[0])
    assert plan.by_name()["colocated_0"].env[API_KEY_DERIVED_ENV] == "1"
    token = new_token()
    write_run_dir(tmp_path, cfg, plan, "", token)  # clients (bench, tune) find it there
    assert (tmp_path / "api_key").read_text().strip() == derived_api_key(token)


def test_a_k8s_render_guards_servers_whose_topology_says_loopback(tmp_path):
    """Pods listen on their DNS names: a one-host topology (127.0.0.1 in its file) rendered
    for k8s gets the credential too, or the router's requests would be refused."""
    from pdtopo.launcher.operate.k8s_job import k8s_objects

    cfg = compose_config(["model=tiny_llama", "topology=1p1d_v6e8", "server.bind_host=null"])
    token = new_token()
    objects = k8s_objects(cfg, tmp_path, token)
    secret = next(o for o in objects.values() if o["kind"] == "Secret")
    assert secret["stringData"]["proxy-api-key"] == derived_api_key(token)
    plan = json.loads(next(o for o in objects.values()
                           if o["kind"] == "ConfigMap")["data"]["plan.json"])
    for proc in plan["processes"]:
        if proc["role"] in ("prefill", "decode", "proxy"):
            assert proc["env"][API_KEY_DERIVED_ENV] == "1", proc["name"]


def test_scale_gives_every_guarded_program_the_running_key(tmp_path):
    """config.yaml holds proxy.api_key redacted; the real key comes from supervisord.conf."""
    from pdtopo.cli import main
    from pdtopo.launcher.operate.deployment import Deployment
    from pdtopo.launcher.operate.scale import plan_scale

    run = tmp_path / "run"
    assert main(["render", "model=tiny_llama", "topology=2p2d_cpu", "topology.accelerator=cpu-6",
                 "proxy.api_key=the-real-key", "server.http_auth=true",
                 f"hydra.run.dir={run}"]) == 0
    assert "the-real-key" not in (run / "config.yaml").read_text()
    _cfg, plan = plan_scale(Deployment.load(run, "scale"), {"prefill": 3})
    keyed = {p.name: p.secret_env.get(API_KEY_ENV) for p in plan.processes}
    assert keyed.pop("bootstrap") is None
    assert set(keyed) == {"prefill_0", "prefill_1", "prefill_2", "decode_0", "decode_1", "proxy"}
    assert set(keyed.values()) == {"the-real-key"}
