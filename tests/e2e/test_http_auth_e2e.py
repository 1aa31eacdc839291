"""P/D HTTP behind a credential, on one host (`server.http_auth=true` guards loopback servers
the way `auto` guards routable ones): a 1P2D under supervisord with the Rust router and the
key derived from the deployment token. The launch is health-gated through the keyed router,
clients without the key get 401 from the proxy, P and D, the proxy serves with it, a P/D pair
sent directly with the key serves the same greedy tokens, and every operation that talks to
P/D or the router (drain and undo, bench, top, the router watch) keeps working."""

from __future__ import annotations

import concurrent.futures
import json
import stat

import httpx
import pytest

from pdtopo.config.credentials import derived_api_key
from tests.support.constants import ONE_LAYER, greedy
from tests.support.e2e import Deployment, deployment_overrides, port_block, run_pdtopo, said

pytestmark = pytest.mark.slow

GREEDY = greedy(6)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("http_auth") / "run"
    dep = Deployment(run_dir, ["topology=1p1d_cpu", "topology.accelerator=cpu-3",
                               "topology.decode.instances=2", *ONE_LAYER, "server.http_auth=true",
                               *deployment_overrides(port_block(40))]).launch()
    try:
        yield dep, (run_dir / "api_key").read_text().strip()
    finally:
        dep.stop_and_check()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_key_is_derived_private_and_the_proxy_needs_it(guarded):
    dep, key = guarded
    token = (dep.run_dir / "token").read_text().strip()
    assert key == derived_api_key(token)
    assert stat.S_IMODE((dep.run_dir / "api_key").stat().st_mode) == 0o600
    body = {"text": PROMPT, "sampling_params": GREEDY}
    assert httpx.post(f"{dep.proxy_url}/generate", json=body, timeout=60).status_code == 401
    ok = httpx.post(f"{dep.proxy_url}/generate", json=body, headers=_bearer(key), timeout=120)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["output_ids"]) == GREEDY["max_new_tokens"]


def test_p_and_d_refuse_callers_without_a_credential(guarded):
    dep, key = guarded
    token = (dep.run_dir / "token").read_text().strip()
    for name in ("prefill_0", "decode_0", "decode_1"):
        url = dep.url(name)
        for method, path in (("POST", "/generate"), ("POST", "/v1/completions"),
                             ("GET", "/pdtopo/state"), ("POST", "/flush_cache"),
                             ("GET", "/v1/models")):
            res = httpx.request(method, f"{url}{path}", json={}, timeout=30)
            assert res.status_code == 401, (name, path, res.text)
            assert "requires a credential" in res.json()["error"]["message"]
            assert res.headers["www-authenticate"].startswith("Bearer")
        wrong = httpx.get(f"{url}/pdtopo/state", headers=_bearer(token[::-1]), timeout=30)
        assert wrong.status_code == 401 and "wrong credential" in wrong.text
        for credential in (key, token):  # the proxy's key or the deployment token
            state = httpx.get(f"{url}/pdtopo/state", headers=_bearer(credential), timeout=30)
            assert state.status_code == 200 and state.json()["name"] == name
        for path in ("/health", "/metrics"):  # the router's checks and the scrape stay open
            assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, (name, path)


def test_a_direct_pair_with_the_key_serves_the_proxys_tokens(guarded):
    dep, key = guarded
    via_proxy = httpx.post(f"{dep.proxy_url}/generate", headers=_bearer(key), timeout=120,
                           json={"text": PROMPT, "sampling_params": GREEDY}).json()
    p = dep.process("prefill_0")
    body = {"text": PROMPT, "sampling_params": GREEDY, "bootstrap_host": p["address"],
            "bootstrap_port": p["ports"]["zmq"], "bootstrap_room": 771}

    def post(name: str) -> httpx.Response:
        return httpx.post(f"{dep.url(name)}/generate", json=body, headers=_bearer(key),
                          timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p_res, d_res = pool.map(post, ["prefill_0", "decode_1"])
    assert p_res.status_code == 200 and d_res.status_code == 200, (p_res.text, d_res.text)
    assert d_res.json()["output_ids"] == via_proxy["output_ids"]


def test_operations_send_their_credentials(guarded):
    dep, _key = guarded
    run_dir = str(dep.run_dir)
    drained = run_pdtopo(["drain", "decode_0", run_dir], timeout=180)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert "out of the router" in said(drained)
    undone = run_pdtopo(["drain", "decode_0", run_dir, "--undo"], timeout=120)
    assert undone.returncode == 0 and "back in the router" in said(undone), undone.stdout

    out = dep.run_dir / "bench.json"
    bench = run_pdtopo(["bench", "--run-dir", run_dir, "--output", str(out),
                        "bench.num_requests=6", "bench.warmup_requests=0", "bench.input_len=16",
                        "bench.output_len=4", "bench.max_concurrency=2"], timeout=300)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    requests = json.loads(out.read_text())["stats"]["requests"]
    assert requests["failed"] == 0 and requests["completed"] == 6, requests

    top = run_pdtopo(["top", run_dir, "--once", "--interval", "1"], timeout=60)
    assert top.returncode == 0, top.stdout + top.stderr
    for name in ("prefill_0", "decode_0", "decode_1", "proxy"):
        assert name in top.stdout

    watch_log = (dep.run_dir / "logs" / "router_watch.log").read_text()
    assert "watching" in watch_log and "401" not in watch_log
