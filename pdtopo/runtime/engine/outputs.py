"""Tokens out of the scheduler: what a sampled token does to its request, and how a request
ends (`OutputMixin`, mixed into the `Scheduler` like overlap.py).

Data flow, on the scheduler thread, per request and sampled token (`run_batch`, overlap's
`land`, D's first token from P):

    process_new_token(req, token, logprob)       one token (a prompt's first: on_prefill_finished)
    land_decode_rows(batch, result)              a landed step's decode rows, the clock read and
                                                 the token metrics counted once per step
      each: take_token(req, token, ...)
        -> appended to `req.output_ids` (and its logprob when the request asked for them),
           its first-token / inter-token times observed
        -> check_stop(req): max_new_tokens or the context length, EOS (unless ignore_eos), a
           stop token id, a stop string in the last `stop_window` tokens' text
        -> a stop: finish_request(req, reason) (freed, the final output); else emit(req)
    emit(req)      -> the tokens not yet sent, as one `ReqOutput`, into the request's sink;
                      in the scheduler's loop into `outbox` first, handed to the sinks by
                      `flush_outputs` before the loop waits for the device or idles (the HTTP
                      side then streams while the device works: overlap.py's read_step)
    finish_request(req, reason)
                   -> the reason set, `free_request` (out of the queues, its sampler slot
                      released, its pages to the pool: kv_pages.py), FINISHED, dropped from
                      `reqs`, the final output emitted

P/D mixins override `finish_request` (to settle or abort the request's KV transfer first) and
call `process_new_token` for a first token that comes from elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdtopo.runtime.engine.request import FinishReason, Req, ReqOutput, ReqStatus, TokenLogprob
from pdtopo.runtime.engine.sampling import SampleResult


def stop_window(stops: list[str]) -> int:
    """How many trailing output tokens to decode to find any of `stops` ending in the newest
    token: a string of L characters spans at most 4L tokens (a byte-level token may carry one
    UTF-8 byte), plus a few so that the match never starts at the window's first token (where
    a decoder may drop a leading space). Earlier matches would have stopped earlier steps."""
    return 4 * max(len(s) for s in stops) + 4


class OutputMixin:
    """Token landing, stop checks and outputs; the Scheduler provides the rest (`metrics`,
    `tokenizer`, `eos_ids`, `free_request`, ...)."""

    # the scheduler's loop holds outputs here between a landing and its next wait (the device's
    # step, or idle): `flush_outputs`. None (a scheduler driven step by step, tests): emitted
    # at once
    outbox: list[tuple[Any, ReqOutput]] | None = None

    @staticmethod
    def token_logprob(result: SampleResult, i: int, req: Req) -> TokenLogprob | None:
        """Row i's logprob for `req`, if it asked for logprobs."""
        n = req.sampling.logprobs
        if n < 0 or result.logprobs is None:
            return None
        logprob, top = result.token_logprob(i, n)
        return TokenLogprob(logprob, tuple(top))

    def process_new_token(self, req: Req, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Append a sampled token (and its logprob, when the request asked for them), emit it,
        finish the request if a stop condition holds; True when it finished."""
        gaps: list[float] = []
        done = self.take_token(req, int(token), logprob, time.monotonic(), gaps)
        self.count_tokens(1, gaps)
        return done

    def land_decode_rows(self, batch: Any, result: SampleResult) -> None:
        """A landed step's decode rows (the first `batch.num_decode`; requests that finished
        meanwhile skipped): each computed its chunk and takes its token as in
        `process_new_token`, with the clock read and the token metrics counted once."""
        if not batch.num_decode:
            return
        tokens = np.asarray(result.tokens).tolist()
        now = time.monotonic()
        gaps: list[float] = []
        n = 0
        for i in range(batch.num_decode):
            req = batch.reqs[i]
            if req.finished:
                continue
            req.num_computed += len(batch.chunks[i].token_ids)
            self.take_token(req, tokens[i], self.token_logprob(result, i, req), now, gaps)
            n += 1
        self.count_tokens(n, gaps)

    def take_token(self, req: Req, token: int, logprob: TokenLogprob | None, now: float,
                   gaps: list[float]) -> bool:
        """One token into its request (its inter-token gap appended to `gaps`): emitted, or
        the request finished; True when it finished."""
        req.output_ids.append(token)
        if req.sampling.logprobs >= 0:
            req.output_logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            gaps.append(now - req.last_token_time)
        req.last_token_time = now
        reason = self.check_stop(req)
        if reason is not None:
            self.finish_request(req, reason)
            return True
        self.emit(req)
        return False

    def count_tokens(self, n: int, gaps: Sequence[float]) -> None:
        """Generated-token totals and the inter-token latencies of a batch of tokens."""
        self.num_generated += n
        self.metrics.generation_tokens.inc(n)
        if gaps:
            self.metrics.itl.observe_many(gaps)
            self.metrics.tpot.observe_many(gaps)

    def check_stop(self, req: Req) -> dict[str, Any] | None:
        sp = req.sampling
        tok = req.output_ids[-1]
        if len(req.output_ids) >= sp.max_new_tokens or req.seq_len >= self.max_model_len:
            return FinishReason.length(len(req.output_ids))
        if not sp.ignore_eos and tok in self.eos_ids:
            return FinishReason.stop_token(tok)
        if tok in sp.stop_token_ids:
            return FinishReason.stop_token(tok)
        if sp.stop:
            text = self.tokenizer.decode(req.output_ids[-stop_window(sp.stop):])
            for s in sp.stop:
                if s in text:
                    return FinishReason.stop_str(s)
        return None

    def flush_outputs(self) -> None:
        """The held outputs into their sinks, in the order they were emitted (the event loop
        is woken once for them all: request.py's `_LoopDelivery`)."""
        box = self.outbox
        if box:
            self.outbox = []
            for sink, out in box:
                sink.emit(out)

    def emit(self, req: Req) -> None:
        new = req.output_ids[req.num_emitted:]
        if not new and not req.finished:
            return
        logprobs = (req.output_logprobs[req.num_emitted:len(req.output_ids)]
                    if req.sampling.logprobs >= 0 else None)
        req.num_emitted = len(req.output_ids)
        out = ReqOutput(
            rid=req.rid, new_token_ids=list(new), num_output_tokens=len(req.output_ids),
            prompt_tokens=len(req.prompt_ids), finished=req.finished,
            finish_reason=req.finish_reason, cached_tokens=req.cached_tokens,
            timeline=req.timeline, new_logprobs=logprobs)
        if self.outbox is None:
            req.sink.emit(out)
        else:
            self.outbox.append((req.sink, out))

    def finish_request(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        self.free_request(req)
        req.status = ReqStatus.FINISHED
        if self.reqs.get(req.rid) is req:  # never another request that reuses the rid
            del self.reqs[req.rid]
        self.emit(req)
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)
        self.metrics.request_finished(reason.get("type", "unknown"))

    def free_request(self, req: Req) -> None:
        """Drop a request from the queues and return its pages to the pool."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.sampler.release(req.serial)
        self.release_kv(req, keep=self.keeps_kv(req))
