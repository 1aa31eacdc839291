"""Output logprobs in the shapes clients parse: sglang's triples and OpenAI's two formats.

Data flow: a handle collects one `TokenLogprob` per output token (`Handle.output_logprobs`,
None for a token that has none); the routes pass a slice of them with the matching token ids:

    sglang_logprobs(tok, ids, lps, top_n, with_text)
        -> meta_info's output_token_logprobs [[logprob, id, text|None], ...] and, when top_n,
           output_top_logprobs [[[logprob, id, text|None], ...] per token]
    completion_logprobs(tok, ids, lps, top_n, offset)
        -> /v1/completions' {tokens, token_logprobs, top_logprobs, text_offset}
    chat_logprobs(tok, ids, lps, top_n)
        -> /v1/chat/completions' {content: [{token, logprob, bytes, top_logprobs}]}

A token's text is its own decoding (a token holding part of a UTF-8 character decodes to
U+FFFD; OpenAI's `bytes` carry what the text cannot).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdtopo.runtime.engine.request import TokenLogprob


def _text(tok, token_id: int) -> str:
    return tok.decode([int(token_id)])


def _value(lp: TokenLogprob | None) -> float | None:
    return None if lp is None else lp.logprob


def _top(lp: TokenLogprob | None, top_n: int) -> tuple[tuple[int, float], ...]:
    return () if lp is None else lp.top[:top_n]


def sglang_logprobs(tok, ids: Sequence[int], lps: Sequence[TokenLogprob | None], top_n: int,
                    with_text: bool) -> dict[str, Any]:
    def triple(logprob: float | None, token_id: int) -> list[Any]:
        return [logprob, int(token_id), _text(tok, token_id) if with_text else None]

    out: dict[str, Any] = {
        "output_token_logprobs": [triple(_value(lp), t) for t, lp in zip(ids, lps, strict=True)]}
    if top_n > 0:
        out["output_top_logprobs"] = [[triple(v, t) for t, v in _top(lp, top_n)] for lp in lps]
    return out


def completion_logprobs(tok, ids: Sequence[int], lps: Sequence[TokenLogprob | None],
                        top_n: int, offset: int = 0) -> dict[str, Any]:
    """`offset`: the text_offset of the first token (the characters before it)."""
    tokens = [_text(tok, t) for t in ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top = [{_text(tok, t): v for t, v in _top(lp, top_n)} if lp is not None else None
           for lp in lps]
    return {"tokens": tokens, "token_logprobs": [_value(lp) for lp in lps],
            "top_logprobs": top if top_n > 0 else None, "text_offset": offsets}


def _chat_entry(tok, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = _text(tok, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok, ids: Sequence[int], lps: Sequence[TokenLogprob | None],
                  top_n: int) -> dict[str, Any]:
    return {"content": [
        {**_chat_entry(tok, t, _value(lp)),
         "top_logprobs": [_chat_entry(tok, a, v) for a, v in _top(lp, top_n)]}
        for t, lp in zip(ids, lps, strict=True)]}
