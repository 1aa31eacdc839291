"""Requests as the engine sees them: sampling parameters, the `Req` record, finish reasons, sinks.

Data flow: the HTTP layer validates a client's sampling values with `SamplingParams.from_dict`
(every bad value raises `InvalidRequest` naming the field), tokenizes the prompt and builds a
`Req` with an output sink. The scheduler thread owns the `Req` from then on: it appends output
tokens and, after every step, emits a `ReqOutput` (the new tokens, and the finish reason once the
request is done) into the request's sink. `AsyncSink` hands outputs to an asyncio consumer
(`loop.call_soon_threadsafe` + `asyncio.Queue`); `QueueSink` to a plain thread (tests, tools).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import itertools
import math
import queue
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

UINT64_MAX = 2**64 - 1
MAX_TOP_LOGPROBS = 20     # alternatives per token a request may ask for (OpenAI's limit)
MAX_N = 128               # completions one request may ask for (`n`)


class InvalidRequest(ValueError):
    """A client error (HTTP 400). `field` names the offending request field."""

    def __init__(self, field_name: str | None, message: str):
        super().__init__(message)
        self.field = field_name
        self.message = message


# The PD routing fields a client (or the PD router) supplies. D dials `bootstrap_host:
# bootstrap_port`, so they are checked before anything is opened (docs/protocol.md#bootstrap-fields).
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


def bootstrap_host_problem(host: Any) -> str | None:
    """Why `host` is not an IPv4 address or a DNS host name (RFC 1123); None when it is one."""
    if not isinstance(host, str):
        return f"must be a string, got {type(host).__name__}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        return None if ip.version == 4 else "must be an IPv4 address or a host name (P's side " \
            "channel listens on IPv4)"
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not 0 < len(host) <= 253 or not all(_HOST_LABEL.match(x) for x in labels):
        return "must be an IPv4 address or a host name (letters, digits, '-' and '.', " \
            "labels of 1-63 characters)"
    if labels[-1].isdigit():
        return "is not a valid IPv4 address"
    return None


def bootstrap_port_problem(port: Any) -> str | None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return "must be an integer in [1, 65535]"
    return None


def bootstrap_room_problem(room: Any) -> str | None:
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= UINT64_MAX:
        return "must be an integer in [0, 2**64)"
    return None


def check_bootstrap_fields(host: Any, port: Any, room: Any) -> None:
    """InvalidRequest (400) naming the first bad one of the fields given (None: not given)."""
    for name, value, problem in (("bootstrap_host", host, bootstrap_host_problem),
                                 ("bootstrap_port", port, bootstrap_port_problem),
                                 ("bootstrap_room", room, bootstrap_room_problem)):
        why = problem(value) if value is not None else None
        if why is not None:
            raise InvalidRequest(name, f"{name} {why}, got {value!r}"[:300])


# sglang sampling keys pdtopo accepts only at their neutral value (the Rust router may forward them).
_NEUTRAL_SGLANG_KEYS: dict[str, Any] = {
    "min_new_tokens": 0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "lora_path": None,
}
# sglang's ranges for the penalties and min_p (repetition_penalty 0 is refused: it divides)
_PENALTY_RANGES: dict[str, tuple[float, float]] = {
    "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 2.0), "min_p": (0.0, 1.0)}
# sglang keys that only affect detokenization or streaming and are accepted as given.
_PASSTHROUGH_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                     "stream_interval"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stop settings (validated; see `from_dict`)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                     # -1 (or 0): disabled
    seed: int | None = None             # None: the scheduler derives one
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    max_new_tokens_given: bool = False  # False: defaulted (may be clamped to the context)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # not sglang sampling keys: set by the routes from return_logprob / logprobs fields
    logprobs: int = -1                  # -1: none; 0: the sampled token's; k: plus the top k
    n: int = 1                          # completions of the prompt (the routes fan them out)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, *, default_max_new_tokens: int,
                  max_new_tokens_limit: int, vocab_size: int | None = None,
                  prefix: str = "sampling_params") -> SamplingParams:
        """Validate sglang-style sampling values. Raises InvalidRequest naming the field."""
        if d is not None and not isinstance(d, dict):
            raise InvalidRequest(prefix, f"{prefix} must be an object, got {type(d).__name__}")
        d = dict(d or {})
        p = cls(max_new_tokens=default_max_new_tokens)

        def name(k: str) -> str:
            return f"{prefix}.{k}"

        for key, value in d.items():
            if value is None:
                continue
            if key == "max_new_tokens":
                if not _is_int(value):
                    raise InvalidRequest(name(key), f"{name(key)} must be an integer, got {value!r}")
                if value <= 0:
                    raise InvalidRequest(name(key), f"{name(key)} must be > 0, got {value}")
                if value > max_new_tokens_limit:
                    raise InvalidRequest(
                        name(key), f"{name(key)}={value} exceeds engine.max_new_tokens_limit="
                        f"{max_new_tokens_limit}")
                p.max_new_tokens, p.max_new_tokens_given = value, True
            elif key == "temperature":
                if not _is_number(value) or not math.isfinite(value) or value < 0:
                    raise InvalidRequest(name(key), f"{name(key)} must be a number >= 0, got {value!r}")
                p.temperature = float(value)
            elif key == "top_p":
                if not _is_number(value) or not (0.0 < value <= 1.0):
                    raise InvalidRequest(name(key), f"{name(key)} must be in (0, 1], got {value!r}")
                p.top_p = float(value)
            elif key == "top_k":
                if not _is_int(value) or value < -1:
                    raise InvalidRequest(
                        name(key), f"{name(key)} must be an integer >= 1 (or -1/0 to disable), "
                        f"got {value!r}")
                p.top_k = -1 if value == 0 else value
            elif key in ("seed", "sampling_seed"):
                if not _is_int(value) or not (0 <= value <= UINT64_MAX):
                    raise InvalidRequest(name(key), f"{name(key)} must be an integer in [0, 2^64), "
                                         f"got {value!r}")
                p.seed = value
            elif key == "n":
                if not _is_int(value) or not 1 <= value <= MAX_N:
                    raise InvalidRequest(name(key), f"{name(key)} must be an integer in "
                                         f"[1, {MAX_N}], got {value!r}")
                p.n = value
            elif key in _PENALTY_RANGES:
                low, high = _PENALTY_RANGES[key]
                if not _is_number(value) or not math.isfinite(value) or \
                        not low <= value <= high or (key == "repetition_penalty" and value == 0):
                    what = "in (0, 2]" if key == "repetition_penalty" else f"in [{low:g}, {high:g}]"
                    raise InvalidRequest(name(key), f"{name(key)} must be a number {what}, "
                                         f"got {value!r}")
                setattr(p, key, float(value))
            elif key == "stop":
                stops = [value] if isinstance(value, str) else value
                if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                    raise InvalidRequest(name(key), f"{name(key)} must be a non-empty string or a "
                                         f"list of non-empty strings, got {value!r}")
                p.stop = list(stops)
            elif key == "stop_token_ids":
                if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
                    raise InvalidRequest(name(key), f"{name(key)} must be a list of token ids, "
                                         f"got {value!r}")
                if vocab_size is not None and any(t >= vocab_size for t in value):
                    raise InvalidRequest(name(key), f"{name(key)} has ids outside the vocabulary "
                                         f"(size {vocab_size}): {value!r}")
                p.stop_token_ids = list(value)
            elif key == "ignore_eos":
                if not isinstance(value, bool):
                    raise InvalidRequest(name(key), f"{name(key)} must be a boolean, got {value!r}")
                p.ignore_eos = value
            elif key in _PASSTHROUGH_KEYS:
                if key in ("skip_special_tokens", "no_stop_trim"):
                    if not isinstance(value, bool):
                        raise InvalidRequest(name(key), f"{name(key)} must be a boolean, got {value!r}")
                    setattr(p, key, value)
            elif key in _NEUTRAL_SGLANG_KEYS:
                neutral = _NEUTRAL_SGLANG_KEYS[key]
                if value != neutral and not (value == {} or value == []):
                    raise InvalidRequest(name(key), f"{name(key)}={value!r} is not supported by "
                                         f"pdtopo (only {neutral!r})")
            else:
                raise InvalidRequest(name(key), f"unknown sampling parameter {name(key)!r}")
        return p


class FinishReason:
    """sglang-style finish reasons (`to_json()` goes into meta_info.finish_reason)."""

    @staticmethod
    def length(n: int) -> dict[str, Any]:
        return {"type": "length", "length": n}

    @staticmethod
    def stop_token(token_id: int) -> dict[str, Any]:
        return {"type": "stop", "matched": token_id}

    @staticmethod
    def stop_str(s: str) -> dict[str, Any]:
        return {"type": "stop", "matched": s}

    @staticmethod
    def abort(message: str, status_code: int = 500) -> dict[str, Any]:
        return {"type": "abort", "message": message, "status_code": status_code}

    @staticmethod
    def duplicate(rid: str) -> dict[str, Any]:
        """A request refused because another with its rid is live (that one is left alone)."""
        return FinishReason.abort(f"duplicate request id rid={rid!r}: a request with this id "
                                  "is in flight on this server", 400)


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's logprob and the most likely alternatives asked for, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class ReqOutput:
    """What the scheduler emits for a request after a step (tokens since the previous output)."""

    rid: str
    new_token_ids: list[int]
    num_output_tokens: int
    prompt_tokens: int
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    timeline: dict[str, float] | None = None  # PD stages in ms (D: disagg/observability.py)
    # one per new token when the request asked for logprobs (None: a token without one)
    new_logprobs: list[TokenLogprob | None] | None = None


class OutputSink(Protocol):
    def emit(self, out: ReqOutput) -> None: ...


class _LoopDelivery:
    """Outputs on their way from the scheduler thread to one event loop's queues, delivered
    in bursts: the first output of a burst wakes the loop (`call_soon_threadsafe`: a write to
    the loop's self-pipe, the costly part), the others of the same step only join the list.
    Order is kept per queue (one FIFO list), and an output is on its queue before anything the
    emitting thread schedules on the loop afterwards runs (the wake-up was scheduled first)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # weak: the registry of deliveries keys on the loop
        self.pending: list[tuple[asyncio.Queue, ReqOutput]] = []
        self.lock = threading.Lock()

    def put(self, q: asyncio.Queue, out: ReqOutput) -> None:
        with self.lock:
            self.pending.append((q, out))
            if len(self.pending) > 1:
                return  # a wake-up is scheduled and has not run yet
        try:
            loop = self.loop()
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            with self.lock:
                self.pending.clear()

    def _deliver(self) -> None:
        with self.lock:
            batch, self.pending = self.pending, []
        for q, out in batch:
            q.put_nowait(out)


_DELIVERIES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopDelivery] = \
    weakref.WeakKeyDictionary()
_DELIVERIES_LOCK = threading.Lock()


def _delivery(loop: asyncio.AbstractEventLoop) -> _LoopDelivery:
    with _DELIVERIES_LOCK:
        d = _DELIVERIES.get(loop)
        if d is None:
            d = _DELIVERIES[loop] = _LoopDelivery(loop)
        return d


class AsyncSink:
    """Fed from the scheduler thread, consumed with `await sink.get()` on an asyncio loop (the
    outputs of one step reach the loop in one wake-up: `_LoopDelivery`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self._delivery = _delivery(self.loop)

    def emit(self, out: ReqOutput) -> None:
        self._delivery.put(self.queue, out)

    async def get(self) -> ReqOutput:
        return await self.queue.get()

    def get_nowait(self) -> ReqOutput | None:
        """The next output if one is on the queue, else None."""
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


class QueueSink:
    """A thread-safe sink for synchronous consumers."""

    def __init__(self) -> None:
        self.queue: queue.Queue[ReqOutput] = queue.Queue()

    def emit(self, out: ReqOutput) -> None:
        self.queue.put(out)

    def get(self, timeout: float | None = None) -> ReqOutput:
        return self.queue.get(timeout=timeout)

    def collect(self, timeout: float = 60.0) -> tuple[list[int], ReqOutput]:
        """Block until the request finishes; returns (all output ids, final output)."""
        ids: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            out = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            ids.extend(out.new_token_ids)
            if out.finished:
                return ids, out


class NullSink:
    def emit(self, out: ReqOutput) -> None:
        pass


_rid_counter = itertools.count()
_req_serials = itertools.count()


def new_rid() -> str:
    return f"{uuid.uuid4().hex[:16]}{next(_rid_counter):x}"


class ReqStatus(str, enum.Enum):
    """Where a request is in its scheduler (the value is what logs and states show)."""

    WAITING = "waiting"        # in the waiting queue (maybe partially prefilled)
    RUNNING = "running"        # in the decode batch
    HELD = "held"              # owned by a PD mixin (e.g. P waiting for D to pull its KV)
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Req:
    """One sequence. Owned by the scheduler thread once submitted.

    Tokens of the sequence are `prompt_ids + output_ids`; the first `num_computed` of them have
    their KV in `page_ids` (the request's page table, in order).
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    sink: OutputSink = field(default_factory=NullSink)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # if asked for
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: str = ReqStatus.WAITING
    finish_reason: dict[str, Any] | None = None
    # PD routing fields, carried untouched for the disaggregation mixins.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # Timing (time.monotonic()).
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_start_time: float | None = None  # its first prefill chunk was scheduled
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_emitted: int = 0          # output tokens already handed to the sink
    cached_tokens: int = 0        # prompt tokens whose KV came from a prefix cache (P's in PD)
    num_preemptions: int = 0
    timeline: dict[str, float] | None = None  # PD stages (ms), set by D when decoding starts
    extra: dict[str, Any] = field(default_factory=dict)  # free space for mixins
    # n > 1: the completions of one prompt. The first (`num_followers` > 0) offers its prompt's
    # pages to the prefix cache when its prefill ends; the others (`leader` set) wait for that
    leader: Req | None = None
    num_followers: int = 0
    serial: int = field(default_factory=lambda: next(_req_serials))  # unique in this process

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:  # short: requests appear in logs
        return (f"Req({self.rid}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
                f"computed={self.num_computed}, pages={len(self.page_ids)}, {self.status})")
