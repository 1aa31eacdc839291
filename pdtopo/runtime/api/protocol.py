"""Request bodies of the HTTP API (pydantic), as sglang and the OpenAI API define them.

These models only check shapes and types; value checks (ranges, context length, unknown
sampling keys) happen when a body is turned into engine requests (`SamplingParams.from_dict`,
`Scheduler.check_fits`). Unknown top-level fields are ignored (the sglang router may add some);
unknown sampling parameters are rejected there.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdtopo.runtime.engine.request import InvalidRequest

Scalar = str | int | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Body):
    """`POST /generate` (sglang native)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAICommon(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logprobs: Any = None
    user: str | None = None
    rid: str | None = None
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None


class CompletionRequest(_OpenAICommon):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


async def parse_body(request, model: type[BaseModel]):
    """Read a JSON body whatever its Content-Type; shape errors become InvalidRequest (400)."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(None, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(None, "the request body must be a JSON object")
    # the PD rooms of the request, for the error handler: a P that rejects a request tells D
    request.state.bootstrap_rooms = data.get("bootstrap_room")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        parts = []
        for err in errors[:4]:
            loc = _loc(err.get("loc", ())) or "body"
            got = err.get("input")
            show = err.get("type") != "missing" and not isinstance(got, dict)
            parts.append(f"{loc}: {err.get('msg')}" + (f" (got {got!r})" if show else ""))
        first = _loc(errors[0].get("loc", ())) if errors else None
        raise InvalidRequest(first or None, "; ".join(parts)) from None


def _loc(loc) -> str:
    """A field path without pydantic's union-branch tags (`text.str` -> `text`)."""
    keep = [str(p) for p in loc
            if isinstance(p, int) or not ("[" in str(p) or str(p) in _TYPE_TAGS)]
    return ".".join(keep)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "is-instance", "literal"}
