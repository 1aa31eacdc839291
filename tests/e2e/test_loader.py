"""Loader: an HF-format checkpoint built on the fly (Llama and Qwen2, sharded safetensors with an
index, a tokenizer.json trained here) loads, and the runner's logits equal an independent NumPy
forward of the same weights written from the math below."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from safetensors.numpy import save_file

from pdtopo.config.compose import compose_config
from pdtopo.model_config.random_checkpoint import (
    EPS,
    FF,
    KVH,
    NH,
    THETA,
    D,
    H,
    L,
    V,
    write_random_checkpoint,
)
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, SeqChunk
from pdtopo.runtime.model.loader import load_params
from pdtopo.runtime.model.tokenizer import HFTokenizer, StreamDecoder, load_tokenizer

# ----------------------------------------------------------- independent NumPy reference


def numpy_forward(t: dict[str, np.ndarray], tokens: list[int], arch: str, tied: bool):
    """Logits [S, V] of a Llama/Qwen2 decoder, straight from the HF tensors (float64)."""
    g = {k: v.astype(np.float64) for k, v in t.items()}
    s = len(tokens)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w

    pos = np.arange(s)[:, None]
    inv = THETA ** (-np.arange(0, D, 2) / D)
    ang = pos * inv[None, :]                                   # [S, D/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]    # [S, 1, D]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]

    def rope(x):                                               # x [S, heads, D]
        rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + rot * sin

    x = g["model.embed_tokens.weight"][tokens]
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, g[p + "input_layernorm.weight"])
        q = h @ g[p + "self_attn.q_proj.weight"].T
        k = h @ g[p + "self_attn.k_proj.weight"].T
        v = h @ g[p + "self_attn.v_proj.weight"].T
        if arch == "qwen2":
            q = q + g[p + "self_attn.q_proj.bias"]
            k = k + g[p + "self_attn.k_proj.bias"]
            v = v + g[p + "self_attn.v_proj.bias"]
        q = rope(q.reshape(s, NH, D))
        k = rope(k.reshape(s, KVH, D))
        v = v.reshape(s, KVH, D)
        out = np.zeros((s, NH, D))
        for head in range(NH):
            kv = head // (NH // KVH)
            sc = q[:, head] @ k[:, kv].T / np.sqrt(D)
            sc = np.where(np.tril(np.ones((s, s), bool)), sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, head] = pr @ v[:, kv]
        x = x + out.reshape(s, NH * D) @ g[p + "self_attn.o_proj.weight"].T
        h = rms(x, g[p + "post_attention_layernorm.weight"])
        gate = h @ g[p + "mlp.gate_proj.weight"].T
        up = h @ g[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[p + "mlp.down_proj.weight"].T
    x = rms(x, g["model.norm.weight"])
    head = g["model.embed_tokens.weight"] if tied else g["lm_head.weight"]
    return x @ head.T


PAGES = list(range(1, 8))  # 28 tokens of 4-token pages


def _runner(path: Path, tp: int = 1) -> ModelRunner:
    cfg = compose_config(["model=hf_local", f"model.path={path}"])
    eng = OmegaConf.merge(cfg.engine, {"page_size": 4, "num_pages": 32, "max_model_len": 32})
    return ModelRunner(cfg.model, eng, build_mesh(tp))


@pytest.mark.parametrize("arch,tied,tp", [("llama", False, 1), ("qwen2", True, 2),
                                          ("qwen2", True, 4)])  # 2 KV heads on 4: repeated
def test_loaded_checkpoint_matches_numpy_forward(tmp_path, arch, tied, tp):
    tensors = write_random_checkpoint(tmp_path / arch, arch, tied)
    runner = _runner(tmp_path / arch, tp)
    cfg = runner.config
    assert runner.model_config.num_kv_heads == KVH and cfg.num_kv_heads == max(KVH, tp)
    assert (cfg.architecture, cfg.qkv_bias, cfg.tie_word_embeddings) == (arch, arch == "qwen2",
                                                                           tied)
    assert cfg.eos_token_ids == (0, 2) and cfg.name == "hf-local"
    tok = load_tokenizer(cfg)
    prompt = tok.encode("the lazy fox says hello world")
    assert 4 <= len(prompt) <= 24
    ref = numpy_forward(tensors, prompt + [7], arch, tied)
    logits = np.asarray(runner.forward([SeqChunk(prompt, 0, PAGES)]))[0]
    np.testing.assert_allclose(logits, ref[len(prompt) - 1], rtol=2e-4, atol=2e-4)
    assert int(np.argmax(logits)) == int(np.argmax(ref[len(prompt) - 1]))
    step = np.asarray(runner.forward([SeqChunk([7], len(prompt), PAGES)]))[0]
    np.testing.assert_allclose(step, ref[-1], rtol=2e-4, atol=2e-4)


def test_hf_tokenizer_chat_template_and_streaming(tmp_path):
    write_random_checkpoint(tmp_path / "m", "qwen2")
    cfg = model_config_from_cfg({"path": str(tmp_path / "m"), "tokenizer": "hf"})
    tok = load_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size <= V and tok.eos_token_ids == [0, 2]
    text = "hello wörld, 日本語 the quick fox"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    stream = StreamDecoder(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_end|>") == [2]


def test_missing_and_misshaped_tensors_name_file_and_tensor(tmp_path):
    root = tmp_path / "bad"
    tensors = write_random_checkpoint(root, "llama")
    cfg = model_config_from_cfg({"path": str(root)})
    index = json.loads((root / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    part = {n: tensors[n] for n, f in index["weight_map"].items() if f == file}
    part["model.layers.1.mlp.up_proj.weight"] = np.zeros((FF + 1, H), np.float32)
    save_file(part, str(root / file))
    with pytest.raises(ValueError, match=rf"{file}.*model.layers.1.mlp.up_proj.weight.*shape"):
        load_params(cfg, build_mesh(1), np.float32)
    del part["model.layers.1.mlp.up_proj.weight"]
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    save_file(part, str(root / file))
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight.*not found"):
        load_params(cfg, build_mesh(1), np.float32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_config_from_cfg({"path": str(tmp_path)})


def test_unsharded_checkpoint_without_index(tmp_path):
    root = tmp_path / "single"
    tensors = write_random_checkpoint(root, "llama")
    for f in root.glob("model-*.safetensors"):
        f.unlink()
    (root / "model.safetensors.index.json").unlink()
    save_file(tensors, str(root / "model.safetensors"))
    params = load_params(model_config_from_cfg({"path": str(root)}), build_mesh(1), np.float32)
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["wq"]),
                                  tensors["model.layers.1.self_attn.q_proj.weight"].T)
