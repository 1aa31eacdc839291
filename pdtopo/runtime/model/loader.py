"""Load Llama / Qwen2 weights from a local Hugging Face directory (safetensors).

Flow: `checkpoint_index(dir)` maps every HF tensor name to its file (through
`model.safetensors.index.json` for sharded checkpoints, else by listing each `*.safetensors`);
`load_params(cfg, mesh, dtype)` walks our parameter tree (`llama.param_shapes`), reads each
tensor by its HF name (`hf_name_map`), checks its shape against config.json, transposes
linear weights from HF's `[out, in]` to our `[in, out]`, casts to `dtype` and places it on the
mesh with its tensor-parallel sharding. Errors name the directory, file and tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pdtopo.runtime.model import llama
from pdtopo.runtime.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"

# our layer key -> (HF suffix under model.layers.N., transpose)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def hf_name_map(cfg: ModelConfig) -> dict[tuple, tuple[str, bool]]:
    """Our parameter path (tuple of keys) -> (HF tensor name, transpose?)."""
    names: dict[tuple, tuple[str, bool]] = {
        ("embed",): ("model.embed_tokens.weight", False),
        ("final_norm",): ("model.norm.weight", False),
    }
    if not cfg.tie_word_embeddings:
        names[("lm_head",)] = ("lm_head.weight", True)
    for i in range(cfg.num_layers):
        for key in llama.layer_param_shapes(cfg):
            suffix, transpose = _LAYER_NAMES[key]
            names[("layers", i, key)] = (f"model.layers.{i}.{suffix}", transpose)
    return names


def checkpoint_index(directory: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no 'weight_map'): {e}") from e
        out = {}
        for name, file in weight_map.items():
            path = directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{index}: tensor {name!r} maps to missing file {path}")
            out[name] = path
        return out
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.path={str(directory)!r}: no *.safetensors files "
                                f"(and no {INDEX_FILE})")
    out = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = path
    return out


class _Reader:
    """Opens each safetensors file once and reads tensors by name."""

    def __init__(self, directory: Path, index: dict[str, Path]):
        self.directory, self.index, self._open = directory, index, {}

    def read(self, name: str) -> tuple[np.ndarray, Path]:
        from safetensors import safe_open

        path = self.index.get(name)
        if path is None:
            files = sorted({p.name for p in self.index.values()})
            raise KeyError(f"model.path={str(self.directory)!r}: tensor {name!r} not found in "
                           f"{', '.join(files)}")
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="numpy")
        handle = self._open[path]
        try:
            return handle.get_tensor(name), path
        except Exception as e:  # the index may promise a tensor the file lacks
            raise KeyError(f"{path}: cannot read tensor {name!r} listed in the index: {e}") from e

    def close(self) -> None:
        for handle in self._open.values():
            close = getattr(handle, "__exit__", None)
            if close is not None:
                close(None, None, None)
        self._open.clear()


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_host_params(cfg: ModelConfig, directory: str | Path | None = None) -> llama.Params:
    """Parameters as float32/bf16 NumPy arrays in our layout (no device placement)."""
    directory = Path(directory or cfg.path or "")
    index = checkpoint_index(directory)
    reader = _Reader(directory, index)
    shapes = llama.param_shapes(cfg)
    params: llama.Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    try:
        for path, (name, transpose) in hf_name_map(cfg).items():
            array, file = reader.read(name)
            expected = tuple(_get(shapes, path))
            hf_expected = expected[::-1] if transpose else expected
            if tuple(array.shape) != hf_expected:
                raise ValueError(
                    f"{file}: tensor {name!r} has shape {tuple(array.shape)}, expected "
                    f"{hf_expected} from {directory / 'config.json'}")
            _set(params, path, np.ascontiguousarray(array.T) if transpose else array)
    finally:
        reader.close()
    return params


def load_params(cfg: ModelConfig, mesh: Mesh, dtype: Any) -> llama.Params:
    """Read the checkpoint of `cfg.path` and place it on `mesh` (tensor-parallel shardings)."""
    host = load_host_params(cfg)
    shardings = llama.param_shardings(cfg, mesh)
    return jax.tree.map(lambda a, s: jax.device_put(np.asarray(a).astype(dtype), s),
                        host, shardings)
