"""GGUF tensors as Hugging Face tensors: names, float32 values, and llama.cpp's Q/K row order
undone.

`hf_tensor_name("blk.3.attn_q.weight")` -> "model.layers.3.self_attn.q_proj.weight" (None for a
tensor no supported decoder has). llama.cpp's converter reorders the rows of a Llama model's Q and
K projections: within each head it interleaves the two rotary halves' rows (x0, y0, x1, y1, ...)
where Hugging Face keeps them apart (x0, x1, ..., y0, y1, ...);
`unpermute_rows(w, heads)` puts each head's rows back in HF's order (Qwen files are written
without the reorder). `hf_tensors(file, arch)` yields (HF name, float32 array) one tensor at a
time, in the file's order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from pdtopo.model_config.sources.gguf_reading import GgufFile

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def layer_of(name: str) -> int | None:
    """The block a GGUF tensor belongs to (None: embeddings, final norm, output)."""
    m = _BLOCK.fullmatch(name)
    return int(m.group(1)) if m else None


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary row order of a Q or K projection (weight or bias)."""
    rows = w.shape[0]
    half = rows // heads // 2
    grouped = w.reshape(heads, half, 2, *w.shape[1:])  # stored: pairs interleaved
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(w.shape))


def hf_tensors(file: GgufFile, arch: str, names: list[str] | None = None
               ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for each tensor of `names` (default: all, in file order)."""
    heads = int(file.metadata[f"{arch}.attention.head_count"])
    kv_heads = int(file.metadata.get(f"{arch}.attention.head_count_kv", heads))
    for name in names if names is not None else list(file.tensors):
        values = file.dequantize(name)
        if arch == "llama" and ".attn_q." in name:
            values = unpermute_rows(values, heads)
        elif arch == "llama" and ".attn_k." in name:
            values = unpermute_rows(values, kv_heads)
        yield hf_tensor_name(name) or name, values
