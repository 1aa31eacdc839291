"""Fuzzed HTTP input against real server processes, with hypothesis.

- A real colocated pdtopo server gets random JSON bodies (and raw bytes) on /generate,
  /v1/completions and /v1/chat/completions: arbitrary JSON, and near-valid bodies whose known
  fields hold random values. Every answer is 2xx, or 4xx with a JSON error naming the problem;
  never 5xx. Afterwards the server still serves and its page pool is at its baseline.
- A real bootstrap server gets fuzzed registrations, heartbeats and route lookups (with the
  token): each is accepted exactly when the wire schema accepts it, otherwise a 4xx; never a
  5xx; the registry keeps the entry registered before the fuzzing, unchanged.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pdtopo.ports import free_port
from pdtopo.runtime.bootstrap.protocol import Heartbeat, Registration
from tests.support.api_server import direct_server
from tests.support.bootstrap import TOKEN, start_bootstrap, stop_bootstrap
from tests.support.e2e import wait_pools_baseline

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_scalar = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                          max_leaves=12)
small_int = st.integers(-3, 1100)
sampling = st.dictionaries(
    st.sampled_from(["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                     "stop_token_ids", "ignore_eos", "min_p", "bogus"]),
    json_scalar | small_int | st.lists(small_int, max_size=3), max_size=4)
token_ids = st.lists(st.integers(-2, 600), max_size=6)

generate_body = st.fixed_dictionaries({}, optional={
    "text": st.text(max_size=20) | st.lists(st.text(max_size=8), max_size=3) | json_value,
    "input_ids": token_ids | st.lists(token_ids, max_size=3) | json_value,
    "sampling_params": sampling | st.lists(sampling, max_size=3) | json_value,
    "stream": st.booleans() | json_scalar,
    "rid": st.text(max_size=8) | json_value,
    "bootstrap_room": json_scalar,
})
openai_common = {
    "model": st.text(max_size=8) | json_scalar,
    "max_tokens": small_int | json_scalar,
    "temperature": st.floats(-1, 3) | json_scalar,
    "top_p": st.floats(-1, 2) | json_scalar,
    "n": small_int,
    "stream": st.booleans(),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | json_scalar,
    "seed": small_int | json_scalar,
    "logprobs": json_scalar,
    "echo": st.booleans() | json_scalar,
}
completion_body = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=20) | token_ids | st.lists(token_ids, max_size=3) | json_value,
    **openai_common})
message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "system", "assistant", "robot"]) | json_scalar,
    "content": st.text(max_size=20) | json_value})
chat_body = st.fixed_dictionaries({}, optional={
    "messages": st.lists(message, max_size=3) | json_value,
    "max_completion_tokens": small_int | json_scalar, **openai_common})

FUZZ_BOOTSTRAP = settings(FUZZ, max_examples=60)

ROUTES = [("/generate", generate_body), ("/v1/completions", completion_body),
          ("/v1/chat/completions", chat_body)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # small generation limits keep every accepted fuzz request cheap; shapes as in test_api
    with direct_server(tmp_path_factory.mktemp("fuzz"), ["engine.max_new_tokens_default=4",
                                                         "engine.max_new_tokens_limit=8"]) as url:
        yield url


def _check(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, f"{what} -> {resp.status_code}: {resp.text[:500]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["code"] == resp.status_code and err["message"], (what, resp.text)


@FUZZ
@given(route=st.sampled_from(range(len(ROUTES))), data=st.data())
def test_fuzzed_json_bodies_never_5xx(server, route, data):
    path, strategy = ROUTES[route]
    body = data.draw(strategy | json_value, label="body")
    resp = httpx.post(server + path, json=body, timeout=60)
    _check(resp, f"POST {path} {json.dumps(body)[:300]}")


@settings(max_examples=30, deadline=None, derandomize=True)
@given(route=st.sampled_from([r for r, _ in ROUTES]), raw=st.binary(max_size=200))
def test_raw_bytes_never_5xx(server, route, raw):
    resp = httpx.post(server + route, content=raw, timeout=60,
                      headers={"content-type": "application/json"})
    _check(resp, f"POST {route} {raw!r}")
    if raw.strip() and resp.status_code >= 400:
        assert resp.status_code == 400


def test_server_serves_and_pool_is_at_baseline_after_fuzzing(server):
    # runs after the fuzz tests in this module (pytest keeps file order)
    wait_pools_baseline(server, timeout=20)
    resp = httpx.post(server + "/generate", timeout=60, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) >= 1
    assert httpx.get(server + "/health").status_code == 200


# ---------------------------------------------------------------------------- bootstrap

VALID = {"role": "prefill", "instance_id": "prefill_0", "tp_rank": 0, "tp_size": 1,
         "transfer_addr": "127.0.0.1:31000", "zmq_addr": "127.0.0.1:32000",
         "http_addr": "127.0.0.1:30000", "page_size": 16, "kv_dtype": "float32",
         "model": "tiny", "kv_layout": {"tp": 1}, "mesh_meta": {"tp": 1}}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def bootstrap():
    port = free_port()
    proc = start_bootstrap(port, ttl=600)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.put(f"{url}/route", json=VALID, headers=AUTH).status_code == 200
        yield url
    finally:
        stop_bootstrap(proc)


def _valid(model, body) -> bool:
    try:
        model.model_validate(body)
        return True
    except (ValidationError, TypeError, ValueError):
        return False


mutation = st.dictionaries(st.sampled_from(sorted(VALID) + ["cp_rank", "extra_field"]),
                           json_value, min_size=1, max_size=3)


@FUZZ_BOOTSTRAP
@given(patch=mutation, drop=st.sets(st.sampled_from(sorted(VALID)), max_size=2))
def test_fuzzed_registrations_are_4xx_unless_valid(bootstrap, patch, drop):
    body = {k: v for k, v in {**VALID, **patch}.items() if k not in drop}
    if body.get("instance_id") == VALID["instance_id"]:
        body["instance_id"] = "fuzzed"  # keep the pre-registered entry's key untouched
    resp = httpx.put(f"{bootstrap}/route", json=body, headers=AUTH)
    assert resp.status_code < 500, resp.text
    assert (resp.status_code == 200) == _valid(Registration, body), (body, resp.text)
    if resp.status_code >= 400:
        assert resp.status_code in (400, 422) and resp.json()


@FUZZ_BOOTSTRAP
@given(body=json_value | st.dictionaries(st.sampled_from(
    ["role", "instance_id", "tp_rank", "cp_rank", "dp_rank", "pp_rank", "x"]), json_value))
def test_fuzzed_heartbeats_and_lookups_never_5xx(bootstrap, body):
    resp = httpx.post(f"{bootstrap}/heartbeat", json=body, headers=AUTH)
    assert resp.status_code < 500, resp.text
    if not _valid(Heartbeat, body):
        assert resp.status_code in (400, 422), (body, resp.text)
    params = {k: json.dumps(v) if not isinstance(v, str) else v
              for k, v in (body.items() if isinstance(body, dict) else [])}
    resp = httpx.get(f"{bootstrap}/route", params=params, headers=AUTH)
    assert resp.status_code < 500 and resp.status_code in (200, 400, 404, 422), resp.text


def test_registry_intact_after_fuzzing(bootstrap):
    entries = httpx.get(f"{bootstrap}/list", headers=AUTH).json()
    mine = [e for e in entries if e["instance_id"] == VALID["instance_id"]]
    assert len(mine) == 1
    assert {k: mine[0][k] for k in VALID} == VALID
    assert httpx.get(f"{bootstrap}/health").status_code == 200
