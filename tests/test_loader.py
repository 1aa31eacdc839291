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
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, SeqChunk
from pdtopo.runtime.model.loader import load_host_params
from pdtopo.runtime.model.tokenizer import HFTokenizer, StreamDecoder, load_tokenizer

V, H, FF, L, NH, KVH, D = 320, 32, 48, 2, 4, 2, 8
THETA, EPS = 500.0, 1e-6
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld",
          "pdtopo serves tiny models", "paged attention reads pages", "日本語のテキスト"] * 5
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_tensors(arch: str, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": norm(H)}
    if not tied:
        t["lm_head.weight"] = w(V, H)
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "self_attn.q_proj.weight"] = w(NH * D, H)
        t[p + "self_attn.k_proj.weight"] = w(KVH * D, H)
        t[p + "self_attn.v_proj.weight"] = w(KVH * D, H)
        t[p + "self_attn.o_proj.weight"] = w(H, NH * D)
        t[p + "mlp.gate_proj.weight"] = w(FF, H)
        t[p + "mlp.up_proj.weight"] = w(FF, H)
        t[p + "mlp.down_proj.weight"] = w(H, FF)
        if arch == "qwen2":
            for n, size in (("q", NH * D), ("k", KVH * D), ("v", KVH * D)):
                t[p + f"self_attn.{n}_proj.bias"] = (0.2 * rng.standard_normal(size)).astype(
                    np.float32)
    return t


def _train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, show_progress=False, special_tokens=["<|endoftext|>",
                                  "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(root: Path, arch: str, tied: bool = False, seed: int = 0) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(arch, tied, seed)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(root / file))
        weight_map.update({n: file for n in part})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch, "vocab_size": V, "hidden_size": H, "intermediate_size": FF,
        "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": KVH,
        "rope_theta": THETA, "rms_norm_eps": EPS, "max_position_embeddings": 256,
        "tie_word_embeddings": tied, "eos_token_id": 0, "bos_token_id": None,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _train_tokenizer(root)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return tensors


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
    tensors = make_checkpoint(tmp_path / arch, arch, tied)
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
    make_checkpoint(tmp_path / "m", "qwen2")
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
    tensors = make_checkpoint(root, "llama")
    cfg = model_config_from_cfg({"path": str(root)})
    index = json.loads((root / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    part = {n: tensors[n] for n, f in index["weight_map"].items() if f == file}
    part["model.layers.1.mlp.up_proj.weight"] = np.zeros((FF + 1, H), np.float32)
    save_file(part, str(root / file))
    with pytest.raises(ValueError, match=rf"{file}.*model.layers.1.mlp.up_proj.weight.*shape"):
        load_host_params(cfg)
    del part["model.layers.1.mlp.up_proj.weight"]
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    save_file(part, str(root / file))
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight.*not found"):
        load_host_params(cfg)
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_config_from_cfg({"path": str(tmp_path)})


def test_unsharded_checkpoint_without_index(tmp_path):
    root = tmp_path / "single"
    tensors = make_checkpoint(root, "llama")
    for f in root.glob("model-*.safetensors"):
        f.unlink()
    (root / "model.safetensors.index.json").unlink()
    save_file(tensors, str(root / "model.safetensors"))
    params = load_host_params(model_config_from_cfg({"path": str(root)}))
    np.testing.assert_array_equal(params["layers"][1]["wq"],
                                  tensors["model.layers.1.self_attn.q_proj.weight"].T)
