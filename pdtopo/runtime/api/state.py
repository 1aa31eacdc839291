"""What the HTTP layer knows about its engine, and how it turns client input into `Req`s.

`ServerState` is created before the engine exists (so `/health` can answer 503 while the model
loads and compiles); the loader sets `tokenizer`, `scheduler` and `ready`. `prepare()` validates
one prompt + sampling dict (raising `InvalidRequest` naming the field) and `submit()` hands the
request to the scheduler with an `AsyncSink`, returning a `Handle` the route awaits.
`off_loop(fn, ...)` runs the slow part of turning a body into prompts (tokenizing, a chat
template) on a small pool of threads, so the event loop keeps serving other requests' streams
and /health while a long prompt is encoded (the `tokenizers` library releases the GIL).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdtopo.config.settings import EngineSettings
from pdtopo.model_config.architectures import ARCH_TRAITS
from pdtopo.runtime.api.load_progress import LoadProgress
from pdtopo.runtime.api.movable import note_handle
from pdtopo.runtime.api.resume_context import RESUMING
from pdtopo.runtime.engine.metrics import EngineMetrics
from pdtopo.runtime.engine.request import (
    AsyncSink,
    InvalidRequest,
    Req,
    ReqOutput,
    SamplingParams,
    TokenLogprob,
    new_rid,
)

DISAGG_MODE = {"colocated": "null", "prefill": "prefill", "decode": "decode"}
# prompts tokenized at once off the event loop (more wait in the pool's queue); bodies are
# bounded by server.max_body_bytes
TOKENIZE_THREADS = 4


class EngineUnavailable(RuntimeError):
    """The engine is still loading (or failed): HTTP 503."""


@dataclass
class Prepared:
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass
class Handle:
    """One submitted request as the HTTP side sees it."""

    req: Req
    sink: AsyncSink
    state: ServerState
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # if asked for
    final: ReqOutput | None = None
    started: float = field(default_factory=time.perf_counter)
    detached: bool = False             # moved with its connection to another D: never abort
    last_out: ReqOutput | None = None  # the output the response's events are built from now
    abort_by_rid: bool = False         # a resumed request: the scheduler holds another Req

    @property
    def rid(self) -> str:
        return self.req.rid

    async def next(self, timeout: float | None = None) -> ReqOutput:
        if timeout is None:
            out = await self.sink.get()
        else:
            out = await asyncio.wait_for(self.sink.get(), timeout)
        return self._took(out)

    def next_nowait(self) -> ReqOutput | None:
        """The next output if one is queued, else None."""
        out = self.sink.get_nowait()
        return None if out is None else self._took(out)

    def _took(self, out: ReqOutput) -> ReqOutput:
        self.output_ids.extend(out.new_token_ids)
        self.output_logprobs.extend(out.new_logprobs or ())
        if out.finished:
            self.final = out
        return out

    def abort(self) -> None:
        if self.final is None and not self.detached and self.state.scheduler is not None:
            # this request only: a refused duplicate must not abort the live one with its rid
            self.state.scheduler.abort(self.rid, None if self.abort_by_rid else self.req)


class ServerState:
    def __init__(self, ctx):
        self.ctx = ctx
        cfg = ctx.cfg
        self.served_model_name = ctx.settings.engine.served_model_name or str(cfg.model.name)
        self.metrics = EngineMetrics(self.served_model_name, ctx.role)
        self.tokenizer = None
        self.scheduler = None
        self.runner = None
        self.ready = False
        self.load_progress = LoadProgress()  # what the loader is doing (/health's 503 says)
        # both owned by the server's event loop: set by POST /pdtopo/drain, and the number of
        # inference requests (/generate, /v1/...) whose response has not been fully sent
        self.draining = False
        self.http_in_flight = 0
        # a migrating D (movable.py, resume.py): responses that may move, keyed by request id,
        # and the ones this server will answer for another D once their connection arrives
        self.movable: dict[str, Any] = {}
        self.resuming: dict[str, Any] = {}
        self.load_error: str | None = None
        self.created = int(time.time())
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    # ------------------------------------------------------------------ info
    @property
    def engine(self) -> EngineSettings:
        return self.ctx.settings.engine

    def local_model_dir(self) -> str | None:
        path = self.ctx.cfg.model.get("path")
        return str(path) if path and Path(str(path)).is_dir() else None

    @property
    def tp_size(self) -> int:
        return int(self.ctx.process.get("mesh", {}).get("tp", 1))

    def model_info(self) -> dict[str, Any]:
        loaded = getattr(self.runner, "config", None)  # the checkpoint's, once loaded
        arch = loaded.architecture if loaded else str(self.ctx.cfg.model.get("architecture")
                                                      or "llama")
        return {
            "model_path": self.local_model_dir(),
            "tokenizer_path": self.local_model_dir(),
            "is_generation": True,
            "served_model_name": self.served_model_name,
            "dp_size": int(self.ctx.rank.get("dp_size", 1)),
            "tp_size": self.tp_size,
            "disaggregation_mode": DISAGG_MODE.get(self.ctx.role, self.ctx.role),
            "model_type": arch,
            "architectures": [ARCH_TRAITS[arch].hf_class if arch in ARCH_TRAITS else arch],
        }

    def require_engine(self):
        if self.load_error:
            raise EngineUnavailable(f"engine failed to load: {self.load_error}")
        if not self.ready or self.scheduler is None:
            raise EngineUnavailable("engine is loading")
        if not self.scheduler.alive:
            raise EngineUnavailable("engine scheduler has stopped")
        return self.scheduler

    # ------------------------------------------------------------------ requests
    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the tokenize pool, awaited (its exception, e.g. InvalidRequest, is
        raised here): for work that takes long on a big body, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, functools.partial(fn, *args))

    def encode_text(self, text: Any, field_name: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(field_name, f"{field_name} must be a string")
        if not text:
            raise InvalidRequest(field_name, f"{field_name} is empty")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_ids(self, ids: Any, field_name: str) -> list[int]:
        vocab = int(self.tokenizer.vocab_size)
        if not isinstance(ids, list) or not ids:
            raise InvalidRequest(field_name, f"{field_name} must be a non-empty list of token ids")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequest(field_name, f"{field_name} has token id {t!r} outside the "
                                     f"vocabulary [0, {vocab})")
        return list(ids)

    def prepare(self, prompt_ids: list[int], sampling: dict[str, Any] | None, *,
                prompt_field: str, sampling_prefix: str = "sampling_params",
                max_tokens_field: str | None = None) -> Prepared:
        """Validate a tokenized prompt and its sampling values (InvalidRequest on error)."""
        sched = self.require_engine()
        eng = self.engine
        if sampling is not None and not isinstance(sampling, dict):
            raise InvalidRequest(sampling_prefix, f"{sampling_prefix} must be an object")
        sp = SamplingParams.from_dict(
            sampling, default_max_new_tokens=eng.max_new_tokens_default,
            max_new_tokens_limit=eng.max_new_tokens_limit,
            vocab_size=int(self.tokenizer.vocab_size), prefix=sampling_prefix)
        max_len = eng.max_model_len
        n = len(prompt_ids)
        if n >= max_len:
            raise InvalidRequest(prompt_field, f"{prompt_field} has {n} tokens; the context length "
                                 f"engine.max_model_len={max_len} leaves no room to generate")
        if not sp.max_new_tokens_given:
            sp.max_new_tokens = max(1, min(sp.max_new_tokens, max_len - n))
        err = sched.check_fits(n, sp.max_new_tokens)
        if err is not None:
            name = max_tokens_field or f"{sampling_prefix}.max_new_tokens"
            raise InvalidRequest(name if sp.max_new_tokens_given else prompt_field, err)
        return Prepared(prompt_ids, sp)

    def submit(self, prep: Prepared, *, rid: str | None = None, bootstrap_host=None,
               bootstrap_port=None, bootstrap_room=None, health_check: bool = False,
               leader: Handle | None = None, followers: int = 0) -> Handle:
        """`health_check`: a local probe that P and D run without a PD peer. n > 1 (`fanout`):
        the first completion of a prompt is submitted with its number of `followers`, the
        others with that one as their `leader`."""
        sched = self.require_engine()
        sink = AsyncSink()
        req = Req(rid=rid or new_rid(), prompt_ids=prep.prompt_ids, sampling=prep.sampling,
                  sink=sink, bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port,
                  bootstrap_room=bootstrap_room, num_followers=followers,
                  leader=leader.req if leader is not None else None)
        ticket = RESUMING.get()
        if ticket is not None:  # answering a moved request: it runs here already
            if ticket.handle is None:
                ticket.handle = Handle(req=ticket.req, sink=ticket.sink, state=self,
                                       abort_by_rid=True)
                ticket.handle.started -= float(ticket.response.get("elapsed_s", 0.0))
            return ticket.handle
        if health_check:
            req.extra["health_check"] = True
        sched.submit(req)
        h = Handle(req=req, sink=sink, state=self)
        note_handle(self, h)
        return h
