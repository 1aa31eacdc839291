"""What each supported architecture adds to the Llama decoder block (pure data).

`ARCH_TRAITS[name]` is read by the config readers (`spec.py`, `hf.py`) to fill a
ModelConfig's switches (biases, q/k norm) and by the API to report the HF class name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchTraits:
    hf_class: str                     # the HF `architectures` entry
    qkv_bias: bool                    # q/k/v biases always present (else: attention_bias)
    o_bias_from_attention_bias: bool  # attention_bias also biases o_proj
    qk_norm: bool                     # per-head RMSNorm on q and k before RoPE


ARCH_TRAITS: dict[str, ArchTraits] = {
    "llama": ArchTraits("LlamaForCausalLM", qkv_bias=False, o_bias_from_attention_bias=True,
                        qk_norm=False),
    "qwen2": ArchTraits("Qwen2ForCausalLM", qkv_bias=True, o_bias_from_attention_bias=False,
                        qk_norm=False),
    "qwen3": ArchTraits("Qwen3ForCausalLM", qkv_bias=False, o_bias_from_attention_bias=True,
                        qk_norm=True),
}
ARCHITECTURES = tuple(ARCH_TRAITS)
