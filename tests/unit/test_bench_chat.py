"""The chat workload (`bench.workload: chat`): real-text conversations read from the shipped
JSONL (or `bench.dataset`), sent turn by turn to a fake OpenAI chat server (a tiny ASGI app in a
thread) that records every request and streams one text delta per token, some deltas joined
(text held back, as a detokenizer does) and a closing usage chunk. Each turn's messages must be
the conversation so far with the answers' text; tokens are counted exactly; a failed turn ends
its conversation; bad datasets name the key."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdtopo.bench.loadgen import run_chat
from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.stats import summarize
from pdtopo.bench.workload import CHAT_DATASET, chat_conversations
from pdtopo.config.schema import TopologyError
from tests.support.serving import json_body, serve_in_thread

SEEN: list[dict] = []


async def fake_chat(scope, receive, send):
    if scope["type"] != "http":
        return
    req = await json_body(receive)
    SEEN.append(req)
    if "fail" in req["messages"][-1]["content"]:
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"overloaded"})
        return
    n = req["max_tokens"]
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})

    async def event(chunk: dict) -> None:
        await send({"type": "http.response.body", "more_body": True,
                    "body": f"data: {json.dumps(chunk)}\n\n".encode()})

    await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    i = 0
    while i < n:
        width = 2 if i == 1 and n > 2 else 1  # tokens 1 and 2 arrive as one delta
        await asyncio.sleep(0.002)
        await event({"choices": [{"index": 0, "delta": {"content": "".join(f"w{j} " for j in range(i, i + width))}}]})
        i += width
    prompt = sum(len(m["content"].split()) for m in req["messages"])
    await event({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                          "prompt_tokens_details": {"cached_tokens": 3}}})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.fixture(scope="module")
def chat_url():
    with serve_in_thread(fake_chat, lifespan="off") as port:
        yield f"http://127.0.0.1:{port}"


def _settings(**kw) -> BenchSettings:
    base = {"progress": False, "warmup_requests": 0, "workload": "chat", "output_len": 5}
    return BenchSettings.with_defaults({**base, **kw})


def test_shipped_conversations_cycle_to_the_settings():
    s = _settings(multiturn={"conversations": 20, "turns": 3})
    convs = chat_conversations(s)
    assert len(convs) == 20 and all(len(c.turns) == 3 for c in convs)
    lines = CHAT_DATASET.read_text().splitlines()
    assert convs[0].turns == json.loads(lines[0])["turns"][:3]
    assert convs[len(lines)].turns == convs[0].turns  # cycled
    assert s.num_workload_requests == 60


def test_turns_carry_the_conversation_and_count_tokens(chat_url, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"system": "be brief", "turns": ["hello there", "and more"]})
                    + "\n" + json.dumps({"turns": ["fail now", "never"]}) + "\n")
    s = _settings(dataset=str(data), multiturn={"conversations": 2, "turns": 2})
    SEEN.clear()
    results, duration = run_chat(chat_url, chat_conversations(s), s)
    [turn2] = [r for r in SEEN if r["messages"][-1]["content"] == "and more"]
    assert [m["role"] for m in turn2["messages"]] == ["system", "user", "assistant", "user"]
    assert turn2["messages"][2]["content"] == "w0 w1 w2 w3 w4 "  # the first answer's text
    assert turn2["stream"] and turn2["stream_options"] == {"include_usage": True}
    assert turn2["max_tokens"] == 5 and turn2["temperature"] == 0.0
    ok = [r for r in results if r.ok]
    assert len(ok) == 2 and all(r.output_tokens == 5 for r in ok)
    assert ok[0].prompt_tokens == 4 and ok[0].input_len == 4 and ok[0].cached_tokens == 3
    assert [r.error for r in results if not r.ok] == ["http_503", "conversation_ended"]
    st = summarize(results, duration, s.slo)
    assert st["requests"] == {"total": 4, "completed": 2, "failed": 2}
    assert st["output_tokens"] == 10
    assert not any(r["messages"][-1]["content"] == "never" for r in SEEN)


def test_bad_chat_datasets_name_the_key(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(TopologyError) as err:
        chat_conversations(_settings(dataset=str(bad)))
    assert err.value.key == "bench.dataset" and "turns" in str(err.value)
    bad.write_text(json.dumps({"turns": ["only one"]}) + "\n")
    with pytest.raises(TopologyError) as err:
        chat_conversations(_settings(dataset=str(bad), multiturn={"turns": 2}))
    assert err.value.key == "bench.multiturn.turns"
