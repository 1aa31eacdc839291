"""OpenAI-compatible routes, as one `APIRouter` (`router`): POST /v1/completions and
POST /v1/chat/completions, each answered whole or streamed as SSE chunks (`stream: true`).

Each handler gets the server's `ServerState` through the `ServerDep` dependency (`routing.py`),
tokenizes its prompt(s) off the event loop (`ServerState.off_loop`; a completion's prompt:
text, texts, ids or lists of ids; a chat's messages: rendered with the tokenizer's chat
template), maps the OpenAI fields onto pdtopo's sampling values (`max_tokens` /
`max_completion_tokens` -> max_new_tokens, `n`, `seed`, `stop`, the penalties, min_p, plus the
sglang extensions top_k, ignore_eos, stop_token_ids), validates everything before it submits
`n` requests per prompt (`fanout.py`), and then builds the `text_completion` /
`chat.completion` body or its chunks from the handles' outputs, with logprobs in OpenAI's two
shapes when asked for (`logprob_format.py`: completions' `logprobs: k`, chat's `logprobs` and
`top_logprobs`). `echo` is a 400 naming the field (prompt logprobs are not computed).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from pdtopo.runtime.api.fanout import submit_completions
from pdtopo.runtime.api.logprob_format import chat_logprobs, completion_logprobs
from pdtopo.runtime.api.movable import note_envelope
from pdtopo.runtime.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _OpenAICommon,
    check_top_logprobs,
    parse_body,
)
from pdtopo.runtime.api.resume_context import RESUMING
from pdtopo.runtime.api.routing import (
    ServerDep,
    event_stream,
    finished_or_error,
    stream_error_event,
)
from pdtopo.runtime.api.state import Handle, Prepared, ServerState
from pdtopo.runtime.api.streaming import (
    SSE_DONE,
    TextView,
    abort_error,
    merged_outputs,
    openai_finish_reason,
    sse,
)
from pdtopo.runtime.engine.request import InvalidRequest, new_rid

router = APIRouter()


def _completion_logprobs(body: CompletionRequest) -> int:
    """SamplingParams.logprobs of a completion (`logprobs`: how many alternatives; checked
    before the prompt is tokenized: a long one takes seconds)."""
    check_top_logprobs(body.logprobs, "logprobs")
    return -1 if body.logprobs is None else body.logprobs


def _chat_logprobs(body: ChatCompletionRequest) -> int:
    """SamplingParams.logprobs of a chat (`logprobs: true`, `top_logprobs`: how many)."""
    check_top_logprobs(body.top_logprobs, "top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("top_logprobs", "top_logprobs needs logprobs: true")
    return (body.top_logprobs or 0) if body.logprobs else -1


def _sampling_dict(body: _OpenAICommon, max_tokens: int | None) -> dict[str, Any]:
    d = {"max_new_tokens": max_tokens, "n": body.n, "temperature": body.temperature,
         "top_p": body.top_p,
         "top_k": body.top_k, "seed": body.seed, "stop": body.stop,
         "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos,
         "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
         "repetition_penalty": body.repetition_penalty, "min_p": body.min_p}
    return {k: v for k, v in d.items() if v is not None}


def _rename_field(exc: InvalidRequest, mapping: dict[str, str]) -> InvalidRequest:
    """Report sampling errors under the OpenAI field names the client used."""
    f = exc.field or ""
    key = f.split(".", 1)[1] if f.startswith("sampling_params") and "." in f else f
    new = mapping.get(key, key)
    msg = exc.message.replace(f, new) if f else exc.message
    return InvalidRequest(new, msg)


def _prepare(state: ServerState, prompt_ids: list[int], body: _OpenAICommon,
             max_tokens: int | None, max_tokens_name: str, prompt_field: str,
             logprobs: int) -> Prepared:
    mapping = {"max_new_tokens": max_tokens_name}
    try:
        sp = _sampling_dict(body, max_tokens)
        prepared = state.prepare(prompt_ids, sp, prompt_field=prompt_field,
                                 max_tokens_field=max_tokens_name)
    except InvalidRequest as e:
        raise _rename_field(e, mapping) from None
    prepared.sampling.logprobs = logprobs
    return prepared


def _routing(body: _OpenAICommon) -> dict[str, Any]:
    return {k: getattr(body, k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}


def _usage(handles: list[Handle]) -> dict[str, Any]:
    p = sum(len(h.req.prompt_ids) for h in handles)
    c = sum(len(h.output_ids) for h in handles)
    cached = sum(h.final.cached_tokens for h in handles if h.final is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _include_usage(body: _OpenAICommon) -> bool:
    """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
    return body.stream_options is not None and body.stream_options.include_usage


@dataclass(frozen=True)
class _Envelope:
    """What every body and chunk of one response starts with."""

    id: str
    model: str
    created: int

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _envelope(state: ServerState, body: _OpenAICommon, rid: str) -> _Envelope:
    """A moved response (resume_context.py) keeps the id and created time the client has."""
    ticket = RESUMING.get()
    given = ticket.envelope() if ticket is not None else None
    if given:
        return _Envelope(str(given["id"]), body.model or state.served_model_name,
                         int(given["created"]))
    env = _Envelope(rid, body.model or state.served_model_name, int(time.time()))
    note_envelope(env.id, env.created)
    return env


# ---------------------------------------------------------------- /v1/completions
def _completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """A completion's `prompt` (a text, texts, token ids or lists of ids) as token ids."""
    if isinstance(prompt, str):
        return [state.encode_text(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return [state.encode_text(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return [state.check_ids(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
    return [state.check_ids(prompt, "prompt")]


def _submit_completions(state: ServerState, body: CompletionRequest,
                        prompts: list[list[int]]) -> tuple[str, list[Handle]]:
    """Validate every prompt (`_completion_prompts`), then submit them: (the response id, one
    handle per completion: n per prompt, prompt by prompt)."""
    logprobs = _completion_logprobs(body)
    prepared = [_prepare(state, ids, body, body.max_tokens, "max_tokens",
                         "prompt" if len(prompts) == 1 else f"prompt[{i}]", logprobs)
                for i, ids in enumerate(prompts)]
    base = body.rid or f"cmpl-{new_rid()}"
    rids = [base] if len(prepared) == 1 else [f"{base}_{i}" for i in range(len(prepared))]
    return base, submit_completions(state, prepared, rids, _routing(body))


def _token_logprobs(state: ServerState, h: Handle, start: int, end: int,
                    offset: int = 0) -> dict[str, Any] | None:
    """Completion logprobs of output tokens [start, end) (None: not asked for)."""
    top_n = h.req.sampling.logprobs
    if top_n < 0:
        return None
    return completion_logprobs(state.tokenizer, h.output_ids[start:end],
                               h.output_logprobs[start:end], top_n, offset)


def _completion_body(state: ServerState, env: _Envelope, handles: list[Handle],
                     views: list[TextView]) -> dict[str, Any]:
    choices = [{"index": i, "text": v.visible(h.output_ids, h.final),
                "logprobs": _token_logprobs(state, h, 0, len(h.output_ids)),
                "finish_reason": openai_finish_reason(h.final)}
               for i, (h, v) in enumerate(zip(handles, views, strict=True))]
    return {**env.fields("text_completion"), "choices": choices, "usage": _usage(handles)}


async def _completion_events(state: ServerState, env: _Envelope, handles: list[Handle],
                             views: list[TextView],
                             include_usage: bool) -> AsyncIterator[bytes]:
    """One chunk per output with new visible text, new logprobs or a finish, then usage,
    then [DONE]."""
    reported = [0] * len(handles)  # output tokens whose logprobs were sent, per choice
    offsets = [0] * len(handles)   # their text's length (the next text_offset)
    async for i, out in merged_outputs(handles):
        h = handles[i]
        err = abort_error(out) if out.finished else None
        if err is not None:
            yield stream_error_event(h, err)
            continue
        ids = h.output_ids[:out.num_output_tokens]
        delta = views[i].delta(ids, out if out.finished else None)
        logprobs = _token_logprobs(state, h, reported[i], len(ids), offsets[i])
        if logprobs is not None:
            reported[i] = len(ids)
            offsets[i] += sum(len(t) for t in logprobs["tokens"])
        if not delta and not out.finished and not (logprobs and logprobs["tokens"]):
            continue
        yield sse({**env.fields("text_completion"), "choices": [{
            "index": i, "text": delta, "logprobs": logprobs,
            "finish_reason": openai_finish_reason(out) if out.finished else None}]})
    if include_usage:
        yield sse({**env.fields("text_completion"), "choices": [], "usage": _usage(handles)})
    yield SSE_DONE


@router.post("/v1/completions")
async def completions(request: Request, state: ServerDep):
    body = await parse_body(request, CompletionRequest)
    state.require_engine()
    if body.echo:
        raise InvalidRequest("echo", "echo is not supported")
    _completion_logprobs(body)
    prompts = await state.off_loop(_completion_prompts, state, body.prompt)  # a long one: seconds
    base, handles = _submit_completions(state, body, prompts)
    views = [TextView(state.tokenizer, h) for h in handles]
    env = _envelope(state, body, base)
    if body.stream:
        return event_stream(_completion_events(state, env, handles, views,
                                               _include_usage(body)))
    if (err := await finished_or_error(handles, request)) is not None:
        return err
    return _completion_body(state, env, handles, views)


# ---------------------------------------------------------------- /v1/chat/completions
def _chat_prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The messages rendered with the chat template, tokenized as transformers does."""
    tok = state.tokenizer
    messages = [m.model_dump() for m in body.messages]
    try:
        text = tok.apply_chat_template(messages)
    except ValueError as e:
        raise InvalidRequest("messages", str(e)) from None
    # a model's template writes its special tokens itself (transformers encodes the rendered
    # chat with add_special_tokens=False); only pdtopo's fallback template gets the BOS
    return state.encode_text(text, "messages", add_special_tokens=tok.chat_add_special_tokens)


def _chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """(the token limit, the field it came from): max_completion_tokens over max_tokens."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def _chat_token_logprobs(state: ServerState, h: Handle, start: int,
                         end: int) -> dict[str, Any] | None:
    top_n = h.req.sampling.logprobs
    if top_n < 0:
        return None
    return chat_logprobs(state.tokenizer, h.output_ids[start:end], h.output_logprobs[start:end],
                         top_n)


def _chat_body(state: ServerState, env: _Envelope, handles: list[Handle],
               views: list[TextView]) -> dict[str, Any]:
    choices = [{"index": i,
                "message": {"role": "assistant", "content": v.visible(h.output_ids, h.final)},
                "logprobs": _chat_token_logprobs(state, h, 0, len(h.output_ids)),
                "finish_reason": openai_finish_reason(h.final)}
               for i, (h, v) in enumerate(zip(handles, views, strict=True))]
    return {**env.fields("chat.completion"), "choices": choices, "usage": _usage(handles)}


def _chat_chunk(env: _Envelope, index: int, delta: dict[str, Any], finish: str | None = None,
                logprobs: dict[str, Any] | None = None) -> str:
    return sse({**env.fields("chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}]})


async def _chat_events(state: ServerState, env: _Envelope, handles: list[Handle],
                       views: list[TextView], include_usage: bool) -> AsyncIterator[bytes]:
    """Per choice: the assistant role, content deltas (with the new tokens' logprobs when asked
    for), a finish chunk; then usage, then [DONE]."""
    for i in range(len(handles)):
        yield _chat_chunk(env, i, {"role": "assistant", "content": ""})
    reported = [0] * len(handles)
    async for i, out in merged_outputs(handles):
        h = handles[i]
        err = abort_error(out) if out.finished else None
        if err is not None:
            yield stream_error_event(h, err)
            continue
        ids = h.output_ids[:out.num_output_tokens]
        delta = views[i].delta(ids, out if out.finished else None)
        logprobs = _chat_token_logprobs(state, h, reported[i], len(ids))
        reported[i] = len(ids)
        if delta or (logprobs and logprobs["content"]):
            yield _chat_chunk(env, i, {"content": delta}, logprobs=logprobs)
        if out.finished:
            yield _chat_chunk(env, i, {}, openai_finish_reason(out))
    if include_usage:
        yield sse({**env.fields("chat.completion.chunk"), "choices": [],
                   "usage": _usage(handles)})
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: ServerDep):
    body = await parse_body(request, ChatCompletionRequest)
    state.require_engine()
    logprobs = _chat_logprobs(body)
    ids = await state.off_loop(_chat_prompt_ids, state, body)  # template + tokens: off the loop
    max_tokens, max_tokens_name = _chat_max_tokens(body)
    prepared = _prepare(state, ids, body, max_tokens, max_tokens_name, "messages", logprobs)
    cid = body.rid or f"chatcmpl-{new_rid()}"
    handles = submit_completions(state, [prepared], [cid], _routing(body))
    views = [TextView(state.tokenizer, h) for h in handles]
    env = _envelope(state, body, cid)
    if body.stream:
        return event_stream(_chat_events(state, env, handles, views, _include_usage(body)))
    if (err := await finished_or_error(handles, request)) is not None:
        return err
    return _chat_body(state, env, handles, views)
