"""ModelConfig: the shape and hyper-parameters of a Llama-family decoder (Llama, Qwen2, Qwen3).

Built from the `model:` config group (`model_config_from_cfg`). When `model.path` names a local
Hugging Face directory (or a GGUF file, or `model.package` a packaged one: fetched and
converted into a cached directory first, `pdtopo.model_config.sources`), its `config.json` supplies every
architectural value
(`pdtopo.model_config.hf`, which refuses what pdtopo does not implement); keys set in the
`model:` group only fill what config.json lacks (and `name`, `tokenizer`). With `path: null`
every value comes from the group itself (random-init models such as `tiny_llama`). The result is
a frozen dataclass that the model, loader and runner share. `ARCH_TRAITS` says what each
architecture adds to the Llama block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pdtopo.model_config.architectures import ARCH_TRAITS, ARCHITECTURES
from pdtopo.model_config.hf import eos_list, hf_model_fields
from pdtopo.model_config.rope import RopeConfig, rope_from_fields
from pdtopo.model_config.sources.resolve import is_gguf, local_model_path, source_path


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
    rope: RopeConfig = field(default_factory=RopeConfig)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def hf_class(self) -> str:
        return ARCH_TRAITS[self.architecture].hf_class


def _as_dict(model_cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(model_cfg, DictConfig):
        return OmegaConf.to_container(model_cfg, resolve=True)  # type: ignore[return-value]
    return dict(model_cfg)


def model_config_from_cfg(model_cfg: DictConfig | Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from the `model:` config group (reading config.json when `path` is set)."""
    d = {k: v for k, v in _as_dict(model_cfg).items() if v is not None}  # null = unset
    local = local_model_path(d)  # fetches / converts on first use (model_config.sources)
    if local:
        source = source_path(d, fetch=False)
        if is_gguf(source) and not d.get("name"):  # not the cache directory's hashed name
            d["name"] = Path(str(source)).stem
        return ModelConfig(**hf_model_fields(local, d))
    missing = [k for k in ("name", "architecture", "vocab_size", "hidden_size",
                           "intermediate_size", "num_layers", "num_heads", "head_dim")
               if d.get(k) is None]
    if missing:
        raise KeyError(f"model config lacks {', '.join('model.' + k for k in missing)} "
                       f"(or set model.path to a Hugging Face directory)")
    arch = str(d["architecture"])
    traits = ARCH_TRAITS.get(arch)
    max_positions = int(d.get("max_position_embeddings", 4096))
    return ModelConfig(
        name=str(d["name"]),
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_layers"]),
        num_heads=int(d["num_heads"]),
        num_kv_heads=int(d.get("num_kv_heads") or d["num_heads"]),
        head_dim=int(d["head_dim"]),
        rope=rope_from_fields(d, "model", max_positions),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bool(d.get("qkv_bias", traits.qkv_bias if traits else False)),
        o_bias=bool(d.get("o_bias", False)),
        qk_norm=bool(traits.qk_norm) if traits else False,
        eos_token_ids=eos_list(d.get("eos_token_id")),
        bos_token_id=d.get("bos_token_id"),
        path=None,
        init_seed=int(d.get("init_seed", 0)),
        tokenizer=str(d.get("tokenizer", "byte")),
    )
