"""Async load generator: sends a workload as streaming sglang `/generate` requests.

`run_load(url, requests, settings)` schedules arrivals (Poisson or fixed inter-arrival times
at `request_rate`, seeded; all at once for rate inf), caps requests in flight at
`max_concurrency`, streams every response with one shared `httpx.AsyncClient` and records
per request: send time, the arrival time of every output token, and an error kind. Errors
(HTTP status, timeout, connection, error event in the stream, bad stream) are recorded,
never raised, so one bad request cannot end a run. A rich progress bar shows completions.

`run_conversations(url, conversations, settings)` sends a multiturn workload: conversations
start at the arrival times, each sends its turns in order, a turn's prompt being the previous
prompt + the answer's output ids + the new user message; a failed turn ends its conversation
(the turns it never sent are recorded as `conversation_ended`). `run_chat(url, conversations,
settings)` does the same with real text through `/v1/chat/completions`: a turn's messages are
the conversation so far, the answers' text included; a token's arrival is its text delta, and
the closing usage chunk gives exact counts (tokens a server joined into one delta count as
arriving at the end, with no gap: ITL there is an estimate, TTFT and E2E are exact).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.workload import BenchRequest, ChatConversation, Conversation


@dataclass
class RequestResult:
    index: int
    tag: str
    input_len: int | None
    expected_output_len: int
    start: float = 0.0                       # perf_counter when sent
    end: float = 0.0                         # when the stream ended (or failed)
    token_times: list[float] = field(default_factory=list)  # arrival time of each token
    prompt_tokens: int | None = None         # as reported by the server
    cached_tokens: int | None = None         # prompt tokens served by a prefix cache (server)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""                    # the answer's text (chat workload)
    timeline: dict[str, float] | None = None  # D's meta_info.pd_timeline (ms), PD servers only
    error: str | None = None                 # kind: http_503, timeout, connection, ...
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)


def arrival_offsets(n: int, settings: BenchSettings) -> list[float]:
    """Seconds after the start at which each request arrives."""
    rate = settings.request_rate
    if math.isinf(rate):
        return [0.0] * n
    if settings.arrival == "fixed":
        return [i / rate for i in range(n)]
    rng = random.Random(settings.seed + 104729)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _generate_chunk(res: RequestResult, chunk: dict, now: float) -> None:
    """An sglang `/generate` stream chunk: cumulative `output_ids` (or a token count)."""
    ids = chunk.get("output_ids")
    meta = chunk.get("meta_info", {})
    seen = len(res.token_times)
    n = len(ids) if isinstance(ids, list) else int(meta.get("completion_tokens", seen))
    res.token_times.extend([now] * max(0, n - seen))
    if isinstance(ids, list):
        res.output_ids = ids
    pt, ct = meta.get("prompt_tokens"), meta.get("cached_tokens")
    if isinstance(pt, int):
        res.prompt_tokens = pt
    if isinstance(ct, int):
        res.cached_tokens = ct
    if isinstance(meta.get("pd_timeline"), dict):
        res.timeline = meta["pd_timeline"]


def _chat_chunk(res: RequestResult, chunk: dict, now: float) -> None:
    """An OpenAI chat stream chunk: a text delta (one per token as the server streams them);
    the closing usage chunk gives the exact token counts."""
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            res.token_times.append(now)
            res.output_text += content
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        n = usage.get("completion_tokens")
        if isinstance(n, int):  # text held back and sent together: the rest arrived now
            res.token_times.extend([now] * max(0, n - len(res.token_times)))
        if isinstance(usage.get("prompt_tokens"), int):
            res.prompt_tokens = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            res.cached_tokens = cached


async def _stream(client: httpx.AsyncClient, endpoint: str, body: dict, res: RequestResult,
                  on_chunk) -> None:
    """POST `body`, read the SSE stream, hand each chunk to `on_chunk(res, chunk, now)`."""
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error, res.error_detail = f"http_{resp.status_code}", text[:300]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    res.error, res.error_detail = "bad_stream", data[:300]
                    return
                if "error" in chunk:
                    err = chunk["error"]
                    code = err.get("code", "") if isinstance(err, dict) else ""
                    res.error = f"stream_error{f'_{code}' if code else ''}"
                    res.error_detail = json.dumps(err)[:300]
                    return
                on_chunk(res, chunk, now)
        if not res.token_times:
            res.error, res.error_detail = "no_tokens", "stream ended without output tokens"
    except httpx.TimeoutException as exc:
        res.error, res.error_detail = "timeout", repr(exc)[:300]
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError,
            httpx.WriteError) as exc:
        res.error, res.error_detail = "connection", repr(exc)[:300]
    except httpx.HTTPError as exc:
        res.error, res.error_detail = type(exc).__name__.lower(), repr(exc)[:300]
    finally:
        res.end = time.perf_counter()


async def _stream_one(client: httpx.AsyncClient, url: str, req: BenchRequest,
                      settings: BenchSettings, res: RequestResult) -> None:
    await _stream(client, f"{url}/generate", req.body(settings), res, _generate_chunk)


def chat_body(messages: list[dict], output_len: int, settings: BenchSettings) -> dict:
    return {"messages": messages, "max_tokens": output_len, "temperature": settings.temperature,
            "ignore_eos": settings.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}


@asynccontextmanager
async def _session(settings: BenchSettings, total: int, progress: bool | None,
                   api_key: str | None = None) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """One pooled client for the run and the progress bar; yields (client, advance(ok)).
    `api_key`: sent as `Authorization: Bearer` (a proxy with an API key)."""
    limits = httpx.Limits(max_connections=settings.max_concurrency,
                          max_keepalive_connections=settings.max_concurrency)
    timeout = httpx.Timeout(settings.timeout_s, connect=min(10.0, settings.timeout_s))
    show = settings.progress if progress is None else progress
    bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
                   disable=not show, transient=True)
    errors = 0
    async with httpx.AsyncClient(limits=limits, timeout=timeout,
                                 headers=auth_headers(api_key)) as client:
        with bar:
            task = bar.add_task("bench", total=total, errors=0)

            def advance(ok: bool) -> None:
                nonlocal errors
                errors += 0 if ok else 1
                bar.update(task, advance=1, errors=errors)

            yield client, advance


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _send(stream, settings: BenchSettings, res: RequestResult) -> None:
    """Await one request's `stream` coroutine, bounded by twice the request timeout."""
    try:
        await asyncio.wait_for(stream, timeout=settings.timeout_s * 2)
    except asyncio.TimeoutError:
        res.error = "timeout"
        res.end = time.perf_counter()


def _duration(results: list[RequestResult]) -> float:
    starts = [r.start for r in results if r.start]
    ends = [r.end for r in results if r.end]
    return (max(ends) - min(starts)) if starts and ends else 0.0


async def _at_offsets(offsets: list[float], sem: asyncio.Semaphore | None, start) -> None:
    """Start `start(i)` at each offset (after taking `sem` when given); wait for them all."""
    t0 = time.perf_counter()
    tasks = []
    for i, off in enumerate(offsets):
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        tasks.append(asyncio.create_task(start(i)))
    await asyncio.gather(*tasks)


async def run_load_async(url: str, requests: list[BenchRequest], settings: BenchSettings,
                         *, progress: bool | None = None,
                         offsets: list[float] | None = None,
                         api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests`; returns (results in request order, wall duration in seconds)."""
    url = url.rstrip("/")
    offsets = arrival_offsets(len(requests), settings) if offsets is None else offsets
    results = [RequestResult(i, r.tag, r.input_len, r.output_len) for i, r in enumerate(requests)]
    sem = asyncio.Semaphore(settings.max_concurrency)
    async with _session(settings, len(requests), progress, api_key) as (client, advance):
        async def one(i: int) -> None:
            try:
                await _send(_stream_one(client, url, requests[i], settings, results[i]),
                            settings, results[i])
            finally:
                sem.release()
                advance(results[i].ok)

        await _at_offsets(offsets, sem, one)
    return results, _duration(results)


class _IdTurns:
    """Turns of a token-id conversation to /generate: each prompt is the conversation so far
    (previous prompt and answer ids) plus the turn's user ids."""

    def __init__(self, conv: Conversation):
        self.conv, self.history = conv, []

    def stream(self, client, url: str, t: int, res: RequestResult, settings: BenchSettings):
        prompt = self.conv.prompt(self.history, t)
        res.input_len = len(prompt)
        self.history = prompt
        req = BenchRequest(output_len=self.conv.output_lens[t], input_ids=prompt, tag=res.tag)
        return _stream_one(client, url, req, settings, res)

    def done(self, res: RequestResult) -> None:
        self.history = self.history + list(res.output_ids)


class _ChatTurns:
    """Turns of a real-text conversation to /v1/chat/completions: each turn's messages are the
    conversation so far (system, earlier user messages, the answers' text) plus its own."""

    def __init__(self, conv: ChatConversation):
        self.conv = conv
        self.messages = [{"role": "system", "content": conv.system}] if conv.system else []

    def stream(self, client, url: str, t: int, res: RequestResult, settings: BenchSettings):
        self.messages = [*self.messages, {"role": "user", "content": self.conv.turns[t]}]
        body = chat_body(self.messages, self.conv.output_lens[t], settings)
        return _stream(client, f"{url}/v1/chat/completions", body, res, _chat_chunk)

    def done(self, res: RequestResult) -> None:
        res.input_len = res.prompt_tokens
        self.messages = [*self.messages, {"role": "assistant", "content": res.output_text}]


async def _play_conversations(url: str, conversations: list, turns_of, settings: BenchSettings,
                              progress: bool | None, api_key: str | None
                              ) -> tuple[list[RequestResult], float]:
    """Conversations start at the arrival offsets; each sends its turns in order (`turns_of`
    builds a conversation's turns); a failed turn ends its conversation. Results in
    (conversation, turn) order, tagged `turn<k>`."""
    url = url.rstrip("/")
    turns = settings.multiturn.turns
    results = [RequestResult(c.index * turns + t, f"turn{t + 1}", None, c.output_lens[t])
               for c in conversations for t in range(turns)]
    sem = asyncio.Semaphore(settings.max_concurrency)
    async with _session(settings, len(results), progress, api_key) as (client, advance):
        async def converse(ci: int) -> None:
            play = turns_of(conversations[ci])
            for t in range(turns):
                res = results[ci * turns + t]
                if t and not results[ci * turns + t - 1].ok:
                    res.error, res.error_detail = "conversation_ended", "an earlier turn failed"
                    advance(False)
                    continue
                async with sem:
                    await _send(play.stream(client, url, t, res, settings), settings, res)
                play.done(res)
                advance(res.ok)

        await _at_offsets(arrival_offsets(len(conversations), settings), None, converse)
    return results, _duration(results)


async def run_conversations_async(url: str, conversations: list[Conversation],
                                  settings: BenchSettings, *, progress: bool | None = None,
                                  api_key: str | None = None
                                  ) -> tuple[list[RequestResult], float]:
    """Send a multiturn workload of token ids to /generate."""
    return await _play_conversations(url, conversations, _IdTurns, settings, progress, api_key)


async def run_chat_async(url: str, conversations: list[ChatConversation],
                         settings: BenchSettings, *, progress: bool | None = None,
                         api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send a chat workload of real text to `/v1/chat/completions`."""
    return await _play_conversations(url, conversations, _ChatTurns, settings, progress,
                                     api_key)


def run_chat(url: str, conversations: list[ChatConversation], settings: BenchSettings,
             **kw) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_chat_async(url, conversations, settings, **kw))


def run_load(url: str, requests: list[BenchRequest], settings: BenchSettings,
             **kw) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load_async(url, requests, settings, **kw))


def run_conversations(url: str, conversations: list[Conversation], settings: BenchSettings,
                      **kw) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_conversations_async(url, conversations, settings, **kw))
