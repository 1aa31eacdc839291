"""Fuzzed bootstrap fields against a real 1P1D (bootstrap server, sglang-router, P and D under
supervisord), with hypothesis (issue 30 item 6; tests/e2e/test_badinput_http.py fuzzes a colocated
server).

D dials the P side channel a request names (`bootstrap_host:bootstrap_port`), so:
- a malformed field (host not an IPv4 address or host name, port outside [1, 65535], room not
  an integer in [0, 2**64), a wrong JSON type) sent straight to D or P is a 400 naming it;
- well-formed fields naming no live P fail fast with an error naming the peer (never a hang);
- D's open side-channel DEALERs stay under `disaggregation.side_channel_max_peers` (4 here) and
  close after `side_channel_peer_idle_s` (1 s here): `pd_side_channel_peers` in /pdtopo/state and
  D's own file descriptors (/proc/PID/fd) go back to where they were;
- afterwards the deployment serves a normal request through the router, pools at baseline.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdtopo.runtime.engine.request import InvalidRequest, check_bootstrap_fields
from tests.support.e2e import Deployment, deployment_overrides, port_block, wait_pools_baseline
from tests.support.faults import program_pid, wait_serving, wait_until

pytestmark = pytest.mark.slow

CAP = 4
IDLE_S = 1
KV_TIMEOUT_S = 5
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GOOD = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}

json_scalar = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
bad_host = st.sampled_from(["bad host", "a_b", "", "-x", "x" * 64, "1.2.3.999", "::1", "h:1",
                            "tcp://h", "h/x", "\u00e9t\u00e9", "a..b"]) | json_scalar \
    | st.lists(st.integers(), min_size=1, max_size=2)
bad_int = st.sampled_from([0, -1, 65536, 2**64, -2**63, True, False, "8000", 80.0, 1.5]) \
    | json_scalar | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
fields = st.fixed_dictionaries({
    "bootstrap_host": st.just(GOOD["bootstrap_host"]) | bad_host,
    "bootstrap_port": st.just(GOOD["bootstrap_port"]) | bad_int,
    "bootstrap_room": st.just(GOOD["bootstrap_room"]) | bad_int})


def _malformed(f: dict) -> str | None:
    """The first malformed field (the wire types are strict: a bool or "8000" is no port)."""
    for name, kind in (("bootstrap_host", str), ("bootstrap_port", int), ("bootstrap_room", int)):
        v = f[name]
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            return name
    try:
        check_bootstrap_fields(f["bootstrap_host"], f["bootstrap_port"], f["bootstrap_room"])
    except InvalidRequest as exc:
        return exc.field
    return None


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("badinput_pd") / "run"
    d = Deployment(run_dir, ["topology=1p1d_cpu", "model=tiny_llama", "model.num_layers=1",
                             "engine.max_new_tokens_default=4", "engine.max_new_tokens_limit=8",
                             f"disaggregation.side_channel_max_peers={CAP}",
                             f"disaggregation.side_channel_peer_idle_s={IDLE_S}",
                             f"disaggregation.kv_timeout_s={KV_TIMEOUT_S}",
                             # P holds the KV of a well-formed room no D pulls this long
                             f"disaggregation.sender_expiry_s={KV_TIMEOUT_S + 3}",
                             *deployment_overrides(port_block(40))]).launch()
    try:
        wait_serving(d.proxy_url, timeout=120)
        yield d
    finally:
        d.stop_and_check()


def _state(dep: Deployment, name: str) -> dict:
    return httpx.get(f"{dep.url(name)}/pdtopo/state", timeout=10).json()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _post(url: str, route: str, f: dict) -> httpx.Response:
    body = {"prompt": "hi"} if route == "/v1/completions" else {"text": "hi"}
    body.update({"max_tokens": 2} if route == "/v1/completions"
                else {"sampling_params": {"max_new_tokens": 2}})
    return httpx.post(url + route, json={**body, **f}, timeout=KV_TIMEOUT_S + 30)


@FUZZ
@given(f=fields, role=st.sampled_from(["decode_0", "prefill_0"]),
       route=st.sampled_from(["/generate", "/v1/completions"]))
def test_fuzzed_bootstrap_fields_get_a_clear_answer(dep, f, role, route):
    t0 = time.monotonic()
    resp = _post(dep.url(role), route, f)
    took = time.monotonic() - t0
    what = f"{role} {route} {json.dumps(f)[:200]} -> {resp.status_code}: {resp.text[:300]}"
    bad = _malformed(f)
    if bad is not None:
        assert resp.status_code == 400, what
        err = resp.json()["error"]
        assert bad in err["message"] or bad == err.get("param"), what
        assert took < 5, what
    elif role == "decode_0":  # well-formed, naming no live P (port 1): a fast, named error
        assert resp.status_code in (500, 502, 503, 504), what
        assert str(f["bootstrap_port"]) in resp.json()["error"]["message"] or \
            resp.status_code == 504, what
        assert took < KV_TIMEOUT_S + 5, what


def test_many_unknown_peers_keep_ds_sockets_bounded(dep):
    d_pid = program_pid(dep, "decode_0")
    assert d_pid > 0
    wait_until(lambda: _state(dep, "decode_0")["pd_side_channel_peers"] <= 1, 10,
               what="D's idle DEALERs closed")
    base = _fds(d_pid)
    most, statuses = 0, []
    for i in range(4 * CAP):  # distinct P endpoints no one listens on, and names
        host = "127.0.0.1" if i % 2 else f"no-such-p{i}.invalid"
        resp = _post(dep.url("decode_0"), "/generate",
                     {"bootstrap_host": host, "bootstrap_port": 40000 + i,
                      "bootstrap_room": 1000 + i})
        statuses.append(resp.status_code)
        assert resp.status_code in (500, 503), resp.text
        most = max(most, _state(dep, "decode_0")["pd_side_channel_peers"])
        # each DEALER holds a few descriptors (socket, monitor, TCP); not one more per peer
        assert _fds(d_pid) - base <= 5 * CAP + 8, "D's descriptors grow with the peers named"
    assert most <= CAP, most
    # idle DEALERs close (pd_side_channel_peers counts DEALERs open now) ...
    wait_until(lambda: _state(dep, "decode_0")["pd_side_channel_peers"] == 0, IDLE_S + 10,
               what="D's DEALERs closed once idle")
    state = _state(dep, "decode_0")
    assert state["pd_side_channel_peers_closed"] >= most > 0, state
    assert _fds(d_pid) <= base + 6
    print(f"\n[bootstrap fields] {4 * CAP} unknown peers: statuses {sorted(set(statuses))}, "
          f"at most {most} DEALERs open (cap {CAP}), "
          f"{state['pd_side_channel_peers_closed']} closed, "
          f"{state['pd_side_channel_peers_refused']} refused, D fds {base} -> {_fds(d_pid)}")
    # ... and the deployment still serves
    ok = httpx.post(f"{dep.proxy_url}/generate", timeout=120, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4, ok.text
    wait_pools_baseline(dep, timeout=KV_TIMEOUT_S + 25)
    for name in dep.servers():
        assert httpx.get(f"{dep.url(name)}/health", timeout=10).status_code == 200
