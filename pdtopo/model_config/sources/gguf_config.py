"""A GGUF file's metadata as a Hugging Face config.json, refusing what pdtopo does not implement.

GGUF keeps the model's shape under llama.cpp's names, prefixed by the architecture
(`llama.block_count`, `llama.attention.head_count_kv`, ...). `hf_config(file)` maps them to the
config.json keys `model_config/hf.py` reads; `gguf_refusals(file)` lists every key, value or
tensor that would change the math in a way pdtopo does not serve (another architecture, RoPE
scaling, sliding windows, experts, a partial rotary width, an unknown tensor, a quantization type
the converter cannot read), each a CheckpointError naming the file, key and value. Pure functions
of the parsed file.
"""

from __future__ import annotations

from typing import Any

from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.sources.gguf_reading import SUPPORTED_TYPES, GgufFile
from pdtopo.model_config.sources.gguf_weights import hf_tensor_name

# GGUF architecture -> (HF class, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# metadata key (after the architecture prefix) -> why it is refused when set to a live value
_REFUSED = {
    "expert_count": "mixture-of-experts models are not supported",
    "attention.sliding_window": "sliding-window attention is not supported (pdtopo attends to "
                                "the whole context)",
    "rope.scaling.type": "RoPE scaling is not supported for GGUF files (load the Hugging Face "
                         "checkpoint: config.json's rope_scaling is)",
    "logit_scale": "scaled logits are not supported",
    "attn_logit_softcapping": "attention logit soft-capping is not supported",
    "final_logit_softcapping": "final logit soft-capping is not supported",
}
_OFF = (None, 0, 0.0, "none", False)


def architecture(file: GgufFile) -> str:
    arch = file.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(str(file.path), "general.architecture", arch,
                              f"not a supported GGUF architecture (supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)})")
    return str(arch)


def _key(file: GgufFile, arch: str, name: str, default: Any = None) -> Any:
    value = file.metadata.get(f"{arch}.{name}", default)
    if value is None:
        raise CheckpointError(str(file.path), f"{arch}.{name}", None, "missing from the metadata")
    return value


def gguf_refusals(file: GgufFile) -> list[CheckpointError]:
    """Everything in `file` that pdtopo cannot serve exactly (empty: supported)."""
    where = str(file.path)
    try:
        arch = architecture(file)
    except CheckpointError as e:
        return [e]
    found = [CheckpointError(where, f"{arch}.{key}", file.metadata[f"{arch}.{key}"], why)
             for key, why in _REFUSED.items()
             if file.metadata.get(f"{arch}.{key}") not in _OFF]
    heads = file.metadata.get(f"{arch}.attention.head_count")
    hidden = file.metadata.get(f"{arch}.embedding_length")
    head_dim = file.metadata.get(f"{arch}.attention.key_length") or (
        hidden // heads if heads and hidden else None)
    rotary = file.metadata.get(f"{arch}.rope.dimension_count")
    if rotary is not None and head_dim and rotary != head_dim:
        found.append(CheckpointError(where, f"{arch}.rope.dimension_count", rotary,
                                     f"partial rotary embeddings are not supported (head_dim "
                                     f"{head_dim})"))
    value_dim = file.metadata.get(f"{arch}.attention.value_length")
    if value_dim is not None and head_dim and value_dim != head_dim:
        found.append(CheckpointError(where, f"{arch}.attention.value_length", value_dim,
                                     f"a value head size other than the key's ({head_dim}) is "
                                     "not supported"))
    for name, type_name in file.unsupported_types().items():
        found.append(CheckpointError(where, f"tensor {name} type", type_name,
                                     f"not a supported quantization type (supported: "
                                     f"{', '.join(SUPPORTED_TYPES)})"))
    for name in file.tensors:
        if arch == "llama" and name.endswith(".bias"):
            found.append(CheckpointError(where, "tensor", name, "attention biases in a llama "
                                         "GGUF file are not supported"))
        elif hf_tensor_name(name) is None:
            found.append(CheckpointError(where, "tensor", name,
                                         "not a tensor of a Llama/Qwen2/Qwen3 decoder pdtopo "
                                         "implements (rope_freqs: RoPE scaling; others: "
                                         "another block layout)"))
    return found


def hf_config(file: GgufFile) -> dict[str, Any]:
    """config.json for the model in `file` (call after `gguf_refusals` came back empty)."""
    arch = architecture(file)
    meta = file.metadata
    heads = int(_key(file, arch, "attention.head_count"))
    hidden = int(_key(file, arch, "embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise CheckpointError(str(file.path), f"{arch}.vocab_size", None,
                              "missing (and no tokenizer.ggml.tokens to count)")
    hf_class, model_type = GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_key(file, arch, "feed_forward_length")),
        "num_hidden_layers": int(_key(file, arch, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_key(file, arch, "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_key(file, arch, "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        if meta.get(f"tokenizer.ggml.{theirs}") is not None:
            config[ours] = int(meta[f"tokenizer.ggml.{theirs}"])
    return config
