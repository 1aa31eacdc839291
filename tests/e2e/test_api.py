"""sglang-native API over real HTTP against a real server process (tiny model).

One server for the module (direct form: --port + hydra overrides); after every test the KV
pool is back to its baseline (/pdtopo/state). Shutdown by SIGTERM must exit 0."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.api_server import direct_server
from tests.support.e2e import wait_pools_baseline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with direct_server(tmp_path_factory.mktemp("api")) as u:
        yield u


@pytest.fixture(autouse=True)
def pool_baseline(url):
    yield
    wait_pools_baseline(url, timeout=20)


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def gen(url, body):
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_info_routes(url):
    info = httpx.get(url + "/get_model_info").json()
    assert info == httpx.get(url + "/model_info").json()
    assert info["model_path"] is None and info["tokenizer_path"] is None  # random-init model
    assert info["served_model_name"] == "tiny-llama" and info["tp_size"] == 1
    assert info["dp_size"] == 1 and info["disaggregation_mode"] == "null"
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    srv = httpx.get(url + "/get_server_info").json()
    assert srv["page_size"] == 8 and srv["context_length"] == 1024
    assert srv["max_total_num_tokens"] == 199 * 8
    assert httpx.get(url + "/server_info").status_code == 200
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny-llama"
    load = httpx.get(url + "/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.post(url + "/flush_cache").status_code == 200
    hg = httpx.get(url + "/health_generate", timeout=60)
    assert hg.status_code == 200 and len(hg.json()["output_ids"]) == 1


def test_generate_single_is_deterministic_and_reports_meta(url):
    body = {"text": "Hello world", "sampling_params": {"max_new_tokens": 7, "temperature": 0,
                                                      "ignore_eos": True},
            "rid": "my-rid", "bootstrap_host": "10.0.0.1", "bootstrap_port": 32000,
            "bootstrap_room": 12345}
    a = gen(url, body)
    b = gen(url, {**body, "rid": "my-rid-2"})
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 7
    meta = a["meta_info"]
    assert meta["id"] == "my-rid" and meta["prompt_tokens"] == len("Hello world") + 1  # + BOS
    assert meta["completion_tokens"] == 7 and meta["finish_reason"] == {"type": "length",
                                                                        "length": 7}
    assert meta["e2e_latency"] > 0 and isinstance(a["text"], str)


def test_batch_input_ids_match_single_requests(url):
    prompts = [[256] + list(range(65, 65 + n)) for n in (3, 11, 1, 25, 7, 40, 2, 17)]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    singles = [gen(url, {"input_ids": p, "sampling_params": sp})["output_ids"] for p in prompts]
    batch = gen(url, {"input_ids": prompts, "sampling_params": sp, "rid": "b"})
    assert isinstance(batch, list) and len(batch) == len(prompts)
    assert [r["output_ids"] for r in batch] == singles
    assert [r["meta_info"]["id"] for r in batch] == [f"b_{i}" for i in range(len(prompts))]
    # per-item sampling params and bootstrap fields as lists
    batch2 = gen(url, {"input_ids": prompts[:2],
                       "sampling_params": [dict(sp, max_new_tokens=2), sp],
                       "bootstrap_room": [1, 2], "bootstrap_host": ["h", "h"],
                       "bootstrap_port": [None, None]})
    assert [len(r["output_ids"]) for r in batch2] == [2, 6]
    assert batch2[0]["output_ids"] == singles[0][:2]


def test_streaming_sse_framing(url):
    body = {"text": "stream me", "sampling_params": {"max_new_tokens": 9, "temperature": 0,
                                                    "ignore_eos": True}}
    ref = gen(url, body)
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len(chunks) >= 2
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 9  # cumulative ids
    assert chunks[-1]["output_ids"] == ref["output_ids"] and chunks[-1]["text"] == ref["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_seeded_sampling_and_greedy_equivalents(url):
    base = {"text": "sample", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}

    def ids(**sp):
        return gen(url, {**base, "sampling_params": {**base["sampling_params"], **sp}})[
            "output_ids"]

    greedy = ids(temperature=0)
    assert ids(temperature=1.3, top_k=1) == greedy
    s1 = ids(temperature=1.0, sampling_seed=7)
    assert ids(temperature=1.0, seed=7) == s1
    assert ids(temperature=1.0, sampling_seed=8) != s1
    assert ids(temperature=1.0, top_p=0.9, top_k=20, sampling_seed=3) == \
        ids(temperature=1.0, top_p=0.9, top_k=20, sampling_seed=3)


def test_stop_token_ids_and_stop_strings(url):
    base = {"input_ids": [256, 72, 105], "sampling_params": {"max_new_tokens": 10,
                                                             "temperature": 0,
                                                             "ignore_eos": True}}
    ref = gen(url, base)["output_ids"]
    tok = ref[4]
    first = ref.index(tok)
    out = gen(url, {**base, "sampling_params": {**base["sampling_params"],
                                                "stop_token_ids": [tok]}})
    assert out["output_ids"] == ref[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    # stop string: a character the byte-level model produced (ids < 128 are ASCII)
    ascii_ids = [t for t in ref if 32 <= t < 127]
    if ascii_ids:
        ch = chr(ascii_ids[0])
        out = gen(url, {**base, "sampling_params": {**base["sampling_params"], "stop": ch}})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ch}
        assert ch not in out["text"]


BAD = [
    ({"text": ""}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({}, "text"),
    ({"input_ids": [1, 99999]}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"input_ids": [65] * 1100}, "input_ids"),
    ({"input_ids": [65] * 100, "sampling_params": {"max_new_tokens": 990}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 1001}}, "max_new_tokens_limit"),
    ({"text": "x", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "x", "sampling_params": {"top_p": 2}}, "top_p"),
    ({"text": "x", "sampling_params": {"top_k": "ten"}}, "top_k"),
    ({"text": "x", "sampling_params": {"no_such_param": 1}}, "no_such_param"),
    ({"text": "x", "sampling_params": {"presence_penalty": 2.7}}, "presence_penalty"),
    ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "x", "sampling_params": "hot"}, "sampling_params"),
    ({"text": 5}, "text"),
    ({"text": "x", "stream": "maybe"}, "stream"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "bootstrap_room": [1, 2, 3]}, "bootstrap_room"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(url, body, field):
    r = post(url, "/generate", body)
    assert r.status_code == 400, (body, r.text)
    msg = r.json()["error"]["message"]
    assert field in msg, (field, msg)


def test_malformed_json_and_server_keeps_serving(url):
    for raw in (b'{"text": "abc"', b"[1, 2]", b"not json", b""):
        r = httpx.post(url + "/generate", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "JSON" in r.json()["error"]["message"]
    assert gen(url, {"text": "still alive", "sampling_params": {"max_new_tokens": 2}})


def test_client_disconnect_mid_stream_aborts_and_frees_pages(url):
    before = httpx.get(url + "/pdtopo/state").json()["num_generated"]
    body = {"text": "long", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # got the first token; leave -> connection closed
    wait_pools_baseline(url, timeout=20)
    generated = httpx.get(url + "/pdtopo/state").json()["num_generated"] - before
    assert generated < 900, generated
    metrics = httpx.get(url + "/metrics").text
    assert 'pdtopo:requests_total{finish="abort",role="colocated"}' in metrics


def test_client_disconnect_non_streaming_aborts(url):
    before = httpx.get(url + "/pdtopo/state").json()["num_generated"]
    body = {"text": "long", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json=body, timeout=httpx.Timeout(5, read=0.3))
    wait_pools_baseline(url, timeout=20)
    assert httpx.get(url + "/pdtopo/state").json()["num_generated"] - before < 1000


def test_metrics_names(url):
    gen(url, {"text": "m", "sampling_params": {"max_new_tokens": 3}})
    text = httpx.get(url + "/metrics").text
    for name in ("sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds",
                 "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                 "pdtopo:free_pages", "pdtopo:requests_total"):
        assert name in text, name


LOGPROB_FIELDS = [  # (route, body, the refused field, a value of it that is served)
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 21},
     "top_logprobs_num", 20),
    ("/generate", {"input_ids": [[1], [2]], "return_logprob": [False, True, True]},
     "return_logprob", [False, True]),
    ("/generate", {"text": "x", "logprob_start_len": 0}, "logprob_start_len", -1),
    ("/generate", {"text": "x", "token_ids_logprob": [5]}, "token_ids_logprob", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", 5),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", 0),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", 0),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": -1}, "top_logprobs", 3),
]


@pytest.mark.parametrize("path,body,field,neutral", LOGPROB_FIELDS,
                         ids=[f"{p}-{f}" for p, _, f, _ in LOGPROB_FIELDS])
def test_logprob_fields_are_400_naming_the_field(url, path, body, field, neutral):
    """What is not computed (prompt logprobs, logprobs of given ids) or out of range is
    refused, never silently dropped; the field at a valid value is served."""
    before = httpx.get(url + "/pdtopo/state").json()["num_generated"]
    r = post(url, path, body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert httpx.get(url + "/pdtopo/state").json()["num_generated"] == before
    limit = {"sampling_params": {"max_new_tokens": 2}} if path == "/generate" \
        else {"max_tokens": 2}
    r = post(url, path, {**body, field: neutral, **limit})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- duplicate request ids
DUP_TOKENS = 900  # the original is still decoding while its duplicates arrive (~0.6 s)


def dup_body(rid: str | None = None, **extra) -> dict:
    body = {"text": "the original of a duplicate",
            "sampling_params": {"max_new_tokens": DUP_TOKENS, "temperature": 0,
                                "ignore_eos": True}, **extra}
    return {**body, "rid": rid} if rid is not None else body


def read_stream(url: str, body: dict, first: threading.Event | None = None) -> list[dict]:
    """Every data chunk of a streaming /generate, read to its end; `first` is set at the
    first one."""
    chunks = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
                if first is not None:
                    first.set()
    return chunks


def first_event(url: str, body: dict) -> dict:
    """The first data chunk of a streaming /generate; then the client leaves."""
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        line = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    return json.loads(line[len("data: "):])


def test_a_duplicate_rid_is_refused_and_the_original_completes(url):
    """Issue 30 item 2: a second request with the rid of a live one gets 400 naming the rid;
    neither it nor its client leaving (streaming or not) touches the original, whose stream
    ends with every token of a reference run; once it is done the rid is free again."""
    rid = "dup-X"
    reference = gen(url, dup_body())["output_ids"]
    assert len(reference) == DUP_TOKENS
    first = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        original = pool.submit(read_stream, url, dup_body(rid), first)
        assert first.wait(30), "the original never streamed its first token"
        r = post(url, "/generate", dup_body(rid))  # its client leaves with the answer
        assert r.status_code == 400, r.text
        assert rid in r.json()["error"]["message"] and "duplicate" in r.json()["error"]["message"]
        refused = first_event(url, dup_body(rid))  # a streaming duplicate, then it leaves
        assert refused["error"]["code"] == 400 and rid in refused["error"]["message"], refused
        with httpx.stream("POST", url + "/generate", json={**dup_body(rid), "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200  # a streaming duplicate that leaves before any event
        assert not original.done(), "the original finished before its duplicates were sent"
        chunks = original.result(timeout=120)
    assert not any("error" in c for c in chunks), chunks[-1]
    final = chunks[-1]
    assert final["meta_info"]["id"] == rid
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": DUP_TOKENS}
    assert final["output_ids"] == reference
    after = gen(url, dup_body(rid))  # the rid is free again
    assert after["meta_info"]["id"] == rid and after["output_ids"] == reference


def test_the_original_of_a_refused_duplicate_still_aborts_when_its_client_leaves(url):
    """The refused duplicate must not unregister the original: its own client leaving still
    aborts it (before the fix it decoded all its tokens for nobody)."""
    rid = "dup-Y"
    before = httpx.get(url + "/pdtopo/state").json()["num_generated"]
    body = dup_body(rid, stream=True)
    body["sampling_params"]["max_new_tokens"] = 900
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept open (a dropped generator would close the stream)
        assert next(ln for ln in lines if ln.startswith("data: "))
        dup = post(url, "/generate", dup_body(rid))
        assert dup.status_code == 400 and rid in dup.json()["error"]["message"], dup.text
    wait_pools_baseline(url, timeout=20)
    generated = httpx.get(url + "/pdtopo/state").json()["num_generated"] - before
    assert generated < 900, generated
