"""A small random-initialised HF-format checkpoint written to a local directory, for tests and
benchmarks that need a real checkpoint and a real tokenizer without downloading anything.

    write_random_checkpoint(root, arch="qwen2", tied=False, seed=0, shape=TINY)
        -> {tensor name: array}

It writes what a hub checkpoint has: safetensors shards with their index, config.json,
generation_config.json, a byte-level BPE tokenizer.json trained here on a built-in corpus
(`tokenizers`), and tokenizer_config.json with a chat template. Weights are drawn from `seed`
(Llama or Qwen2 layout; Qwen2 adds q/k/v biases) and returned, so a test can compare a forward
pass against its own reference. The shapes are the module constants below (`TINY`), or another
`CheckpointShape` such as `SMOLLM2_135M` (SmolLM2-135M's dimensions, for start-up benchmarks);
the tokenizer keeps its small vocabulary either way (config.json's vocab_size may be larger).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

V, H, FF, L, NH, KVH, D = 320, 32, 48, 2, 4, 2, 8
THETA, EPS = 500.0, 1e-6


@dataclass(frozen=True)
class CheckpointShape:
    """Dimensions of a Llama/Qwen2 checkpoint (head_dim: hidden // heads, as config.json
    implies when it names none)."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = CheckpointShape(V, H, FF, L, NH, KVH, THETA)  # head_dim H // NH = D
SMOLLM2_135M = CheckpointShape(vocab=49152, hidden=576, ffn=1536, layers=30, heads=9,  # 135 M
                               kv_heads=3, rope_theta=100000.0)
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld",
          "pdtopo serves tiny models", "paged attention reads pages", "日本語のテキスト"] * 5
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_tensors(arch: str, tied: bool, seed: int, s: CheckpointShape) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(s.vocab, s.hidden), "model.norm.weight": norm(s.hidden)}
    if not tied:
        t["lm_head.weight"] = w(s.vocab, s.hidden)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(s.hidden)
        t[p + "post_attention_layernorm.weight"] = norm(s.hidden)
        t[p + "self_attn.q_proj.weight"] = w(q, s.hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv, s.hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv, s.hidden)
        t[p + "self_attn.o_proj.weight"] = w(s.hidden, q)
        t[p + "mlp.gate_proj.weight"] = w(s.ffn, s.hidden)
        t[p + "mlp.up_proj.weight"] = w(s.ffn, s.hidden)
        t[p + "mlp.down_proj.weight"] = w(s.hidden, s.ffn)
        if arch == "qwen2":
            for n, size in (("q", q), ("k", kv), ("v", kv)):
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
                            seed: int = 0, shape: CheckpointShape = TINY
                            ) -> dict[str, np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(arch, tied, seed, shape)
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
        "model_type": arch, "vocab_size": shape.vocab, "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "rope_theta": shape.rope_theta, "rms_norm_eps": EPS,
        "max_position_embeddings": 256 if shape == TINY else 8192,
        "tie_word_embeddings": tied, "eos_token_id": 0, "bos_token_id": None,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _train_tokenizer(root)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return tensors
