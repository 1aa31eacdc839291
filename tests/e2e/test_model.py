"""Model pieces: ModelConfig validation, mesh, byte tokenizer and streaming, attention glue."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.runtime.engine import attention as attn
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import SeqChunk, bucket
from pdtopo.runtime.model import llama
from pdtopo.runtime.model.tokenizer import (
    BYTE_BOS,
    BYTE_EOS,
    ByteTokenizer,
    StreamDecoder,
    load_tokenizer,
)


def _tiny(**over):
    cfg = compose_config(["model=tiny_llama"])
    d = dict(cfg.model)
    d.update(over)
    return d


def test_model_config_from_group_and_errors():
    cfg = model_config_from_cfg(_tiny())
    assert (cfg.architecture, cfg.num_kv_heads, cfg.eos_token_ids, cfg.tokenizer) == (
        "llama", 4, (257,), "byte")
    with pytest.raises(ValueError, match="model.architecture='gpt2'"):
        model_config_from_cfg(_tiny(architecture="gpt2"))
    with pytest.raises(ValueError, match="num_heads=8 must be a multiple of.*num_kv_heads=3"):
        model_config_from_cfg(_tiny(num_kv_heads=3))
    with pytest.raises(KeyError, match="model.hidden_size"):
        model_config_from_cfg(_tiny(hidden_size=None))
    assert model_config_from_cfg(_tiny(architecture="qwen2", qkv_bias=None)).qkv_bias


def test_build_mesh():
    mesh = build_mesh(2)
    assert mesh.axis_names == ("tp",) and mesh.shape["tp"] == 2
    assert list(mesh.devices.flat) == jax.devices()[:2]
    with pytest.raises(ValueError, match="needs 64 devices"):
        build_mesh(64)
    with pytest.raises(ValueError, match="positive integer"):
        build_mesh(0)


def test_byte_tokenizer_and_stream_decoder():
    tok = load_tokenizer(_tiny())
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (512, BYTE_BOS, [BYTE_EOS])
    text = "héllo → 世界"
    ids = tok.encode(text)
    assert ids[0] == BYTE_BOS and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == list(text.encode())
    stream = StreamDecoder(tok)
    out = []
    for i in ids[1:] + [BYTE_EOS]:
        piece = stream.push([i])
        assert "\ufffd" not in piece  # incomplete UTF-8 is held back, never emitted
        out.append(piece)
    assert "".join(out) + stream.flush() == text
    # a truncated multi-byte character comes out as U+FFFD only at flush
    s2 = StreamDecoder(tok)
    assert s2.push([ord("a")]) == "a"
    assert s2.push(list("世".encode())[:-1]) == ""
    assert s2.flush() == "\ufffd"


def test_default_chat_template():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tok.apply_chat_template(msgs) == (
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "x"}])


def test_rope_llama3_scaling_changes_only_low_frequencies():
    base = model_config_from_cfg(_tiny(head_dim=64, num_heads=2, num_kv_heads=2,
                                       hidden_size=128, rope_theta=500000.0))
    scaled = model_config_from_cfg(_tiny(
        head_dim=64, num_heads=2, num_kv_heads=2, hidden_size=128, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    a, b = llama.rope_inv_freq(base), llama.rope_inv_freq(scaled)
    assert a[0] == b[0]  # highest frequency untouched
    np.testing.assert_allclose(b[-1], a[-1] / 8.0, rtol=1e-6)  # lowest divided by factor
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn'"):
        model_config_from_cfg(_tiny(rope_scaling={"type": "yarn", "factor": 2.0}))


def _geometry(page_size, layout_kind="paged", block_pages=16):
    from pdtopo.runtime.engine.step_inputs import StepGeometry

    return StepGeometry(page_size=page_size, max_pages=6, max_rows=4, max_prefill_tokens=16,
                        layout_kind=layout_kind, block_tokens=block_pages * page_size)


def _reference_attention(chunks, q, kp, vp, cu, kvh, h, d):
    """Per-sequence dense causal attention over pool pages (old tokens) + new tokens."""
    scale = 1 / np.sqrt(d)
    out = np.zeros((int(cu[len(chunks)]), h, d), np.float32)
    for i, c in enumerate(chunks):
        n = c.start_pos + len(c.token_ids)
        keys = np.asarray(kp)[c.page_ids].reshape(-1, kvh, d)[:n]
        vals = np.asarray(vp)[c.page_ids].reshape(-1, kvh, d)[:n]
        for t in range(len(c.token_ids)):
            for hh in range(h):
                sc = keys[: c.start_pos + t + 1, hh // (h // kvh)] @ np.asarray(q)[cu[i] + t, hh]
                p = np.exp(sc * scale - (sc * scale).max())
                out[cu[i] + t, hh] = (p / p.sum()) @ vals[: c.start_pos + t + 1, hh // (h // kvh)]
    return out


@pytest.mark.parametrize("chunks", [
    [SeqChunk([1] * 7, 0, [3, 9]), SeqChunk([1], 5, [4, 5]), SeqChunk([1] * 3, 6, [10, 11, 12])],
    [SeqChunk([1] * 13, 3, [3, 9, 14, 15]), SeqChunk([1] * 2, 0, [7])],
    [SeqChunk([1], 5, [4, 5]), SeqChunk([1], 0, [6]), SeqChunk([1], 22, [8, 1, 2, 16, 17, 18])],
], ids=["mixed", "chunked", "decode"])
def test_gather_attention_matches_dense_reference(chunks):
    """The gather implementation (decode or flat layout, several context blocks) equals
    per-sequence dense causal attention (the TPU kernel: tests/e2e/test_tpu_attention.py)."""
    from pdtopo.runtime.engine.step_inputs import prepare_step

    rng = np.random.default_rng(0)
    ps, kvh, h, d, npages = 4, 2, 4, 8, 24
    step = prepare_step(chunks, _geometry(ps))
    assert step.key[0] == ("decode" if all(len(c.token_ids) == 1 for c in chunks) else "flat")
    tb = step.tokens.shape[0]
    q = jnp.asarray(rng.standard_normal((tb, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((tb, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tb, kvh, d)), jnp.float32)
    k_pool = jnp.asarray(rng.standard_normal((npages, ps, kvh, d)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((npages, ps, kvh, d)), jnp.float32)
    lens = [len(c.token_ids) for c in chunks]
    cu = np.concatenate([[0], np.cumsum(lens)])
    for block_pages in (1, 2, 16):
        step = prepare_step(chunks, _geometry(ps, block_pages=block_pages))
        md = attn.AttentionMetadata(*map(jnp.asarray, step.md))
        out, kp, vp = attn.paged_attention(q, k, v, k_pool, v_pool, md, mesh=build_mesh(1),
                                           impl="gather", layout=step.key[0],
                                           block_pages=block_pages)
        for i, c in enumerate(chunks):
            keys = np.asarray(kp)[c.page_ids].reshape(-1, kvh, d)
            np.testing.assert_array_equal(
                keys[c.start_pos:c.start_pos + lens[i]], np.asarray(k)[cu[i]:cu[i + 1]])
        ref = _reference_attention(chunks, q, kp, vp, cu, kvh, h, d)
        np.testing.assert_allclose(np.asarray(out)[:cu[-1]], ref, rtol=1e-5, atol=1e-5)


def test_resolve_impl():
    assert attn.resolve_impl("auto", 16, "cpu") == "gather"
    assert attn.resolve_impl("auto", 128, "tpu") == "pallas"
    assert attn.resolve_impl("auto", 64, "tpu") == "pallas"
    assert attn.resolve_impl("pallas_interpret", 64, "cpu") == "pallas_interpret"
    with pytest.raises(ValueError, match="needs a TPU.*pallas_interpret"):
        attn.resolve_impl("pallas", 128, "cpu")
    with pytest.raises(ValueError, match="engine.attention_impl='flash'"):
        attn.resolve_impl("flash", 128, "cpu")
    assert bucket(0) == 1 and bucket(5) == 8
