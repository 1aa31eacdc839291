"""OpenAI-compatible routes driven by the official `openai` client (sync and streaming), against
a server started in the launcher's form (--run-dir RUN --process NAME); and the serving API's
sampling features there: logprobs in sglang's and OpenAI's shapes (the official client's typed
models validate every field), `n > 1` (seeded, distinct, reproducible; one prefill for all of
them through the prefix cache), penalties and min_p changing outputs, and stop strings found on
a long output."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.support.api_server import run_dir_server
from tests.support.e2e import wait_pools_baseline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with run_dir_server(tmp_path_factory.mktemp("openai")) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def pool_baseline(url):
    yield
    wait_pools_baseline(url, timeout=20)


def test_served_model_name_from_config(client, url):
    assert [m.id for m in client.models.list().data] == ["tiny-served"]
    assert httpx.get(url + "/get_model_info").json()["served_model_name"] == "tiny-served"


def test_completions_sync_matches_native_generate(client, url):
    resp = client.completions.create(model="tiny-served", prompt="Once upon", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    native = httpx.post(url + "/generate", json={
        "text": "Once upon", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True}}, timeout=60).json()
    assert resp.choices[0].text == native["text"]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens == len("Once upon") + 1
    batch = client.completions.create(model="m", prompt=["a", "bcd"], max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 6


def test_completions_streaming(client):
    kw = dict(model="m", prompt="stream", max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_sync_and_streaming(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    a = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model="m", messages=msgs, max_completion_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 5 and a.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="m", messages=msgs, max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_seeded_chat_is_reproducible(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=8,
              temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == a


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_completion_tokens=100000), "max_completion_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(n=0), "n"),
    (dict(top_p=0), "top_p"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
])
def test_chat_bad_input_is_400(client, kw, field):
    args = {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(**args)
    assert field in ei.value.message


def test_completions_bad_input_is_400(client):
    for kw, field in [(dict(prompt=""), "prompt"), (dict(prompt="x", max_tokens=-1), "max_tokens"),
                      (dict(prompt="x" * 1100), "prompt"), (dict(prompt="x", echo=True), "echo"),
                      (dict(prompt="x", presence_penalty=5.0), "presence_penalty")]:
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model="m", **kw)
        assert field in ei.value.message, (kw, ei.value.message)
    assert client.completions.create(model="m", prompt="ok", max_tokens=1).choices


MSG = [{"role": "user", "content": "tell me a story"}]


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_logprobs_in_sglangs_shape(url):
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = post(url, "/generate", {"text": "abc", "sampling_params": sp, "return_logprob": True,
                                  "top_logprobs_num": 3, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    tokens = meta["output_token_logprobs"]
    assert [t for _, t, _ in tokens] == out["output_ids"]
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in tokens)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 6 and all(len(top) == 3 for top in tops)
    for (lp, token, _), top in zip(tokens, tops, strict=True):
        assert top[0][1] == token and top[0][0] == pytest.approx(lp)  # greedy: the best one
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
    assert meta["input_token_logprobs"] == []
    plain = post(url, "/generate", {"text": "abc", "sampling_params": sp})
    assert plain["output_ids"] == out["output_ids"] and "output_token_logprobs" not in \
        plain["meta_info"]
    no_top = post(url, "/generate", {"text": "abc", "sampling_params": sp,
                                     "return_logprob": True})["meta_info"]
    assert "output_top_logprobs" not in no_top
    assert [e[2] for e in no_top["output_token_logprobs"]] == [None] * 6


def test_generate_streaming_logprobs_are_cumulative(url):
    body = {"text": "abc", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    last = json.loads(chunks[-1])
    assert len(last["meta_info"]["output_token_logprobs"]) == 5
    assert [t for _, t, _ in last["meta_info"]["output_token_logprobs"]] == last["output_ids"]


def test_openai_logprobs_parse_in_the_typed_models(client, url):
    raw = post(url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True, "logprobs": True,
                                             "top_logprobs": 4})
    chat = ChatCompletion.model_validate(raw)  # pydantic validation of every field
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 4 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    raw = post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 5, "temperature": 0,
                                        "ignore_eos": True, "logprobs": 2})
    comp = Completion.model_validate(raw)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset[0] == 0
    plain = client.chat.completions.create(model="m", messages=MSG, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_openai_streaming_logprobs_cover_every_token(client):
    stream = client.chat.completions.create(model="m", messages=MSG, max_tokens=6, temperature=0,
                                            stream=True, logprobs=True, top_logprobs=2,
                                            extra_body={"ignore_eos": True})
    entries = [e for c in stream if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    chunks = list(client.completions.create(model="m", prompt="abc", max_tokens=6,
                                            temperature=0, stream=True, logprobs=1,
                                            extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 6


def test_n_completions_are_seeded_distinct_and_reproducible(client, url):
    kw = dict(model="m", messages=MSG, max_tokens=12, temperature=1.0, seed=7, n=4,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts
    assert texts == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 48
    # completion i has seed + i: a single request with seed 8 is the second completion
    one = client.chat.completions.create(**{**kw, "n": 1, "seed": 8})
    assert one.choices[0].message.content == texts[1]
    # /generate: sampling_params.n gives a list of results; a batch of 2 prompts x n=2 gives 4
    sp = {"max_new_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True}
    out = post(url, "/generate", {"text": "abc", "sampling_params": sp})
    assert isinstance(out, list) and len(out) == 2
    outs = post(url, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": sp})
    assert len(outs) == 4 and [len(o["output_ids"]) for o in outs] == [4] * 4
    comp = client.completions.create(model="m", prompt=["ab", "cd"], n=3, max_tokens=3,
                                     temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == list(range(6))


def test_n_completions_share_one_prefill(url):
    """The first completion's prompt pages go into the prefix cache when its prefill ends;
    the others start from them and compute only the prompt's last partial page."""
    prompt = list(range(3, 3 + 100))
    before = httpx.get(url + "/pdtopo/state").json()
    post(url, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.8, "n": 4, "ignore_eos": True}})
    after = httpx.get(url + "/pdtopo/state").json()
    computed = after["num_prefill_tokens"] - before["num_prefill_tokens"]
    page = httpx.get(url + "/get_server_info").json()["page_size"]
    tail = len(prompt) - (len(prompt) - 1) // page * page
    assert computed == len(prompt) + 3 * tail, (computed, tail)


def test_penalties_and_min_p_change_the_output(url):
    base = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = post(url, "/generate", {"text": "aaaa", "sampling_params": base})["output_ids"]
    rep = post(url, "/generate", {"text": "aaaa", "sampling_params": {
        **base, "frequency_penalty": 2.0, "presence_penalty": 2.0}})["output_ids"]
    assert rep != plain
    assert max(rep.count(t) for t in set(rep)) <= max(plain.count(t) for t in set(plain))
    sampled = {"max_new_tokens": 16, "temperature": 1.5, "seed": 4, "ignore_eos": True}

    def margins(extra: dict) -> list[float]:
        """Per step: the sampled token's logprob minus the best token's."""
        meta = post(url, "/generate", {"text": "x", "return_logprob": True,
                                       "top_logprobs_num": 1,
                                       "sampling_params": {**sampled, **extra}})["meta_info"]
        return [lp - top[0][0] for (lp, _, _), top in
                zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True)]

    # min_p 0.9 keeps only tokens with at least 0.9x the best one's probability
    assert all(m >= math.log(0.9) - 1e-5 for m in margins({"min_p": 0.9}))
    assert min(margins({})) < math.log(0.9)  # without it, some step goes further down


def test_stop_string_found_late_in_a_long_output(url):
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    full = post(url, "/generate", {"text": "story", "sampling_params": sp})
    text = full["text"]
    # a stop string that first appears late (tiny random model: bytes, some not printable)
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                if text[i:i + 3] not in text[:i + 2] and "\ufffd" not in text[i:i + 3])
    assert text.index(stop) >= len(text) // 2 > 20, (len(text), stop)
    out = post(url, "/generate", {"text": "story", "sampling_params": {**sp, "stop": stop}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.index(stop)]
