"""Side-channel message schema (ZMQ, JSON): encode, decode and validate.

Every message is one JSON object, UTF-8, at most `max_bytes` long, with a protocol version
``"v": 1``, a ``"type"`` and a ``"room"`` (the bootstrap_room, an integer in [0, 2**64)).

| type   | direction | fields                                                                 |
|--------|-----------|------------------------------------------------------------------------|
| want   | D -> P    | room; D says it waits for this room's KV (P learns D's identity);      |
|        |           | cached_pages, prefix_hash (optional: D holds the prompt's first       |
|        |           | cached_pages pages already; prefix_digest of their token ids),         |
|        |           | layout (optional: D's KV shard layout, a KVShardLayout dict)          |
| ready  | P -> D    | room, transfer_addr, transfer_uuid, expires_at (unix s), pools (list   |
|        |           | of PackedMeta dicts: shape, dtype, page_count, page_size, sharding,    |
|        |           | num_entries), first_token, first_logprob (optional), prompt_len,      |
|        |           | first_top_logprobs (optional: [[token id, logprob], ...], best first, |
|        |           | at most MAX_TOP_LOGPROBS: the first token's alternatives D reports),   |
|        |           | cached_tokens (optional: prompt tokens P took from its prefix cache),  |
|        |           | skip_pages (optional: leading prompt pages not sent: D holds them),    |
|        |           | p_stages (optional: {queue, prefill, send} seconds on P's clock),      |
|        |           | layout (optional: P's KV shard layout; absent = D's own),              |
|        |           | transfer_addrs (optional: every P process's transfer address, by      |
|        |           | process index, for a D that takes pieces from several)                 |
| done   | D -> P    | room, ok (bool), reason (optional)                                     |
| failed | both      | room, reason (str), status (optional HTTP status int)                  |

Migration (docs: issue 50) moves a running decode from D1 to D2 with the same four messages: D1
offers the request to D2 (`MigrationOffer`, below: not a side-channel message, since D1 cannot
open a conversation on D2's side channel; in one process it is handed over directly, between
servers it is the body of a call to D2), D2 sends `want` for the offer's room to D1's side
channel, D1 answers `ready` (its pages gathered like a prompt's, `prompt_len` = the tokens whose
KV they hold), D2 pulls and sends `done`, and D1 frees the pages.

`decode(raw, max_bytes)` returns a typed message or raises `MessageError` whose text says what
was wrong; callers log and drop such messages. Unknown fields are ignored (forward compatible);
missing or mistyped known fields are errors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdtopo.runtime.disagg.reshard.layout import KVShardLayout
from pdtopo.runtime.disagg.transport.base import PackedMeta
from pdtopo.runtime.engine.request import MAX_TOP_LOGPROBS, TokenLogprob

PROTOCOL_VERSION = 1
MAX_ROOM = 2**64 - 1
# P's stages a `ready` reports (seconds, P's clock): arrival -> first prefill chunk, first
# chunk -> prefill done, prefill done -> this ready sent (registration, and waiting for D's
# want when it comes after the prefill)
P_STAGES = ("queue", "prefill", "send")


class MessageError(ValueError):
    """A side-channel message that cannot be accepted (the text says why)."""


def prefix_digest(token_ids: Sequence[int], num_pages: int, page_size: int) -> str:
    """What P and D compare before P skips pages D says it holds: a hash of the token ids of
    the first `num_pages` full pages (and the page size), hex."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{int(page_size)}:{int(num_pages)}:".encode())
    h.update(",".join(str(int(t)) for t in token_ids[:num_pages * page_size]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Want:
    room: int
    cached_pages: int = 0
    prefix_hash: str | None = None
    layout: dict[str, Any] | None = None  # D's KV shard layout (reshard.layout.KVShardLayout)
    type: str = field(default="want", init=False)


@dataclass(frozen=True)
class Ready:
    room: int
    transfer_addr: str
    transfer_uuid: int
    expires_at: float
    pools: tuple[PackedMeta, ...]
    prompt_len: int
    first_token: int | None = None
    first_logprob: float | None = None
    first_top_logprobs: tuple[tuple[int, float], ...] | None = None
    cached_tokens: int = 0
    skip_pages: int = 0
    # P's stages of this request in seconds, each measured on P's clock (P_STAGES)
    p_stages: dict[str, float] = field(default_factory=dict)
    layout: dict[str, Any] | None = None  # P's KV shard layout; None: the same as D's
    transfer_addrs: list[str] | None = None  # P's processes (multi-process P), by index
    type: str = field(default="ready", init=False)

    @property
    def first_token_logprob(self) -> TokenLogprob | None:
        """The first token's logprob as D's request records it (None: P sent none)."""
        if self.first_logprob is None:
            return None
        return TokenLogprob(self.first_logprob, self.first_top_logprobs or ())


def first_logprob_fields(logprob: TokenLogprob | None) -> dict[str, Any]:
    """P's `ready` fields for the first token's logprob (none when it has none)."""
    if logprob is None:
        return {}
    return {"first_logprob": logprob.logprob,
            "first_top_logprobs": [[t, lp] for t, lp in logprob.top]}


@dataclass(frozen=True)
class Done:
    room: int
    ok: bool = True
    reason: str | None = None
    type: str = field(default="done", init=False)


@dataclass(frozen=True)
class Failed:
    room: int
    reason: str
    status: int | None = None
    type: str = field(default="failed", init=False)


Message = Want | Ready | Done | Failed
TYPES = {"want": Want, "ready": Ready, "done": Done, "failed": Failed}


def to_dict(msg: Message) -> dict[str, Any]:
    d = asdict(msg)
    if isinstance(msg, Ready):
        d["pools"] = [p.to_dict() for p in msg.pools]
    d["v"] = PROTOCOL_VERSION
    return d


def encode(msg: Message) -> bytes:
    return json.dumps(to_dict(msg), separators=(",", ":")).encode()


def _get(d: dict[str, Any], key: str, kinds: tuple[type, ...], *, optional: bool = False,
         mtype: str = "") -> Any:
    if key not in d or d[key] is None:
        if optional:
            return None
        raise MessageError(f"{mtype} message: missing field {key!r}")
    val = d[key]
    if isinstance(val, bool) and bool not in kinds:
        raise MessageError(f"{mtype} message: field {key!r} must be "
                           f"{'/'.join(k.__name__ for k in kinds)}, got {val!r}")
    if not isinstance(val, kinds):
        raise MessageError(f"{mtype} message: field {key!r} must be "
                           f"{'/'.join(k.__name__ for k in kinds)}, got {type(val).__name__}")
    return val


def _pool(d: Any, i: int) -> PackedMeta:
    if not isinstance(d, dict):
        raise MessageError(f"ready message: pools[{i}] must be an object")
    try:
        meta = PackedMeta.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise MessageError(f"ready message: pools[{i}] is malformed ({e!r})") from None
    if len(meta.shape) < 1 or any(s < 0 for s in meta.shape) or meta.num_entries < 1:
        raise MessageError(f"ready message: pools[{i}] has bad shape {meta.shape} or "
                           f"num_entries {meta.num_entries}")
    if not isinstance(meta.sharding.get("num_devices"), int):
        raise MessageError(f"ready message: pools[{i}].sharding.num_devices must be an int")
    if not 0 <= meta.page_count <= meta.rows:
        raise MessageError(f"ready message: pools[{i}] carries page_count {meta.page_count} "
                           f"pages in {meta.rows} rows")
    return meta


def _addrs(d: dict[str, Any], mtype: str) -> list[str] | None:
    raw = _get(d, "transfer_addrs", (list,), optional=True, mtype=mtype)
    if raw is None:
        return None
    def endpoint(a: Any) -> bool:
        if not isinstance(a, str):
            return False
        host, _, port = a.rpartition(":")
        return bool(host) and port.isdigit() and 0 < int(port) < 65536

    if not 0 < len(raw) <= 4096 or not all(endpoint(a) for a in raw):
        raise MessageError(f"{mtype} message: transfer_addrs must be a non-empty list of "
                           f"host:port strings, got {raw!r}"[:300])
    return list(raw)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _first_logprob(d: dict[str, Any], mtype: str) -> float | None:
    raw = _get(d, "first_logprob", (int, float), optional=True, mtype=mtype)
    if raw is not None and not _finite(raw):
        raise MessageError(f"{mtype} message: first_logprob must be a finite number, got {raw!r}")
    return None if raw is None else float(raw)


def _top_logprobs(d: dict[str, Any], mtype: str) -> tuple[tuple[int, float], ...] | None:
    raw = _get(d, "first_top_logprobs", (list,), optional=True, mtype=mtype)
    if raw is None:
        return None
    def pair(x: Any) -> bool:
        return (isinstance(x, list) and len(x) == 2 and isinstance(x[0], int)
                and not isinstance(x[0], bool) and x[0] >= 0 and _finite(x[1]))

    if len(raw) > MAX_TOP_LOGPROBS or not all(pair(x) for x in raw):
        raise MessageError(f"{mtype} message: first_top_logprobs must be at most "
                           f"{MAX_TOP_LOGPROBS} [token id, finite logprob] pairs, got "
                           f"{raw!r}"[:300])
    return tuple((int(t), float(lp)) for t, lp in raw)


def _layout(d: dict[str, Any], mtype: str) -> dict[str, Any] | None:
    raw = _get(d, "layout", (dict,), optional=True, mtype=mtype)
    if raw is None:
        return None
    try:
        layout = KVShardLayout.from_dict(raw)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise MessageError(f"{mtype} message: layout is malformed ({e!r})"[:300]) from None
    return layout.to_dict()


def from_dict(d: Any) -> Message:
    if not isinstance(d, dict):
        raise MessageError(f"message must be a JSON object, got {type(d).__name__}")
    v = d.get("v")
    if v != PROTOCOL_VERSION:
        raise MessageError(f"unsupported protocol version v={v!r} (this side speaks "
                           f"v={PROTOCOL_VERSION})")
    mtype = d.get("type")
    if mtype not in TYPES:
        raise MessageError(f"unknown message type {mtype!r} (known: {', '.join(TYPES)})")
    room = _get(d, "room", (int,), mtype=mtype)
    if not 0 <= room <= MAX_ROOM:
        raise MessageError(f"{mtype} message: room {room} is outside [0, 2**64)")
    if mtype == "want":
        cached = _get(d, "cached_pages", (int,), optional=True, mtype=mtype) or 0
        digest = _get(d, "prefix_hash", (str,), optional=True, mtype=mtype)
        if cached < 0:
            raise MessageError(f"want message: cached_pages must be >= 0, got {cached}")
        if cached and (digest is None or len(digest) != 32):
            raise MessageError("want message: cached_pages > 0 needs a 32-character prefix_hash")
        return Want(room=room, cached_pages=cached, prefix_hash=digest if cached else None,
                    layout=_layout(d, mtype))
    if mtype == "done":
        return Done(room=room, ok=_get(d, "ok", (bool,), mtype=mtype),
                    reason=_get(d, "reason", (str,), optional=True, mtype=mtype))
    if mtype == "failed":
        status = _get(d, "status", (int,), optional=True, mtype=mtype)
        return Failed(room=room, reason=_get(d, "reason", (str,), mtype=mtype), status=status)
    pools = _get(d, "pools", (list,), mtype=mtype)
    if not pools:
        raise MessageError("ready message: pools is empty")
    uuid = _get(d, "transfer_uuid", (int,), mtype=mtype)
    if not 0 <= uuid < 2**63:
        raise MessageError(f"ready message: transfer_uuid {uuid} is outside [0, 2**63)")
    prompt_len = _get(d, "prompt_len", (int,), mtype=mtype)
    if prompt_len < 0:
        raise MessageError(f"ready message: prompt_len must be >= 0, got {prompt_len}")
    cached = _get(d, "cached_tokens", (int,), optional=True, mtype=mtype) or 0
    if not 0 <= cached <= prompt_len:
        raise MessageError(f"ready message: cached_tokens must be in [0, prompt_len="
                           f"{prompt_len}], got {cached}")
    skip = _get(d, "skip_pages", (int,), optional=True, mtype=mtype) or 0
    if skip < 0:
        raise MessageError(f"ready message: skip_pages must be >= 0, got {skip}")
    stages = _get(d, "p_stages", (dict,), optional=True, mtype=mtype) or {}
    for name, secs in stages.items():
        if name not in P_STAGES:
            raise MessageError(f"ready message: unknown p_stages entry {name!r} (known: "
                               f"{', '.join(P_STAGES)})")
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or \
                not 0 <= secs < 1e6:
            raise MessageError(f"ready message: p_stages.{name} must be seconds >= 0, got "
                               f"{secs!r}")
    return Ready(room=room, transfer_addr=_get(d, "transfer_addr", (str,), mtype=mtype),
                 transfer_uuid=uuid,
                 expires_at=float(_get(d, "expires_at", (int, float), mtype=mtype)),
                 pools=tuple(_pool(p, i) for i, p in enumerate(pools)),
                 prompt_len=prompt_len,
                 first_token=_get(d, "first_token", (int,), optional=True, mtype=mtype),
                 first_logprob=_first_logprob(d, mtype),
                 first_top_logprobs=_top_logprobs(d, mtype),
                 cached_tokens=cached, skip_pages=skip,
                 p_stages={k: float(v) for k, v in stages.items()}, layout=_layout(d, mtype),
                 transfer_addrs=_addrs(d, mtype))


def decode(raw: bytes, max_bytes: int) -> Message:
    """Parse and validate one message; MessageError says why it was rejected."""
    if len(raw) > max_bytes:
        raise MessageError(f"message of {len(raw)} bytes exceeds side_channel_max_bytes="
                           f"{max_bytes}")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MessageError(f"not valid UTF-8 JSON ({e.__class__.__name__}: {e})") from None
    return from_dict(d)


# ---------------------------------------------------------------------------- migration
# SamplingParams fields a MigrationOffer carries, with their JSON types
_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,), "temperature": (int, float), "top_p": (int, float),
    "top_k": (int,), "seed": (int,), "stop": (list,), "stop_token_ids": (list,),
    "ignore_eos": (bool,), "skip_special_tokens": (bool,), "no_stop_trim": (bool,),
    "max_new_tokens_given": (bool,), "min_p": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "repetition_penalty": (int, float), "logprobs": (int,),
    "n": (int,)}


@dataclass(frozen=True)
class MigrationOffer:
    """D1 -> D2: a running request to continue, and where its KV waits (D1's side channel
    `source`, `room`). Its state at a step boundary: every token's id, the logprobs emitted
    (when asked for), the sampling settings with the settled seed (the next token's index is
    len(output_ids): seeded draws go on where they stopped), and `num_computed`, the tokens
    whose KV the `page_count` pages hold (all but the newest output token, which D2 computes
    first). Penalty counts and the stop-string tail are rebuilt from the ids."""

    room: int
    rid: str
    source: str                     # D1's side channel, host:port
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    num_computed: int
    page_count: int
    sampling: dict[str, Any]
    output_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cached_tokens: int = 0
    type: str = field(default="migrate", init=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_ids"], d["output_ids"] = list(self.prompt_ids), list(self.output_ids)
        d["output_logprobs"] = None if self.output_logprobs is None else [
            None if lp is None else [lp.logprob, [[t, x] for t, x in lp.top]]
            for lp in self.output_logprobs]
        d["v"] = PROTOCOL_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Any, max_tokens: int = 1 << 20) -> MigrationOffer:
        """Validate an offer (MessageError says what is wrong)."""
        if not isinstance(d, dict):
            raise MessageError(f"migrate offer must be a JSON object, got {type(d).__name__}")
        if d.get("v") != PROTOCOL_VERSION or d.get("type", "migrate") != "migrate":
            raise MessageError(f"migrate offer: unsupported version or type "
                               f"(v={d.get('v')!r}, type={d.get('type')!r})")
        t = "migrate"
        room = _get(d, "room", (int,), mtype=t)
        if not 0 <= room <= MAX_ROOM:
            raise MessageError(f"migrate offer: room {room} is outside [0, 2**64)")
        rid = _get(d, "rid", (str,), mtype=t)
        source = _get(d, "source", (str,), mtype=t)
        host, _, port = source.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MessageError(f"migrate offer: source must be host:port, got {source!r}"[:300])

        def ids(key: str) -> tuple[int, ...]:
            raw = _get(d, key, (list,), mtype=t)
            if len(raw) > max_tokens or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw):
                raise MessageError(f"migrate offer: {key} must be at most {max_tokens} token "
                                   f"ids >= 0")
            return tuple(raw)

        prompt, output = ids("prompt_ids"), ids("output_ids")
        if not prompt or not output:
            raise MessageError("migrate offer: prompt_ids and output_ids must not be empty "
                               "(a request migrates once it decodes)")
        computed = _get(d, "num_computed", (int,), mtype=t)
        if computed != len(prompt) + len(output) - 1:
            raise MessageError(f"migrate offer: num_computed must be every token but the newest "
                               f"({len(prompt) + len(output) - 1}), got {computed}")
        pages = _get(d, "page_count", (int,), mtype=t)
        if not 1 <= pages <= computed:
            raise MessageError(f"migrate offer: page_count {pages} is outside [1, {computed}]")
        sampling = _get(d, "sampling", (dict,), mtype=t)
        for key, val in sampling.items():
            kinds = _SAMPLING_FIELDS.get(key)
            if kinds is None:
                raise MessageError(f"migrate offer: unknown sampling field {key!r}"[:300])
            if val is None and key == "seed":
                raise MessageError("migrate offer: sampling.seed must be settled (an int)")
            if (isinstance(val, bool) and bool not in kinds) or not isinstance(val, kinds):
                raise MessageError(f"migrate offer: sampling.{key} has the wrong type "
                                   f"({type(val).__name__})")
            if isinstance(val, float) and not math.isfinite(val):
                raise MessageError(f"migrate offer: sampling.{key} must be finite")
        if not isinstance(sampling.get("seed"), int):
            raise MessageError("migrate offer: sampling.seed must be settled (an int)")
        if not all(isinstance(s, str) and s for s in sampling.get("stop", [])) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0
                for x in sampling.get("stop_token_ids", [])):
            raise MessageError("migrate offer: sampling.stop / stop_token_ids are malformed")
        raw_lps = _get(d, "output_logprobs", (list,), optional=True, mtype=t)
        lps = None
        if raw_lps is not None:
            if len(raw_lps) != len(output):
                raise MessageError(f"migrate offer: {len(raw_lps)} output_logprobs for "
                                   f"{len(output)} output tokens")
            lps = tuple(_offer_logprob(x) for x in raw_lps)
        cached = _get(d, "cached_tokens", (int,), optional=True, mtype=t) or 0
        if not 0 <= cached <= len(prompt):
            raise MessageError(f"migrate offer: cached_tokens {cached} outside [0, "
                               f"{len(prompt)}]")
        return cls(room=room, rid=rid, source=source, prompt_ids=prompt, output_ids=output,
                   num_computed=computed, page_count=pages, sampling=dict(sampling),
                   output_logprobs=lps, cached_tokens=cached)


def _offer_logprob(x: Any) -> TokenLogprob | None:
    if x is None:
        return None
    if (not isinstance(x, list) or len(x) != 2 or not _finite(x[0])
            or not isinstance(x[1], list) or len(x[1]) > MAX_TOP_LOGPROBS):
        raise MessageError(f"migrate offer: an output logprob must be [logprob, [[token id, "
                           f"logprob], ...]] or null, got {x!r}"[:300])
    top = []
    for pair in x[1]:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)
                and not isinstance(pair[0], bool) and pair[0] >= 0 and _finite(pair[1])):
            raise MessageError(f"migrate offer: bad top logprob pair {pair!r}"[:300])
        top.append((int(pair[0]), float(pair[1])))
    return TokenLogprob(float(x[0]), tuple(top))
