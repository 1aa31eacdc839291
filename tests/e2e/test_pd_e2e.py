"""PD end to end with real processes: `pdtopo launch --detach` brings up the bootstrap server,
sglang-router (Rust router, then MiniLB), a prefill and a decode server under supervisord; a
colocated server with the same model and seed is the reference. Greedy outputs through the
proxy must be token-for-token identical to it, on every API, streaming or not, and every page
pool must return to its baseline. `pdtopo stop` must leave no process of the run alive."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
    ColocatedServer,
    Deployment,
    assert_refused_at_once,
    deployment_overrides,
    generate,
    port_block,
    stream_generate,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A long prompt that spans many KV pages of sixteen tokens each, so that the prefill "
    "server has to gather scattered pages and the decode server has to scatter them back: ",
]
GREEDY = greedy(12)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    log = tmp_path_factory.mktemp("colocated") / "server.log"
    with ColocatedServer(port_block(1), TWO_LAYERS, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def reference(colocated):
    """Colocated greedy outputs for every prompt (output_ids and text)."""
    return {p: generate(colocated.url, {"text": p, "sampling_params": GREEDY}) for p in PROMPTS}


@pytest.fixture(scope="module", params=["rust", "mini_lb"])
def pd(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"pd-{request.param}") / "run"
    dep = Deployment(run_dir, [f"proxy={request.param}", *TWO_LAYERS, *deployment_overrides(port_block(40))])
    try:
        dep.launch()
        yield dep
    finally:
        dep.stop_and_check()


def test_generate_matches_colocated(pd, reference):
    for prompt, ref in reference.items():
        out = generate(pd.proxy_url, {"text": prompt, "sampling_params": GREEDY})
        assert out["output_ids"] == ref["output_ids"], prompt
        assert out["text"] == ref["text"]
        assert out["meta_info"]["completion_tokens"] == 12


def test_streaming_matches_colocated(pd, reference):
    for prompt in PROMPTS[2:]:
        chunks = stream_generate(pd.proxy_url, {"text": prompt, "sampling_params": GREEDY})
        assert len(chunks) >= 2, "a stream of several SSE events"
        assert chunks[-1]["output_ids"] == reference[prompt]["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_batch_input_ids_matches_colocated(pd, colocated):
    batch = [[256, *map(ord, p)] for p in PROMPTS[1:4]]
    body = {"input_ids": batch, "sampling_params": GREEDY}
    ref = generate(colocated.url, body)
    out = generate(pd.proxy_url, body)
    assert isinstance(out, list) and len(out) == len(batch)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]


def test_openai_completions_and_chat_match_colocated(pd, colocated):
    openai = pytest.importorskip("openai")
    model = httpx.get(f"{colocated.url}/v1/models").json()["data"][0]["id"]
    ref = openai.OpenAI(base_url=f"{colocated.url}/v1", api_key="none")
    via = openai.OpenAI(base_url=f"{pd.proxy_url}/v1", api_key="none")
    prompt = PROMPTS[2]
    kw = {"model": model, "max_tokens": 10, "temperature": 0}

    want = ref.completions.create(prompt=prompt, **kw).choices[0].text
    got = via.completions.create(prompt=prompt, **kw).choices[0].text
    assert got == want
    streamed = "".join(c.choices[0].text for c in via.completions.create(prompt=prompt, stream=True, **kw)
                       if c.choices)
    assert streamed == want

    messages = [{"role": "user", "content": "Tell me about KV caches."}]
    want_chat = ref.chat.completions.create(messages=messages, **kw).choices[0].message.content
    got_chat = via.chat.completions.create(messages=messages, **kw).choices[0].message.content
    assert got_chat == want_chat
    streamed_chat = "".join(
        c.choices[0].delta.content or ""
        for c in via.chat.completions.create(messages=messages, stream=True, **kw) if c.choices)
    assert streamed_chat == want_chat


def test_concurrent_requests_and_pools_back_to_baseline(pd, reference):
    with cf.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(
            lambda p: generate(pd.proxy_url, {"text": p, "sampling_params": GREEDY}),
            PROMPTS * 3))
    assert [o["output_ids"] for o in outs] == [reference[p]["output_ids"] for p in PROMPTS * 3]
    wait_pools_baseline(pd)


def test_bad_request_is_a_clear_400_and_service_continues(pd, reference):
    resp = httpx.post(f"{pd.proxy_url}/generate", timeout=60,
                      json={"text": "x", "sampling_params": {"max_new_tokens": 0}})
    assert resp.status_code == 400
    assert "max_new_tokens" in resp.text
    out = generate(pd.proxy_url, {"text": PROMPTS[1], "sampling_params": GREEDY})
    assert out["output_ids"] == reference[PROMPTS[1]]["output_ids"]


def test_oversize_body_is_a_413_at_once_everywhere(pd, colocated, reference):
    """server.max_body_bytes (8 MiB): a 50 MB body is refused 413 within a second by the proxy
    (the Rust router's --max-payload-size, MiniLB through pdtopo's entry), by P and D and by a
    colocated server (also on /v1/ routes), before it is read or tokenized; then the
    deployment serves as before."""
    for url in (pd.proxy_url, *pd.servers().values(), colocated.url):
        assert_refused_at_once(url)
    assert_refused_at_once(pd.proxy_url, "/v1/completions")
    assert_refused_at_once(colocated.url, "/v1/chat/completions")
    out = generate(pd.proxy_url, {"text": PROMPTS[1], "sampling_params": GREEDY})
    assert out["output_ids"] == reference[PROMPTS[1]]["output_ids"]
    wait_pools_baseline(pd)


def _turns(url: str, system: list[int], questions: list[list[int]]) -> list[dict]:
    """A conversation: each turn's prompt is the previous prompt + its answer + a question."""
    history, outs = list(system), []
    for q in questions:
        prompt = history + q
        out = generate(url, {"input_ids": prompt, "sampling_params": GREEDY})
        outs.append(out)
        history = prompt + out["output_ids"]
    return outs


def test_multi_turn_hits_p_prefix_cache_and_matches_colocated(pd, colocated):
    """Turns after the first reuse P's cached pages (the whole conversation so far); D reports
    P's hit in meta_info.cached_tokens; the tokens equal the colocated server's."""
    system = [256] + [ord(c) for c in "You are a helpful assistant for paged KV caches. " * 2]
    questions = [[ord(c) for c in f"Question {i}: why?"] for i in range(3)]
    ref = _turns(colocated.url, system, questions)
    got = _turns(pd.proxy_url, system, questions)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    page = 16
    for i, o in enumerate(got):
        prompt_len = o["meta_info"]["prompt_tokens"]
        cached = o["meta_info"]["cached_tokens"]
        assert cached % page == 0 and cached < prompt_len
        if i:  # everything before this turn's question, in full pages, came from the cache
            previous = got[i - 1]["meta_info"]["prompt_tokens"] + len(got[i - 1]["output_ids"])
            assert cached >= (previous - 1) // page * page - page, (i, cached, previous)
            assert cached > 0
    wait_pools_baseline(pd)
