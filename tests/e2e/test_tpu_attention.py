"""The TPU attention kernel, executed: pdtopo's ragged paged-attention Pallas kernel run by JAX's
TPU interpreter on this machine's CPU devices, through the very call TPU serving makes
(`attention.paged_attention(..., impl="pallas_interpret", layout="ragged")` inside shard_map),
compared with the XLA gather path on the same pool and with a dense NumPy reference.

The cases cover every pair of values of: dtype (bf16, f32) x head_dim (64, 128) x page size
(16, 64) x GQA ratio (1, 4, 8) x KV heads per device (1, 2, 4) x batch kind (decode, prefill,
mixed; ragged lengths, empty slots) x tp (2, 4). `ALL_PAIRS` is generated greedily and checked
for full pair coverage.

Those run with DMAs that complete as they start (eager: what shard_map's interpreted callbacks
need). Per kind, `test_kernel_with_late_dmas_and_race_detection` runs the kernel alone on one
device with DMAs that complete only when waited on and the interpreter's race detector on, two
simulated TensorCores taking the "parallel" grid in random order, over contexts that span
several KV blocks (so prefetching across blocks and sequences happens): a missing or misplaced
wait then reads unwritten buffers (NaN, as the interpreter fills them) or is reported as a
race. `test_a_missing_wait_is_caught` shows it does.
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
    "kv_per_device": (1, 2, 4),
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
    assert len(ALL_PAIRS) <= 14


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


def _geometry(case: dict, layout_kind: str, context: int = 260) -> StepGeometry:
    page_size, kvd = case["page_size"], case.get("kv_per_device", 1)
    return StepGeometry(page_size=page_size, max_pages=math.ceil(context / page_size),
                        max_rows=16, max_prefill_tokens=256, layout_kind=layout_kind,
                        kernel_shape=(case["dtype"], case["dtype"], kvd * case["gqa"], kvd,
                                      case["head_dim"]))


def _written(chunks, pool, new, page_size):
    """The pool with each chunk's new K (or V) rows at their positions (NumPy)."""
    want, row = pool.copy(), 0
    for c in chunks:
        for i in range(len(c.token_ids)):
            pos = c.start_pos + i
            want[c.page_ids[pos // page_size], pos % page_size] = new[row]
            row += 1
    return want


def _run(case: dict, impl: str, layout_kind: str, chunks, arrays, mesh):
    geometry = _geometry(case, layout_kind)
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
    kvh, dtype = tp * case["kv_per_device"], jnp.dtype(case["dtype"])
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
    q, k_new, v_new, k_pool, v_pool = arrays
    for got, pool, new in ((kp_k, k_pool, k_new), (vp_k, v_pool, v_new),
                           (kp_x, k_pool, k_new), (vp_x, v_pool, v_new)):
        # page 0 is the reserved page padding tokens write to: not compared
        np.testing.assert_array_equal(got[1:], _written(chunks, pool, new,
                                                        case["page_size"])[1:])
    want = _dense_reference(chunks, q[:total], k_pool, v_pool, k_new, v_new,
                            case["page_size"], 1 / math.sqrt(d))
    tol = TOLERANCE[case["dtype"]]
    np.testing.assert_allclose(out_k[:total], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(out_x[:total], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(out_k[:total], out_x[:total], rtol=tol, atol=tol)
    assert not np.any(out_k[total:]), "padding rows must come out as zeros"


# per kind: contexts over several KV blocks (decode 256 tokens, prefill 512 at page 16) and
# enough rows or query blocks for two grid steps per call (two simulated cores)
LATE_DMA_BATCHES = {
    "decode": [(1, 600), (1, 300), (1, 5), (1, 700), (1, 16), (1, 255), (1, 256), (1, 0),
               (1, 90), (1, 513), (1, 40)],
    "prefill": [(150, 0), (70, 530)],
    "mixed": [(1, 600), (100, 0), (1, 20), (40, 520), (1, 300)],
}
LATE_DMA_CASE = {"dtype": "float32", "head_dim": 128, "page_size": 16, "gqa": 4,
                 "kv_per_device": 2}


def _run_alone(batch: str, params, seed: int = 0):
    """The kernel alone on one device, interpreted with `params`: (output, dense reference,
    real tokens)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    from pdtopo.kernels import ragged_attention

    case = LATE_DMA_CASE
    rng = np.random.default_rng(seed)
    BATCHES[batch + "-long"] = LATE_DMA_BATCHES[batch]
    chunks, num_pages = _chunks(batch + "-long", case["page_size"], rng)
    del BATCHES[batch + "-long"]
    step = prepare_step(chunks, _geometry(case, "ragged", context=720))
    t, total = step.tokens.shape[0], sum(len(c.token_ids) for c in chunks)
    kvh, d = case["kv_per_device"], case["head_dim"]
    q, k_new, v_new = (rng.standard_normal((t, n, d)).astype(np.float32)
                       for n in (kvh * case["gqa"], kvh, kvh))
    k_pool, v_pool = (rng.standard_normal((num_pages, case["page_size"], kvh, d))
                      .astype(np.float32) for _ in range(2))
    md = attn.AttentionMetadata(*map(jnp.asarray, step.md))
    kp, vp = attn.write_kv(jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(k_pool),
                           jnp.asarray(v_pool), md)
    out = ragged_attention.ragged_paged_attention(
        jnp.asarray(q), kp, vp, md.kv_lens, md.page_table, md.cu_q_lens, md.kind_counts,
        md.dec_seqs, md.pf_blocks, md.pf_q_rows, md.out_rows, sm_scale=1 / math.sqrt(d),
        interpret=params)
    out = np.asarray(out)
    races = interpret_pallas_call.races
    want = _dense_reference(chunks, q[:total], k_pool, v_pool, k_new, v_new,
                            case["page_size"], 1 / math.sqrt(d))
    return out, want, total, bool(races and races.races_found), step


def _late_dmas(seed: int):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True,
                                 num_cores_or_threads=2, random_seed=seed)


@pytest.mark.parametrize("batch", ["decode", "prefill", "mixed"])
def test_kernel_with_late_dmas_and_race_detection(batch):
    out, want, total, races, step = _run_alone(batch, _late_dmas(seed=len(batch)))
    counts = step.md.kind_counts
    if batch == "decode":
        assert counts[0] > step.md.dec_seqs.shape[1], "decode rows fill two grid steps"
    if batch == "mixed":
        assert counts[0] >= 2
    if batch != "decode":
        assert counts[1] >= 2, "two prefill query blocks or more"
    assert not races, "the interpreter's race detector reported a race"
    np.testing.assert_allclose(out[:total], want, rtol=2e-5, atol=2e-5)
    assert not np.any(out[total:])


def test_a_missing_wait_is_caught(monkeypatch):
    """The late-DMA mode is what catches a wait the kernel lacks: with every wait removed the
    result is wrong there, while eager DMAs would hide it."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    from pdtopo.kernels import ragged_attention

    monkeypatch.setattr(ragged_attention._Pages, "wait", lambda self, *a: None)
    ragged_attention.ragged_paged_attention.clear_cache()
    try:
        eager, want, total, _, _ = _run_alone(
            "mixed", pltpu.InterpretParams(dma_execution_mode="eager"))
        np.testing.assert_allclose(eager[:total], want, rtol=2e-5, atol=2e-5)  # hidden
        late, want, total, _, _ = _run_alone("mixed", _late_dmas(seed=1))
        assert not np.allclose(late[:total], want, rtol=2e-5, atol=2e-5, equal_nan=False)
    finally:
        interpret_pallas_call.reset_tpu_interpret_mode_state()
        ragged_attention.ragged_paged_attention.clear_cache()


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
