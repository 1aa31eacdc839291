"""Tiny GGUF files written with the `gguf` library, laid out as llama.cpp's converter writes them.

`write_tiny_gguf(path, ...)` draws a small Llama/Qwen decoder in Hugging Face's layout (seeded,
std 1/sqrt(fan_in)), applies llama.cpp's Q/K row reorder for Llama (`llama_cpp_permute`),
quantizes each tensor to the type `TYPES` gives it (seven types across the block formats and
the floats), and writes it with metadata (shape, RoPE, norm eps) and a byte-level BPE tokenizer
trained with `tokenizers` (vocabulary, merges, control tokens, BOS/EOS, a ChatML template).
`meta` adds or overrides metadata keys and `extra_tensors` adds tensors, so a test can write
what pdtopo must refuse. Returns the HF-layout float32 weights it drew.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.hf_checkpoints import CHAT_SPECIALS, train_byte_bpe

VOCAB = 320
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = CHAT_SPECIALS  # <|endoftext|>, <|im_start|>, <|im_end|>: ids 0, 1, 2
CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "the quick brown fox jumps over the lazy dog; hello world, how are you today?",
    "Tell me a story about a cat who likes numbers 0123456789 and 2024-12-03.",
    "  indented code:\n\tdef f(x):\n        return x ** 2\n",
] * 8
# GGUF tensor suffix -> quantization type name (norms stay F32, as llama.cpp writes them)
TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q4_1",
    "attn_q.weight": "Q8_0",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q4_1",
    "attn_output.weight": "Q5_0",
    "ffn_gate.weight": "Q5_1",
    "ffn_up.weight": "F16",
    "ffn_down.weight": "BF16",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, interleave the two rotary halves' rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)



def _hf_weights(arch: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
                inter: int, layers: int, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": lin(VOCAB, hidden), "output_norm.weight": norm(hidden)}
    if not tied:
        w["output.weight"] = lin(VOCAB, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": norm(hidden), b + "ffn_norm.weight": norm(hidden),
              b + "attn_q.weight": lin(heads * head_dim, hidden),
              b + "attn_k.weight": lin(kv_heads * head_dim, hidden),
              b + "attn_v.weight": lin(kv_heads * head_dim, hidden),
              b + "attn_output.weight": lin(hidden, heads * head_dim),
              b + "ffn_gate.weight": lin(inter, hidden), b + "ffn_up.weight": lin(inter, hidden),
              b + "ffn_down.weight": lin(hidden, inter)}
        if arch == "qwen2":
            w |= {b + f"attn_{x}.bias": (0.1 * rng.standard_normal(n)).astype(np.float32)
                  for x, n in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                               ("v", kv_heads * head_dim))}
        if arch == "qwen3":
            w |= {b + "attn_q_norm.weight": norm(head_dim), b + "attn_k_norm.weight": norm(head_dim)}
    return w


def write_tiny_gguf(path: Path, *, arch: str = "llama", hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, inter: int = 128, layers: int = 2, tied: bool = False,
                    seed: int = 0, meta: dict[str, Any] | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    tokenizer_model: str = "gpt2",
                    type_overrides: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    import gguf
    from gguf import GGMLQuantizationType as Q

    head_dim = hidden // heads
    weights = _hf_weights(arch, hidden, heads, kv_heads, head_dim, inter, layers, tied, seed)
    tok = train_byte_bpe(CORPUS, SPECIALS, VOCAB)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merges = [" ".join(m) if isinstance(m, list) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, value in {**weights, **(extra_tensors or {})}.items():
        stored = value
        if arch == "llama" and ".attn_q." in name:
            stored = llama_cpp_permute(value, heads)
        elif arch == "llama" and ".attn_k." in name:
            stored = llama_cpp_permute(value, kv_heads)
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        qtype = Q[{**TYPES, **(type_overrides or {})}.get(suffix, "F32")]
        if qtype == Q.F32:
            writer.add_tensor(name, stored)
        elif qtype == Q.F16:
            writer.add_tensor(name, stored.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(stored, qtype)
            except NotImplementedError:  # a type the library cannot write (Q8_1): blocks of
                block, size = gguf.constants.GGML_QUANT_SIZES[qtype]  # the right size suffice
                data = np.zeros((stored.shape[0], stored.shape[1] // block * size), np.uint8)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
