"""OpenAI-compatible routes: POST /v1/completions and POST /v1/chat/completions (+ streaming).

OpenAI fields map onto pdtopo's sampling values (`max_tokens` / `max_completion_tokens` ->
max_new_tokens, `seed`, `stop`, plus the sglang extensions top_k, ignore_eos, stop_token_ids);
chat prompts are rendered with the tokenizer's chat template. Unsupported options (n > 1,
logprobs, echo, non-zero penalties) are 400s naming the field.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdtopo.runtime.api.errors import error_response
from pdtopo.runtime.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _OpenAICommon,
    parse_body,
)
from pdtopo.runtime.api.state import Handle, ServerState
from pdtopo.runtime.api.streaming import (
    SSE_DONE,
    ClientDisconnected,
    TextView,
    abort_error,
    collect,
    merged_outputs,
    openai_finish_reason,
    sse,
)
from pdtopo.runtime.engine.request import InvalidRequest, new_rid


def _sampling_dict(body: _OpenAICommon, max_tokens: int | None) -> dict[str, Any]:
    if body.n not in (None, 1):
        raise InvalidRequest("n", f"n={body.n} is not supported (only 1)")
    if body.logprobs not in (None, False, 0):
        raise InvalidRequest("logprobs", "logprobs are not supported")
    d = {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
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
             max_tokens: int | None, max_tokens_name: str, prompt_field: str):
    mapping = {"max_new_tokens": max_tokens_name}
    try:
        sp = _sampling_dict(body, max_tokens)
        return state.prepare(prompt_ids, sp, prompt_field=prompt_field,
                             max_tokens_field=max_tokens_name)
    except InvalidRequest as e:
        raise _rename_field(e, mapping) from None


def _bootstrap(body: _OpenAICommon, i: int) -> dict[str, Any]:
    out = {}
    for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        v = getattr(body, k)
        out[k] = v[i] if isinstance(v, list) else v
    return out


def _usage(handles: list[Handle]) -> dict[str, int]:
    p = sum(len(h.req.prompt_ids) for h in handles)
    c = sum(len(h.output_ids) for h in handles)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _first_error(handles: list[Handle]) -> JSONResponse | None:
    for h in handles:
        err = abort_error(h.final)
        if err is not None:
            return error_response(err[0], f"request {h.rid}: {err[1]}")
    return None


def install_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        state.require_engine()
        if body.echo:
            raise InvalidRequest("echo", "echo is not supported")
        p = body.prompt
        if isinstance(p, str):
            prompts = [state.encode_text(p, "prompt")]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            prompts = [state.encode_text(x, f"prompt[{i}]") for i, x in enumerate(p)]
        elif isinstance(p, list) and p and isinstance(p[0], list):
            prompts = [state.check_ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
        else:
            prompts = [state.check_ids(p, "prompt")]
        prepared = [_prepare(state, ids, body, body.max_tokens, "max_tokens",
                             "prompt" if len(prompts) == 1 else f"prompt[{i}]")
                    for i, ids in enumerate(prompts)]
        base = body.rid or f"cmpl-{new_rid()}"
        handles = [state.submit(pr, rid=base if len(prepared) == 1 else f"{base}_{i}",
                                **_bootstrap(body, i)) for i, pr in enumerate(prepared)]
        views = [TextView(state.tokenizer, h) for h in handles]
        model = body.model or state.served_model_name
        created = int(time.time())
        if body.stream:
            return StreamingResponse(_completion_stream(base, model, created, handles, views,
                                                        body), media_type="text/event-stream")
        try:
            await collect(handles, request)
        except ClientDisconnected:
            return error_response(499, "client disconnected")
        if (err := _first_error(handles)) is not None:
            return err
        choices = [{"index": i, "text": v.visible(h.output_ids, h.final), "logprobs": None,
                    "finish_reason": openai_finish_reason(h.final)}
                   for i, (h, v) in enumerate(zip(handles, views, strict=True))]
        return {"id": base, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(handles)}

    async def _completion_stream(cid, model, created, handles, views, body):
        async for i, out in merged_outputs(handles):
            h = handles[i]
            err = abort_error(out) if out.finished else None
            if err is not None:
                yield sse({"error": {"message": f"request {h.rid}: {err[1]}", "code": err[0]}})
                continue
            ids = h.output_ids[:out.num_output_tokens]
            delta = views[i].delta(ids, out if out.finished else None)
            if not delta and not out.finished:
                continue
            yield sse({"id": cid, "object": "text_completion", "created": created,
                       "model": model, "choices": [{
                           "index": i, "text": delta, "logprobs": None,
                           "finish_reason": openai_finish_reason(out) if out.finished else None}]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created,
                       "model": model, "choices": [], "usage": _usage(handles)})
        yield SSE_DONE

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        state.require_engine()
        tok = state.tokenizer
        messages = [m.model_dump() for m in body.messages]
        try:
            text = tok.apply_chat_template(messages)
        except ValueError as e:
            raise InvalidRequest("messages", str(e)) from None
        has_bos = bool(getattr(tok, "bos_token", "")) and text.startswith(tok.bos_token)
        ids = state.encode_text(text, "messages", add_special_tokens=not has_bos)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        prepared = _prepare(state, ids, body, max_tokens, name, "messages")
        cid = body.rid or f"chatcmpl-{new_rid()}"
        h = state.submit(prepared, rid=cid, **_bootstrap(body, 0))
        view = TextView(tok, h)
        model = body.model or state.served_model_name
        created = int(time.time())
        if body.stream:
            return StreamingResponse(_chat_stream(cid, model, created, h, view, body),
                                     media_type="text/event-stream")
        try:
            await collect([h], request)
        except ClientDisconnected:
            return error_response(499, "client disconnected")
        if (err := _first_error([h])) is not None:
            return err
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": view.visible(h.output_ids, h.final)},
                             "logprobs": None, "finish_reason": openai_finish_reason(h.final)}],
                "usage": _usage([h])}

    async def _chat_stream(cid, model, created, h, view, body):
        def chunk(delta, finish=None):
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [{"index": 0, "delta": delta,
                                                     "logprobs": None, "finish_reason": finish}]})

        yield chunk({"role": "assistant", "content": ""})
        async for _, out in merged_outputs([h]):
            err = abort_error(out) if out.finished else None
            if err is not None:
                yield sse({"error": {"message": f"request {h.rid}: {err[1]}", "code": err[0]}})
                continue
            ids = h.output_ids[:out.num_output_tokens]
            delta = view.delta(ids, out if out.finished else None)
            if delta:
                yield chunk({"content": delta})
            if out.finished:
                yield chunk({}, openai_finish_reason(out))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [], "usage": _usage([h])})
        yield SSE_DONE
