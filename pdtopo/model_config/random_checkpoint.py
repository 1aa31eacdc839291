"""A small random-initialised HF-format checkpoint written to a local directory, for tests and
benchmarks that need a real checkpoint and a real tokenizer without downloading anything.

    write_random_checkpoint(root, arch="qwen2", tied=False, seed=0) -> {tensor name: array}

It writes what a hub checkpoint has: safetensors shards with their index, config.json,
generation_config.json, a byte-level BPE tokenizer.json trained here on a built-in corpus
(`tokenizers`), and tokenizer_config.json with a chat template. Weights are drawn from `seed`
(Llama or Qwen2 layout; Qwen2 adds q/k/v biases) and returned, so a test can compare a forward
pass against its own reference. The shapes are the module constants below.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, show_progress=False, special_tokens=["<|endoftext|>",
                                  "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))


def write_random_checkpoint(root: Path, arch: str = "qwen2", tied: bool = False,
                            seed: int = 0) -> dict[str, np.ndarray]:
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
