"""ModelConfig: the shape and hyper-parameters of a Llama-family decoder.

Built from the `model:` config group (`model_config_from_cfg`). When `model.path` names a local
Hugging Face directory, its `config.json` (and `generation_config.json` for EOS ids, if present)
supplies every architectural value; keys set in the `model:` group only fill what config.json
lacks (and `name`, `tokenizer`). With `path: null` every value comes from the group itself
(random-init models such as `tiny_llama`). The result is a frozen dataclass that the model,
loader and runner share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

ARCHITECTURES = ("llama", "qwen2")

# HF `architectures` / `model_type` values -> our architecture names.
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    path: str | None = None
    init_seed: int = 0
    tokenizer: str = "hf"  # "byte" | "hf"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"model.architecture={self.architecture!r} is not supported "
                f"(choose one of {', '.join(ARCHITECTURES)})"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE)")
        if self.tokenizer not in ("byte", "hf"):
            raise ValueError(f"model.tokenizer={self.tokenizer!r}: expected 'byte' or 'hf'")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported (supported: llama3, default)"
                )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _as_dict(model_cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(model_cfg, DictConfig):
        return OmegaConf.to_container(model_cfg, resolve=True)  # type: ignore[return-value]
    return dict(model_cfg)


def _eos_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a local HF directory, with generation_config.json's EOS merged in."""
    directory = Path(path)
    cfg_file = directory / "config.json"
    if not directory.is_dir():
        raise FileNotFoundError(f"model.path={str(path)!r} is not a directory")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"model.path={str(path)!r}: config.json not found in {directory}")
    hf = json.loads(cfg_file.read_text())
    gen_file = directory / "generation_config.json"
    if gen_file.is_file():
        gen = json.loads(gen_file.read_text())
        eos = list(_eos_list(hf.get("eos_token_id"))) + list(_eos_list(gen.get("eos_token_id")))
        hf["eos_token_id"] = list(dict.fromkeys(eos))
        if hf.get("bos_token_id") is None and gen.get("bos_token_id") is not None:
            hf["bos_token_id"] = gen["bos_token_id"]
    return hf


def _hf_architecture(hf: Mapping[str, Any], cfg_file: str) -> str:
    names = list(hf.get("architectures") or []) + [hf.get("model_type")]
    for name in names:
        if name in _HF_ARCH:
            return _HF_ARCH[name]
    raise ValueError(f"{cfg_file}: architectures/model_type {names} is not a supported "
                     f"Llama-family model (supported: {', '.join(sorted(_HF_ARCH))})")


def model_config_from_hf(path: str | Path, overrides: Mapping[str, Any] | None = None
                         ) -> ModelConfig:
    """ModelConfig from a local HF directory; `overrides` fill keys config.json lacks."""
    over = {k: v for k, v in (overrides or {}).items() if v is not None}
    hf = read_hf_config(path)
    cfg_file = str(Path(path) / "config.json")

    def need(key: str, *hf_keys: str) -> Any:
        for k in hf_keys:
            if hf.get(k) is not None:
                return hf[k]
        if key in over:
            return over[key]
        raise KeyError(f"{cfg_file}: missing {' / '.join(hf_keys)} (or set model.{key})")

    architecture = _hf_architecture(hf, cfg_file) if (
        hf.get("architectures") or hf.get("model_type")) else need("architecture")
    hidden = int(need("hidden_size", "hidden_size"))
    heads = int(need("num_heads", "num_attention_heads"))
    head_dim = hf.get("head_dim") or over.get("head_dim") or hidden // heads
    return ModelConfig(
        name=str(over.get("name") or Path(path).name),
        architecture=architecture,
        vocab_size=int(need("vocab_size", "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size", "intermediate_size")),
        num_layers=int(need("num_layers", "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or over.get("num_kv_heads") or heads),
        head_dim=int(head_dim),
        rope_theta=float(hf.get("rope_theta", over.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", over.get("rms_norm_eps", 1e-6))),
        max_position_embeddings=int(hf.get("max_position_embeddings",
                                           over.get("max_position_embeddings", 4096))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                        over.get("tie_word_embeddings", False))),
        # Qwen2 always has q/k/v biases; Llama may declare attention_bias.
        qkv_bias=architecture == "qwen2" or bool(hf.get("attention_bias", False)),
        eos_token_ids=_eos_list(hf.get("eos_token_id", over.get("eos_token_id"))),
        bos_token_id=hf.get("bos_token_id", over.get("bos_token_id")),
        rope_scaling=hf.get("rope_scaling"),
        path=str(path),
        init_seed=int(over.get("init_seed", 0)),
        tokenizer=str(over.get("tokenizer", "hf")),
    )


def model_config_from_cfg(model_cfg: DictConfig | Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from the `model:` config group (reading config.json when `path` is set)."""
    d = {k: v for k, v in _as_dict(model_cfg).items() if v is not None}  # null = unset
    if d.get("path"):
        return model_config_from_hf(d["path"], d)
    missing = [k for k in ("name", "architecture", "vocab_size", "hidden_size",
                           "intermediate_size", "num_layers", "num_heads", "head_dim")
               if d.get(k) is None]
    if missing:
        raise KeyError(f"model config lacks {', '.join('model.' + k for k in missing)} "
                       f"(or set model.path to a Hugging Face directory)")
    return ModelConfig(
        name=str(d["name"]),
        architecture=str(d["architecture"]),
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_layers"]),
        num_heads=int(d["num_heads"]),
        num_kv_heads=int(d.get("num_kv_heads") or d["num_heads"]),
        head_dim=int(d["head_dim"]),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bool(d.get("qkv_bias", d["architecture"] == "qwen2")),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        bos_token_id=d.get("bos_token_id"),
        rope_scaling=d.get("rope_scaling"),
        path=None,
        init_seed=int(d.get("init_seed", 0)),
        tokenizer=str(d.get("tokenizer", "byte")),
    )
