"""Step forming: the rows of one engine step, as the scheduler hands them to the runner.

The scheduler decides which requests get rows (scheduler.py: admission by pages and budget,
preemption); this module says what those rows are. A `ScheduledBatch` lists requests and one
`SeqChunk` (model_runner.py) each: `num_decode` decode rows first (one token each, a running
request's newest token), then prompt chunks (`prompt_piece`: the next tokens of a waiting
request's prompt that fit the step's token budget, and whether they finish it). A mixed step
is a decode batch followed by a prefill batch (`ScheduledBatch.mixed`). Each row's sampling
settings come from its request (`sampler_row`; a chunk that does not end its prompt samples a
token nobody reads: `DROPPED_ROW`). `land_batch` walks the rows in this order when the step's
tokens come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdtopo.runtime.engine.penalties import PenaltyHistory
from pdtopo.runtime.engine.request import Req
from pdtopo.runtime.engine.sampling import GREEDY_ROW, RowParams


@dataclass
class ScheduledBatch:
    """One step's rows: `num_decode` decode rows (one token each) first, then prompt chunks."""

    kind: str                                  # "prefill" | "decode" | "mixed"
    reqs: list[Req]
    chunks: list[Any]
    completes: list[bool] = field(default_factory=list)  # per prompt chunk: the prompt's last?
    num_decode: int = 0

    @staticmethod
    def mixed(decode: ScheduledBatch, prefill: ScheduledBatch) -> ScheduledBatch:
        return ScheduledBatch("mixed", decode.reqs + prefill.reqs,
                              decode.chunks + prefill.chunks, prefill.completes,
                              num_decode=len(decode.reqs))

    def add_prompt(self, req: Req, chunk: Any, complete: bool) -> None:
        """A prompt chunk of `req` (`complete`: it ends the prompt)."""
        self.reqs.append(req)
        self.chunks.append(chunk)
        self.completes.append(complete)


def prompt_piece(req: Req, budget: int) -> tuple[list[int], bool]:
    """The next tokens `req` has to compute (from `num_computed` on, at most `budget` of them:
    its prompt, or after a preemption its prompt and outputs), and whether they are the last."""
    remaining = req.seq_len - req.num_computed
    n = min(remaining, budget)
    return req.all_ids[req.num_computed:req.num_computed + n], n == remaining


def decode_piece(req: Req) -> list[int]:
    """A running request's tokens not computed yet (its newest token)."""
    past_prompt = req.num_computed - len(req.prompt_ids)
    if past_prompt >= 0:  # the usual case: no copy of the whole sequence
        return req.output_ids[past_prompt:]
    return req.all_ids[req.num_computed:]


# the row of a prompt chunk that does not end its prompt: its token is dropped (batch_rows)
DROPPED_ROW = GREEDY_ROW


def sampler_row(req: Req, ahead: int = 0) -> RowParams:
    """The sampler's settings for `req`'s next token; `ahead`: tokens sampled, not landed yet."""
    sp = req.sampling
    if sp.logprobs < 0 and sp.is_greedy and not sp.penalised:
        return GREEDY_ROW  # its token is the argmax whatever else it set: no row of its own
    return RowParams(sp.temperature, sp.top_k, sp.top_p, int(sp.seed or 0),
                     len(req.output_ids) + ahead, min_p=sp.min_p,
                     presence_penalty=sp.presence_penalty,
                     frequency_penalty=sp.frequency_penalty,
                     repetition_penalty=sp.repetition_penalty, logprobs=sp.logprobs,
                     history=(PenaltyHistory(req.serial, req.prompt_ids, req.output_ids)
                              if sp.penalised else None))
