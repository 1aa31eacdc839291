"""Batched next-token sampling (jitted): greedy, temperature, top-k, top-p, seeded.

Sampling is stateless per request: the key for output token i of a request with seed s is
`fold_in(PRNGKey(s), i)` (for a 64-bit seed, PRNGKey's key data is [s >> 32, s & 0xffffffff]),
so a prefill server (token 0) and a decode server (tokens 1..) produce the same stream as one
colocated server. Rows with temperature 0 or top_k 1 take the argmax.

`Sampler.sample(logits, reqs_params)` takes the runner's logits `[n, vocab]` (n may be larger
than the number of requests: padding rows are ignored) and returns a NumPy int array of n' token
ids. Two compiled programs per row count: an argmax-only one (whole batch greedy) and the full
one, compiled ahead of time per logits shape and kept by the Sampler. `Sampler.warmup(row_counts,
like)` compiles both ahead of serving without running them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RowParams:
    """Sampling settings of one row: temperature, top_k (<=0: off), top_p, seed, token index."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def request_key(seed: int, step: int) -> jax.Array:
    """The reference key for output token `step` of a request with `seed` (for tests/tools)."""
    data = jnp.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.wrap_key_data(data, impl="threefry2x32"), step)


@jax.jit
def _greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@jax.jit
def _sample(logits, temperature, top_k, top_p, seed_hi, seed_lo, step):
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # top-k / top-p decided in sorted order, then mapped back: the draw itself is over the
    # vocabulary in its natural order, so it equals categorical(key, logits / T) when unfiltered.
    order = jnp.argsort(-logits, axis=-1, stable=True)           # descending, ties by index
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / safe_t
    sorted_scaled = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    sorted_scaled = jnp.where(rank < k, sorted_scaled, -jnp.inf)
    probs = jax.nn.softmax(sorted_scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                  # mass strictly above this rank
    keep_sorted = (rank < k) & ((before < top_p[:, None]) | (rank == 0))
    keep = jax.vmap(lambda o, ks: jnp.zeros((vocab,), bool).at[o].set(ks))(order, keep_sorted)
    masked = jnp.where(keep, scaled, -jnp.inf)

    def one(row_logits, hi, lo, i):
        key = jax.random.wrap_key_data(jnp.stack([hi, lo]), impl="threefry2x32")
        return jax.random.categorical(jax.random.fold_in(key, i), row_logits)

    sampled_ids = jax.vmap(one)(masked, seed_hi, seed_lo, step).astype(jnp.int32)
    use_greedy = (temperature == 0) | (top_k == 1)
    return jnp.where(use_greedy, greedy_ids, sampled_ids)


class Sampler:
    """Host-side wrapper: packs per-row parameters, pads them to the logits' row count, and
    runs the program compiled for the logits' shape, dtype and sharding: compiled ahead of
    time by `warmup` (nothing runs) or on first use. Single owner: the scheduler thread."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, Any] = {}

    def _program(self, fn: Any, logits: Any, *rest: np.ndarray) -> Any:
        """`fn` (_greedy or _sample) compiled for logits like `logits` (an array or a
        ShapeDtypeStruct with its sharding)."""
        key = (fn.__name__, tuple(logits.shape), str(logits.dtype), logits.sharding)
        program = self._compiled.get(key)
        if program is None:
            program = self._compiled[key] = fn.lower(logits, *rest).compile()
        return program

    def sample(self, logits: jax.Array, rows: Sequence[RowParams]) -> np.ndarray:
        n_rows = logits.shape[0]
        n = len(rows)
        if n > n_rows:
            raise ValueError(f"{n} sampling rows for logits with {n_rows} rows")
        if all(r.greedy for r in rows):
            return np.asarray(jax.device_get(self._program(_greedy, logits)(logits)))[:n]
        params = _row_params(rows, n_rows)
        out = self._program(_sample, logits, *params)(logits, *params)
        return np.asarray(jax.device_get(out))[:n]

    def warmup(self, row_counts: Iterable[int], like: jax.Array) -> None:
        """Compile greedy and random sampling for logits of each row count with the
        vocabulary, dtype and sharding of `like` (a real step's logits), without running
        them."""
        for n in sorted(set(row_counts)):
            logits = jax.ShapeDtypeStruct((n, like.shape[1]), like.dtype, sharding=like.sharding)
            self._program(_greedy, logits)
            self._program(_sample, logits, *_row_params([], n))


def _row_params(rows: Sequence[RowParams], n_rows: int) -> tuple[np.ndarray, ...]:
    """(temperature, top_k, top_p, seed_hi, seed_lo, step) of `rows`, padded to `n_rows`
    (padding rows: greedy)."""
    temperature = np.zeros(n_rows, np.float32)
    top_k = np.zeros(n_rows, np.int32)
    top_p = np.ones(n_rows, np.float32)
    seed_hi = np.zeros(n_rows, np.uint32)
    seed_lo = np.zeros(n_rows, np.uint32)
    step = np.zeros(n_rows, np.int32)
    for j, r in enumerate(rows):
        temperature[j], top_k[j], top_p[j] = r.temperature, r.top_k, r.top_p
        seed_hi[j], seed_lo[j] = (r.seed >> 32) & 0xFFFFFFFF, r.seed & 0xFFFFFFFF
        step[j] = r.step
    return temperature, top_k, top_p, seed_hi, seed_lo, step
