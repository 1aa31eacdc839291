"""Batched next-token sampling on the device: penalties, greedy, temperature, top-k, top-p,
min_p, seeded draws, and the logprobs a client asked for.

Data flow. The scheduler gives `Sampler.sample(logits, rows)` the runner's logits `[n, vocab]`
(n may exceed the number of requests: padding rows are ignored) and one `RowParams` per request.
One compiled program does the rest on the device and returns a `SampleResult` (token ids and,
when a row asked, logprobs):

    penalties        repetition, frequency, presence from the request's device-side counts
                     (`penalties.PenaltyTables`; the program adds the sampled token to them)
    logprobs         log_softmax(penalised logits / temperature) (temperature 1 for greedy
                     rows): the distribution sampled from, before top-k/top-p/min_p
    filters          top-k and top-p as thresholds found by bisection over the values' bit
                     patterns (32 passes of compare-and-count, no sort of the vocabulary); min_p
                     relative to the most likely token
    draw             inverse CDF in vocabulary order with one uniform per row

Rows with temperature 0 or top_k 1 take the argmax. A batch that is all greedy, wants no
logprobs and has no penalty runs an argmax-only program instead.

Sampling is stateless per request: the uniform for output token i of a request with seed s
comes from `fold_in(key(s), i)` (`request_key`: a 64-bit seed's key data is [s >> 32,
s & 0xffffffff]), and the penalty counts are rebuilt from token ids, so a prefill server
(token 0) and a decode server (tokens 1..) produce the same stream as one colocated server.

Programs are compiled ahead of time per logits shape, dtype and sharding and kept by the
Sampler; `Sampler.warmup(row_counts, like)` compiles them without running anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdtopo.runtime.engine.penalties import PenaltyHistory, PenaltyTables, apply_penalties
from pdtopo.runtime.engine.request import MAX_TOP_LOGPROBS

DEFAULT_PENALTY_SLOTS = 64


@dataclass(frozen=True)
class RowParams:
    """Sampling settings of one row. top_k <= 0: off; logprobs -1: none, 0: the sampled
    token's, k: plus the k most likely; history: the request's ids when it has a penalty."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1
    history: PenaltyHistory | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_full_program(self) -> bool:
        return not self.greedy or self.logprobs >= 0 or self.penalised


# one row for every request whose token is the argmax and that asked for nothing else (no
# logprobs, no penalty): what the sampler reads of a row then is the same whatever its seed,
# step or filters
GREEDY_ROW = RowParams(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)


@dataclass(frozen=True)
class SampleResult:
    """Token ids of the requests' rows; with logprobs asked for, per row the sampled token's
    logprob and the MAX_TOP_LOGPROBS most likely (ids, logprobs), best first."""

    tokens: np.ndarray
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    def token_logprob(self, i: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
        """Row i's (logprob, [(id, logprob)] of its top_n)."""
        assert self.logprobs is not None and self.top_ids is not None
        top = [(int(t), _json_safe(lp)) for t, lp in
               zip(self.top_ids[i, :top_n], self.top_logprobs[i, :top_n], strict=True)]
        return _json_safe(self.logprobs[i]), top


def _json_safe(logprob: Any) -> float:
    """A logprob JSON can carry: -inf (a token masked out) becomes float32's lowest."""
    return max(float(logprob), float(np.finfo(np.float32).min))


@dataclass(frozen=True)
class PendingSample:
    """Sampled rows still on the device: `tokens` (all the logits' rows, padding included)
    can feed the next step there; `result()` reads the requests' rows back."""

    out: dict[str, jax.Array]
    n: int

    def __post_init__(self) -> None:
        # start the copy back now: queued later (after the next step's programs), reading
        # these rows would wait for that step too
        for x in self.out.values():
            x.copy_to_host_async()

    @property
    def tokens(self) -> jax.Array:
        return self.out["tokens"]

    def result(self) -> SampleResult:
        host = jax.device_get(self.out)
        if len(host) == 1:
            return SampleResult(np.asarray(host["tokens"])[:self.n])
        return SampleResult(*(np.asarray(host[k])[:self.n] for k in
                              ("tokens", "logprobs", "top_ids", "top_logprobs")))


def request_key(seed: int, step: int) -> jax.Array:
    """The key of output token `step` of a request with `seed`."""
    data = jnp.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.wrap_key_data(data, impl="threefry2x32"), step)


def draw_uniform(seed_hi, seed_lo, step):
    """One row's uniform in [0, 1) (request_key's key, traced)."""
    key = jax.random.wrap_key_data(jnp.stack([seed_hi, seed_lo]), impl="threefry2x32")
    return jax.random.uniform(jax.random.fold_in(key, step), dtype=jnp.float32)


def _order_key(x):
    """float32 -> uint32 whose unsigned order is the floats' order."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(0x80000000))


def _largest_key_where(keys, ok_at):
    """Per row, the largest uint32 t with ok_at(t) true, for a predicate that holds on
    [0, t*] and fails above (32 bisection passes)."""
    lo = jnp.zeros(keys.shape[0], jnp.uint32)
    hi = jnp.full(keys.shape[0], 0xFFFFFFFF, jnp.uint32)

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi > lo)
        ok = ok_at(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]


def top_k_mask(scaled, top_k):
    """Tokens whose value is at least the row's k-th largest (ties kept, as HF's TopK)."""
    keys = _order_key(scaled)
    k = jnp.where(top_k > 0, top_k, scaled.shape[-1])
    kth = _largest_key_where(keys, lambda t: jnp.sum(keys >= t[:, None], -1) >= k)
    return keys >= kth[:, None]


def top_p_mask(probs, top_p):
    """Tokens whose probability mass strictly above them is below top_p (the smallest set
    of most likely tokens reaching top_p; the best token always stays)."""
    keys = _order_key(probs)

    def below_enough(t):  # mass of tokens with key >= t is >= top_p
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), -1) >= top_p

    cut = _largest_key_where(keys, below_enough)
    return keys >= cut[:, None]


def _filters(scaled, p):
    """The kept tokens: top-k, then top-p over the renormalised survivors, then min_p; each
    pass runs only when some row asks for it."""
    rows, vocab = scaled.shape
    keep = jnp.ones((rows, vocab), bool)
    keep = jax.lax.cond(jnp.any(p["top_k"] > 0), lambda: top_k_mask(scaled, p["top_k"]),
                        lambda: keep)
    masked = jnp.where(keep, scaled, -jnp.inf)
    keep = jax.lax.cond(jnp.any(p["top_p"] < 1.0),
                        lambda: keep & top_p_mask(jax.nn.softmax(masked, -1), p["top_p"]),
                        lambda: keep)
    floor = jnp.max(scaled, -1, keepdims=True) + jnp.log(p["min_p"])[:, None]
    return keep & (scaled >= floor)


def _draw(masked, greedy_ids, p):
    """Inverse-CDF draw in vocabulary order; a rounding overshoot falls back to the argmax."""
    cdf = jnp.cumsum(jax.nn.softmax(masked, -1), -1)
    u = jax.vmap(draw_uniform)(p["seed_hi"], p["seed_lo"], p["step"])
    idx = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], -1).astype(jnp.int32)
    return jnp.where(idx < masked.shape[-1], idx, greedy_ids)


@jax.jit
def _greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, donate_argnums=(1, 2))
def _sample(logits, counts, seen, p):
    slot = jnp.maximum(p["slot"], 0)
    has = (p["slot"] >= 0)[:, None]
    x = apply_penalties(logits.astype(jnp.float32), jnp.where(has, counts[slot], 0),
                        seen[slot] & has, p["presence"], p["frequency"], p["repetition"])
    greedy_ids = jnp.argmax(x, -1).astype(jnp.int32)
    scaled = x / jnp.where(p["temperature"] > 0, p["temperature"], 1.0)[:, None]
    masked = jnp.where(_filters(scaled, p), scaled, -jnp.inf)
    use_greedy = (p["temperature"] == 0) | (p["top_k"] == 1)
    tokens = jnp.where(use_greedy, greedy_ids, _draw(masked, greedy_ids, p))
    # rows without a penalty slot write out of range and are dropped: never a shared dummy
    # slot, whose duplicate scatter indices would race the real owner's update
    write_slot = jnp.where(p["slot"] >= 0, p["slot"], counts.shape[0])
    counts = counts.at[write_slot, tokens].add(1, mode="drop")
    seen = seen.at[write_slot, tokens].set(True, mode="drop")
    logprobs = jax.nn.log_softmax(scaled, -1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], -1)[:, 0]
    top_n = min(MAX_TOP_LOGPROBS, x.shape[1])
    top_lp, top_ids = jax.lax.cond(
        jnp.any(p["logprobs"] > 0), lambda: tuple(jax.lax.top_k(logprobs, top_n)),
        lambda: (jnp.zeros((x.shape[0], top_n), jnp.float32),
                 jnp.zeros((x.shape[0], top_n), jnp.int32)))
    return {"tokens": tokens, "logprobs": chosen, "top_ids": top_ids.astype(jnp.int32),
            "top_logprobs": top_lp}, counts, seen


def penalty_slots_for(max_running_requests: int) -> int:
    """Penalty-table slots of a scheduler's sampler: one per row a step can sample."""
    return max(1, int(max_running_requests))


def sampler_memory_bytes(rows: int, vocab: int, sharding: Any, penalty_slots: int) -> int:
    """Device bytes per device the sampler needs beside the step programs: the penalty tables
    (`[penalty_slots, vocab]` int32 + bool, laid out like the logits) and the full sampling
    program's temporaries and new outputs for `rows` float32 logits rows (XLA's memory
    analysis; the donated tables it returns are not counted twice). Compiled here, not kept."""
    tables = jax.ShapeDtypeStruct((penalty_slots, vocab), jnp.int32, sharding=sharding)
    seen = jax.ShapeDtypeStruct((penalty_slots, vocab), jnp.bool_, sharding=sharding)
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=sharding)
    table_bytes = int(np.prod(sharding.shard_shape(tables.shape))) * (
        np.dtype(np.int32).itemsize + np.dtype(np.bool_).itemsize)
    stats = _sample.lower(logits, tables, seen, _row_params([], rows)).compile().memory_analysis()
    if stats is None:
        return table_bytes
    program = (int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)
               - int(stats.alias_size_in_bytes))
    return table_bytes + max(program, 0)


class Sampler:
    """Host-side wrapper: packs per-row parameters, pads them to the logits' row count, and
    runs the program compiled for the logits' shape, dtype and sharding: compiled ahead of
    time by `warmup` (nothing runs) or on first use. Single owner: the scheduler thread.
    `penalty_slots`: how many penalised requests keep device-side counts at once (at least
    the most rows one step samples)."""

    def __init__(self, penalty_slots: int = DEFAULT_PENALTY_SLOTS) -> None:
        self._compiled: dict[tuple, Any] = {}
        self.penalty_slots = penalty_slots
        self.tables: PenaltyTables | None = None

    def _tables(self, logits: Any) -> PenaltyTables:
        if self.tables is None:
            self.tables = PenaltyTables(self.penalty_slots, logits.shape[1], logits.sharding)
        return self.tables

    def _program(self, fn: Any, logits: Any, *rest: Any) -> Any:
        """`fn` (_greedy or _sample) compiled for logits like `logits` (an array or a
        ShapeDtypeStruct with its sharding)."""
        key = (fn.__name__, tuple(logits.shape), str(logits.dtype), logits.sharding)
        program = self._compiled.get(key)
        if program is None:
            program = self._compiled[key] = fn.lower(logits, *rest).compile()
        return program

    def sample(self, logits: jax.Array, rows: Sequence[RowParams]) -> SampleResult:
        return self.dispatch(logits, rows).result()

    def dispatch(self, logits: jax.Array, rows: Sequence[RowParams]) -> PendingSample:
        """Start sampling `rows` of `logits` on the device; nothing is read back yet."""
        n_rows, n = logits.shape[0], len(rows)
        if n > n_rows:
            raise ValueError(f"{n} sampling rows for logits with {n_rows} rows")
        if not any(r.needs_full_program for r in rows):
            return PendingSample({"tokens": self._program(_greedy, logits)(logits)}, n)
        tables = self._tables(logits)
        params = _row_params(rows, n_rows)
        params["slot"][:n] = tables.slots_for([r.history if r.penalised else None
                                               for r in rows])
        program = self._program(_sample, logits, tables.counts, tables.seen, params)
        out, tables.counts, tables.seen = program(logits, tables.counts, tables.seen, params)
        if not any(r.logprobs >= 0 for r in rows):
            out = {"tokens": out["tokens"]}
        return PendingSample(out, n)

    def has_counts(self, serial: int) -> bool:
        """Whether a request (`Req.serial`) has its penalty counts on the device: a step
        sampled for it since it took its slot, and the slot was not given to another since.
        The program adds each sampled token there, so a step dispatched before the last one's
        tokens are read back sees them; a slot built now would be built from the host's ids."""
        return self.tables is not None and self.tables.holds(serial)

    def release(self, serial: int) -> None:
        """A request (`Req.serial`) left this scheduler: free its penalty slot, if any."""
        if self.tables is not None:
            self.tables.release(serial)

    def warmup(self, row_counts: Iterable[int], like: jax.Array) -> None:
        """Compile the greedy and the full program for logits of each row count with the
        vocabulary, dtype and sharding of `like` (a real step's logits), without running
        them."""
        tables = self._tables(like)
        for n in sorted(set(row_counts)):
            logits = jax.ShapeDtypeStruct((n, like.shape[1]), like.dtype, sharding=like.sharding)
            self._program(_greedy, logits)
            self._program(_sample, logits, tables.counts, tables.seen, _row_params([], n))


def _row_params(rows: Sequence[RowParams], n_rows: int) -> dict[str, np.ndarray]:
    """The program's per-row inputs for `rows`, padded to `n_rows` (padding rows: greedy,
    no penalty, no logprobs)."""
    p = {"temperature": np.zeros(n_rows, np.float32), "top_k": np.zeros(n_rows, np.int32),
         "top_p": np.ones(n_rows, np.float32), "min_p": np.zeros(n_rows, np.float32),
         "seed_hi": np.zeros(n_rows, np.uint32), "seed_lo": np.zeros(n_rows, np.uint32),
         "step": np.zeros(n_rows, np.int32), "presence": np.zeros(n_rows, np.float32),
         "frequency": np.zeros(n_rows, np.float32), "repetition": np.ones(n_rows, np.float32),
         "logprobs": np.full(n_rows, -1, np.int32), "slot": np.full(n_rows, -1, np.int32)}
    for j, r in enumerate(rows):
        p["temperature"][j], p["top_k"][j], p["top_p"][j] = r.temperature, r.top_k, r.top_p
        p["min_p"][j], p["step"][j], p["logprobs"][j] = r.min_p, r.step, r.logprobs
        p["seed_hi"][j], p["seed_lo"][j] = (r.seed >> 32) & 0xFFFFFFFF, r.seed & 0xFFFFFFFF
        p["presence"][j], p["frequency"][j] = r.presence_penalty, r.frequency_penalty
        p["repetition"][j] = r.repetition_penalty
    return p
