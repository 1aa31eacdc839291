"""OpenAI-compatible routes driven by the official `openai` client (sync and streaming), against
a server started in the launcher's form (--run-dir RUN --process NAME)."""

from __future__ import annotations

import httpx
import openai
import pytest

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
