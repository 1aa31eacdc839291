"""Reading a Hugging Face checkpoint's config.json into ModelConfig fields, refusing what we lack.

Flow: `read_hf_config(dir)` loads config.json (merging generation_config.json's EOS ids);
`refusals(hf, where)` lists every field whose value would change the model's math in a way
pdtopo does not implement (see `REFUSED` and the checks below it); `hf_model_fields` raises the
first as a `CheckpointError` naming the file, key and value, then returns the ModelConfig
fields (`spec.model_config_from_cfg` builds the dataclass): architecture traits from
`ARCH_TRAITS`, RoPE from either config format
(`rope.rope_from_fields`). Values set in the `model:` config group fill only what config.json
lacks; one that contradicts config.json is an error too (the checkpoint's weights were trained
with config.json's values). Only I/O here: reading the two JSON files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdtopo.model_config.architectures import ARCH_TRAITS
from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.rope import rope_from_fields

# HF `architectures` / `model_type` values -> our architecture names.
HF_ARCH = {
    **{traits.hf_class: name for name, traits in ARCH_TRAITS.items()},
    "MistralForCausalLM": "llama",  # Llama math; a sliding window in use is refused below
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
}

SUPPORTED_ACTIVATIONS = (None, "silu", "swish")

# key -> why: refused whenever the value is set to something other than "off"
# (None, False, 0, 1.0 for multipliers, [] / {}).
REFUSED: dict[str, str] = {
    "quantization_config": "quantized checkpoints are not supported (load the unquantized "
                           "weights; engine.dtype picks the serving dtype)",
    "mlp_bias": "biases in the MLP projections are not supported",
    "num_experts": "mixture-of-experts models are not supported",
    "num_local_experts": "mixture-of-experts models are not supported",
    "n_routed_experts": "mixture-of-experts models are not supported",
    "num_experts_per_tok": "mixture-of-experts models are not supported",
    "moe_intermediate_size": "mixture-of-experts models are not supported",
    "n_shared_experts": "mixture-of-experts models are not supported",
    "shared_expert_intermediate_size": "mixture-of-experts models are not supported",
    "attn_logit_softcapping": "attention logit soft-capping is not supported",
    "final_logit_softcapping": "final logit soft-capping is not supported",
    "use_qk_norm": "q/k normalisation is only supported as Qwen3ForCausalLM's per-head RMSNorm",
    "qk_layernorm": "q/k normalisation is only supported as Qwen3ForCausalLM's per-head RMSNorm",
    "attention_chunk_size": "chunked attention is not supported (pdtopo attends to the whole "
                            "context)",
    "no_rope_layers": "layers without RoPE are not supported",
    "embedding_multiplier": "scaled embeddings are not supported",
    "residual_multiplier": "scaled residuals are not supported",
    "attention_multiplier": "a custom attention scale is not supported",
    "logits_scaling": "scaled logits are not supported",
    "logit_scale": "scaled logits are not supported",
}
_MULTIPLIERS = {"embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling", "logit_scale"}

# `model:` group key -> config.json keys that supply it (first present wins)
HF_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "rms_norm_eps": ("rms_norm_eps",),
    "max_position_embeddings": ("max_position_embeddings",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a local HF directory, with generation_config.json's EOS merged in."""
    directory = Path(path)
    cfg_file = directory / "config.json"
    if not directory.is_dir():
        raise FileNotFoundError(f"model.path={str(path)!r} is not a directory")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"model.path={str(path)!r}: config.json not found in {directory}")
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(str(cfg_file), "config.json", str(cfg_file),
                              f"not readable JSON: {e}") from e
    if not isinstance(hf, dict):
        raise CheckpointError(str(cfg_file), "config.json", type(hf).__name__,
                              "expected a JSON object")
    gen_file = directory / "generation_config.json"
    if gen_file.is_file():
        gen = json.loads(gen_file.read_text())
        eos = list(eos_list(hf.get("eos_token_id"))) + list(eos_list(gen.get("eos_token_id")))
        hf["eos_token_id"] = list(dict.fromkeys(eos))
        if hf.get("bos_token_id") is None and gen.get("bos_token_id") is not None:
            hf["bos_token_id"] = gen["bos_token_id"]
    return hf


def hf_architecture(hf: Mapping[str, Any], where: str) -> str:
    names = list(hf.get("architectures") or []) + [hf.get("model_type")]
    for name in names:
        if name in HF_ARCH:
            return HF_ARCH[name]
    key = "architectures" if hf.get("architectures") else "model_type"
    raise CheckpointError(where, key, hf.get(key),
                          f"not a supported model (supported: "
                          f"{', '.join(sorted(k for k in HF_ARCH if k[0].isupper()))})")


def _is_off(key: str, value: Any) -> bool:
    if key in _MULTIPLIERS:
        return value in (None, 1, 1.0)
    return value in (None, False, 0, [], {})


def _sliding_layers(hf: Mapping[str, Any]) -> list[int]:
    """Layers that would use sliding-window attention, as transformers decides it."""
    types = hf.get("layer_types")
    if types is not None:
        return [i for i, t in enumerate(types) if t != "full_attention"]
    window = hf.get("sliding_window")
    if window is None:
        return []
    if "use_sliding_window" in hf:  # Qwen2/Qwen3: the window applies only when switched on
        if not hf["use_sliding_window"]:
            return []
        first = int(hf.get("max_window_layers") or 0)
        return list(range(first, int(hf.get("num_hidden_layers") or 0)))
    return list(range(int(hf.get("num_hidden_layers") or 0)))  # Mistral: every layer


def refusals(hf: Mapping[str, Any], where: str) -> list[CheckpointError]:
    """Every config.json field pdtopo cannot serve exactly (empty: the config is supported)."""
    found = [CheckpointError(where, key, hf[key], why) for key, why in REFUSED.items()
             if key in hf and not _is_off(key, hf[key])]
    for key in ("hidden_act", "hidden_activation"):
        if hf.get(key) not in SUPPORTED_ACTIVATIONS:
            found.append(CheckpointError(where, key, hf[key],
                                         "only the SiLU-gated MLP (hidden_act 'silu') is "
                                         "supported"))
    types = hf.get("layer_types")
    if types is not None:
        other = sorted({t for t in types if t != "full_attention"})
        if other:
            found.append(CheckpointError(where, "layer_types", other,
                                         "only full-attention layers are supported"))
    elif _sliding_layers(hf):
        key = "use_sliding_window" if "use_sliding_window" in hf else "sliding_window"
        found.append(CheckpointError(
            where, key, hf[key],
            f"sliding-window attention in layers {_sliding_layers(hf)} is not supported "
            "(pdtopo attends to the whole context)"))
    heads, hidden, head_dim = (hf.get("num_attention_heads"), hf.get("hidden_size"),
                               hf.get("head_dim"))
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)
                                 or head_dim <= 0):
        found.append(CheckpointError(where, "head_dim", head_dim, "must be a positive integer"))
    elif head_dim is None and heads and hidden and hidden % heads:
        found.append(CheckpointError(
            where, "num_attention_heads", heads,
            f"does not divide hidden_size={hidden} and config.json gives no head_dim"))
    try:
        rope_from_fields(hf, where, int(hf.get("max_position_embeddings") or 0))
    except CheckpointError as e:
        found.append(e)
    return found


def _conflicts(hf: Mapping[str, Any], over: Mapping[str, Any], architecture: str,
               cfg_file: str) -> None:
    """A value set in the `model:` group must agree with config.json's (RoPE's theta from
    either format)."""
    if over.get("architecture") not in (None, architecture):
        raise CheckpointError("model", "model.architecture", over["architecture"],
                              f"conflicts with {cfg_file} (a {architecture} checkpoint); "
                              "leave model.architecture null")
    given = {key: next((hf[k] for k in hf_keys if hf.get(k) is not None), None)
             for key, hf_keys in HF_KEYS.items()}
    if hf.get("rope_theta") is not None or hf.get("rope_parameters") is not None:
        theta = rope_from_fields(hf, cfg_file, int(hf.get("max_position_embeddings") or 0)).theta
        given["rope_theta"] = theta
    for key, theirs in given.items():
        mine = over.get(key)
        hf_key = HF_KEYS.get(key, ("rope_theta",))[0]
        if mine is None or theirs is None:
            continue
        same = float(mine) == float(theirs) if isinstance(theirs, float) else mine == theirs
        if not same:
            raise CheckpointError("model", f"model.{key}", mine,
                                  f"conflicts with {cfg_file}'s {hf_key}={theirs!r}; "
                                  f"leave model.{key} null")


def eos_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def hf_model_fields(path: str | Path, overrides: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """ModelConfig fields from a local HF directory; `overrides` fill keys config.json lacks."""
    over = {k: v for k, v in (overrides or {}).items() if v is not None}
    hf = read_hf_config(path)
    cfg_file = str(Path(path) / "config.json")
    architecture = (hf_architecture(hf, cfg_file)
                    if hf.get("architectures") or hf.get("model_type")
                    else over.get("architecture"))
    if architecture is None:
        raise CheckpointError(cfg_file, "architectures", None,
                              "config.json names no architecture (or set model.architecture)")
    problems = refusals(hf, cfg_file)
    if problems:
        raise problems[0]
    _conflicts(hf, over, architecture, cfg_file)

    def value(key: str, default: Any = None) -> Any:
        for k in HF_KEYS[key]:
            if hf.get(k) is not None:
                return hf[k]
        if key in over:
            return over[key]
        if default is None:
            raise CheckpointError(cfg_file, HF_KEYS[key][0], None,
                                  f"missing (or set model.{key})")
        return default

    hidden, heads = int(value("hidden_size")), int(value("num_heads"))
    traits = ARCH_TRAITS[architecture]
    attention_bias = bool(hf.get("attention_bias", False))
    max_positions = int(value("max_position_embeddings", 4096))
    fields = dict(hf)
    if fields.get("rope_theta") is None and fields.get("rope_parameters") is None:
        fields["rope_theta"] = over.get("rope_theta")
    if fields.get("rope_scaling") is None and fields.get("rope_parameters") is None:
        fields["rope_scaling"] = over.get("rope_scaling")
    return dict(
        name=str(over.get("name") or Path(path).name),
        architecture=architecture,
        vocab_size=int(value("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(value("intermediate_size")),
        num_layers=int(value("num_layers")),
        num_heads=heads,
        num_kv_heads=int(value("num_kv_heads", heads)),
        head_dim=int(value("head_dim", hidden // heads)),
        rope=rope_from_fields(fields, cfg_file, max_positions),
        rms_norm_eps=float(value("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(value("tie_word_embeddings", False)),
        qkv_bias=traits.qkv_bias or attention_bias,
        o_bias=traits.o_bias_from_attention_bias and attention_bias,
        qk_norm=traits.qk_norm,
        eos_token_ids=eos_list(hf.get("eos_token_id", over.get("eos_token_id"))),
        bos_token_id=hf.get("bos_token_id", over.get("bos_token_id")),
        path=str(path),
        init_seed=int(over.get("init_seed", 0)),
        tokenizer=str(over.get("tokenizer", "hf")),
    )
