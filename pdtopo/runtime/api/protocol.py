"""Request bodies of the HTTP API (pydantic), as sglang and the OpenAI API define them.

These models only check shapes and types; value checks (ranges, context length, unknown
sampling keys) happen when a body is turned into engine requests (`SamplingParams.from_dict`,
`Scheduler.check_fits`). The exception: the PD routing fields (`bootstrap_host`, `_port`,
`_room`), checked here in full (strict types, ranges, a valid host), since D dials them
(docs/protocol.md#bootstrap-fields). Unknown top-level fields are ignored (the sglang router may add some);
unknown sampling parameters are rejected there.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
)

from pdtopo.runtime.engine.request import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    bootstrap_host_problem,
    bootstrap_port_problem,
    bootstrap_room_problem,
)

Scalar = str | int | None


def _checked(problem, name: str) -> AfterValidator:
    """A pydantic check of one PD routing field with the engine's rule (a 400 naming it)."""
    def check(value):
        why = problem(value)
        if why is not None:
            raise ValueError(f"{name} {why}")
        return value
    return AfterValidator(check)


# strict: a bool, a float or a numeric string is a wrong type here, not a port or a room
_Host = Annotated[StrictStr, _checked(bootstrap_host_problem, "bootstrap_host")]
_Port = Annotated[StrictInt, _checked(bootstrap_port_problem, "bootstrap_port")]
_Room = Annotated[StrictInt, _checked(bootstrap_room_problem, "bootstrap_room")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Body):
    """`POST /generate` (sglang native)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None   # see check_logprob_fields
    top_logprobs_num: int | list[int] | None = None
    logprob_start_len: int | list[int] | None = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    bootstrap_host: _Host | list[_Host | None] | None = None
    bootstrap_port: _Port | list[_Port | None] | None = None
    bootstrap_room: _Room | list[_Room | None] | None = None


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
    user: str | None = None
    rid: str | None = None
    bootstrap_host: _Host | list[_Host | None] | None = None
    bootstrap_port: _Port | list[_Port | None] | None = None
    bootstrap_room: _Room | list[_Room | None] | None = None


class CompletionRequest(_OpenAICommon):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: StrictInt | None = None       # the top alternatives per token (0: none)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def check_top_logprobs(value: Any, name: str) -> None:
    if any(v is not None and not 0 <= v <= MAX_TOP_LOGPROBS for v in _items(value)):
        raise InvalidRequest(name, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value!r}")


def check_logprob_fields(body: GenerateRequest) -> None:
    """/generate's logprob fields, checked before the prompt is tokenized (a long one takes
    seconds): output logprobs are computed; prompt logprobs (`logprob_start_len` >= 0) and
    logprobs of chosen ids (`token_ids_logprob`) are not, and asking for them is a 400."""
    check_top_logprobs(body.top_logprobs_num, "top_logprobs_num")
    if any(v not in (None, -1) for v in _items(body.logprob_start_len)):
        raise InvalidRequest("logprob_start_len", f"logprob_start_len="
                             f"{body.logprob_start_len!r} asks for prompt logprobs, which "
                             "pdtopo does not compute (only -1: output tokens)")
    if any(v is not None for v in _items(body.token_ids_logprob)):
        raise InvalidRequest("token_ids_logprob", "token_ids_logprob is not supported")


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
    sampling = data.get("sampling_params")
    n = data.get("n", sampling.get("n") if isinstance(sampling, dict) else None)
    request.state.completions = n if isinstance(n, int) and 1 <= n <= MAX_N else 1
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
