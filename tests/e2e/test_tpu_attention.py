"""The TPU attention kernel, executed: pdtopo's ragged paged-attention Pallas kernel run by JAX's
TPU interpreter on this machine's CPU devices, through the very call TPU serving makes
(`attention.paged_attention(..., impl="pallas_interpret", layout="ragged")` inside shard_map),
compared with the XLA gather path on the same pool and with a dense NumPy reference.

The cases cover every pair of values of: dtype (bf16, f32) x head_dim (64, 128) x page size
(16, 64) x GQA ratio (1, 4, 8) x batch kind (decode, prefill, mixed; ragged lengths, empty
slots) x tp (2, 4). `ALL_PAIRS` is generated greedily and checked for full pair coverage.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdtopo.runtime.engine import attention as attn
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import SeqChunk
from pdtopo.runtime.engine.step_inputs import StepGeometry, prepare_step

FACTORS = {
    "dtype": ("bfloat16", "float32"),
    "head_dim": (64, 128),
    "page_size": (16, 64),
    "gqa": (1, 4, 8),
    "batch": ("decode", "prefill", "mixed"),
    "tp": (2, 4),
}
# (query tokens, context before this step) per sequence
BATCHES = {
    "decode": [(1, 0), (1, 16), (1, 129), (1, 63), (1, 200)],
    "prefill": [(37, 0), (69, 0), (20, 50)],
    "mixed": [(1, 140), (33, 0), (1, 15), (18, 64), (1, 0)],
}
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}


def _pairs(case: dict) -> set:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(FACTORS, 2)}


def all_pairs() -> list[dict]:
    """A small case list holding every pair of factor values (greedy covering array)."""
    names = list(FACTORS)
    want = set().union(*(_pairs(dict(zip(names, vals, strict=True)))
                         for vals in itertools.product(*FACTORS.values())))
    cases: list[dict] = []
    while want:
        best = max((dict(zip(names, vals, strict=True))
                    for vals in itertools.product(*FACTORS.values())),
                   key=lambda c: len(_pairs(c) & want))
        cases.append(best)
        want -= _pairs(best)
    return cases


ALL_PAIRS = all_pairs()


def test_cases_cover_every_pair():
    covered = set().union(*map(_pairs, ALL_PAIRS))
    for a, b in itertools.combinations(FACTORS, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            assert ((a, va), (b, vb)) in covered
    assert len(ALL_PAIRS) <= 12


def _chunks(batch: str, page_size: int, rng) -> tuple[list[SeqChunk], int]:
    """Chunks over distinct random pages of a pool (page 0 stays the reserved page)."""
    spans = BATCHES[batch]
    need = [math.ceil((t + s) / page_size) for t, s in spans]
    num_pages = sum(need) + 3
    order = rng.permutation(np.arange(1, num_pages))
    chunks, at = [], 0
    for (t, s), n in zip(spans, need, strict=True):
        chunks.append(SeqChunk([1] * t, s, [int(p) for p in order[at:at + n]]))
        at += n
    return chunks, num_pages


def _dense_reference(chunks, q, k_pool, v_pool, k_new, v_new, page_size, sm_scale):
    """Per-sequence causal attention in float64 over the pool's pages with the new K/V
    written at their positions."""
    out = np.zeros(q.shape, np.float64)
    kvh = k_pool.shape[2]
    group = q.shape[1] // kvh
    row = 0
    for c in chunks:
        t = len(c.token_ids)
        keys = k_pool[c.page_ids].reshape(-1, kvh, k_pool.shape[3]).astype(np.float64)
        vals = v_pool[c.page_ids].reshape(-1, kvh, v_pool.shape[3]).astype(np.float64)
        keys[c.start_pos:c.start_pos + t] = k_new[row:row + t]
        vals[c.start_pos:c.start_pos + t] = v_new[row:row + t]
        for i in range(t):
            pos = c.start_pos + i
            for h in range(q.shape[1]):
                s = keys[:pos + 1, h // group] @ q[row + i, h].astype(np.float64) * sm_scale
                p = np.exp(s - s.max())
                out[row + i, h] = (p / p.sum()) @ vals[:pos + 1, h // group]
        row += t
    return out


def _run(case: dict, impl: str, layout_kind: str, chunks, arrays, mesh):
    page_size = case["page_size"]
    geometry = StepGeometry(page_size=page_size, max_pages=math.ceil(260 / page_size),
                            max_rows=8, max_prefill_tokens=128, layout_kind=layout_kind)
    step = prepare_step(chunks, geometry)
    md = attn.AttentionMetadata(*map(jnp.asarray, step.md))
    t = step.tokens.shape[0]
    q, k, v, k_pool, v_pool = (jnp.asarray(a[:t] if i < 3 else a) for i, a in enumerate(arrays))
    heads = NamedSharding(mesh, P(None, "tp", None))
    pool = NamedSharding(mesh, P(None, None, "tp", None))
    q, k, v = (jax.device_put(a, heads) for a in (q, k, v))
    k_pool, v_pool = (jax.device_put(a, pool) for a in (k_pool, v_pool))
    fn = jax.jit(lambda *a: attn.paged_attention(
        *a, mesh=mesh, impl=impl, layout=step.key[0], block_pages=geometry.block_pages))
    out, kp, vp = fn(q, k, v, k_pool, v_pool, md)
    return np.asarray(out.astype(jnp.float32)), np.asarray(kp.astype(jnp.float32)), \
        np.asarray(vp.astype(jnp.float32))


@pytest.mark.parametrize("case", ALL_PAIRS, ids=lambda c: "-".join(map(str, c.values())))
def test_kernel_matches_xla_path_and_dense_reference(case):
    rng = np.random.default_rng(ALL_PAIRS.index(case))
    tp, d, gqa = case["tp"], case["head_dim"], case["gqa"]
    kvh, dtype = tp, jnp.dtype(case["dtype"])
    chunks, num_pages = _chunks(case["batch"], case["page_size"], rng)
    total = sum(len(c.token_ids) for c in chunks)
    rows = 1 << (total - 1).bit_length()

    def draw(*shape):
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))

    arrays = (draw(rows, kvh * gqa, d), draw(rows, kvh, d), draw(rows, kvh, d),
              draw(num_pages, case["page_size"], kvh, d),
              draw(num_pages, case["page_size"], kvh, d))
    typed = tuple(np.asarray(jnp.asarray(a, dtype)) for a in arrays)
    mesh = build_mesh(tp)
    out_k, kp_k, vp_k = _run(case, "pallas_interpret", "ragged", chunks, typed, mesh)
    out_x, kp_x, vp_x = _run(case, "gather", "paged", chunks, typed, mesh)
    np.testing.assert_array_equal(kp_k, kp_x)  # both paths write the new K/V alike
    np.testing.assert_array_equal(vp_k, vp_x)
    q, k_new, v_new, k_pool, v_pool = arrays
    want = _dense_reference(chunks, q[:total], k_pool, v_pool, k_new, v_new,
                            case["page_size"], 1 / math.sqrt(d))
    tol = TOLERANCE[case["dtype"]]
    np.testing.assert_allclose(out_k[:total], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(out_x[:total], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(out_k[:total], out_x[:total], rtol=tol, atol=tol)
    assert not np.any(out_k[total:]), "padding rows must come out as zeros"


# prompts of ragged lengths (one over several pages, one a single token), decoded together
SERVING_PROMPTS = [[1, 5, 9, 12, 40, 7], [3] * 37, [8], [11, 2, 2, 90] * 5, [6] * 70]


@pytest.mark.parametrize("tp", [1, 2])
def test_serving_with_the_interpreted_kernel(tp):
    """A colocated scheduler with `engine.attention_impl=pallas_interpret` (the TPU kernel,
    interpreted) gives the XLA gather path's greedy tokens through a workload of mixed steps
    (134 prompt tokens over a 64-token budget: later prompts prefill beside running decodes),
    and compiles no step shape after warmup: every compiled key is in the ragged shape grid
    warmup compiled."""
    from pdtopo.config.compose import compose_config
    from pdtopo.runtime.model.tokenizer import load_tokenizer
    from tests.support.engine_greedy import greedy_colocated, scheduler_for

    tokens = {}
    for impl in ("gather", "pallas_interpret"):
        cfg = compose_config(["model=tiny_llama", f"engine.attention_impl={impl}",
                              "engine.max_running_requests=8", "engine.max_prefill_tokens=64",
                              "engine.max_model_len=128"])
        sched, runner = scheduler_for(cfg, "colocated", load_tokenizer(cfg.model), tp)
        runner.warmup()  # as the server does before it serves
        sched.warmup()
        warmed = runner.compiled_keys()
        tokens[impl] = greedy_colocated(sched, SERVING_PROMPTS, 8)
        assert runner.compiled_keys() == warmed, "a step shape compiled while serving"
        assert sched.stats()["num_mixed_steps"] > 0  # prompts prefilled beside decodes
        if impl == "pallas_interpret":
            assert runner.geometry.layout_kind == "ragged"
            assert warmed == runner.shape_grid()
            assert {k[0] for k in warmed} == {"ragged"}
    assert tokens["pallas_interpret"] == tokens["gather"]
