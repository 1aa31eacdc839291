"""Load Llama / Qwen2 / Qwen3 weights from a local Hugging Face directory (safetensors).

Flow: `load_params(cfg, mesh, dtype)` checks the checkpoint's tensors against config.json
(`checkpoint.check_tensors`: names and shapes from the headers, nothing left over), then walks
our parameter tree (`hf_name_map`), reads each tensor by its HF name, transposes linear weights
from HF's `[out, in]` to our `[in, out]`, casts to `dtype` and places it on the mesh with its
tensor-parallel sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pdtopo.model_config.spec import ModelConfig
from pdtopo.model_config.tensors import (
    TensorReader,
    check_tensors,
    checkpoint_index,
    hf_name_map,
)
from pdtopo.runtime.model import llama


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_host_params(cfg: ModelConfig, directory: str | Path | None = None) -> llama.Params:
    """Parameters as float32/bf16 NumPy arrays in our layout (no device placement)."""
    directory = Path(directory or cfg.path or "")
    params: llama.Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    with TensorReader(directory, checkpoint_index(directory)) as reader:
        check_tensors(cfg, reader)
        for path, (name, transpose) in hf_name_map(cfg).items():
            array = reader.read(name)
            _set(params, path, np.ascontiguousarray(array.T) if transpose else array)
    return params


def load_params(cfg: ModelConfig, mesh: Mesh, dtype: Any) -> llama.Params:
    """Read the checkpoint of `cfg.path` and place it on `mesh` (tensor-parallel shardings;
    KV heads repeated where the mesh has more tp devices than the model has KV heads)."""
    tp = int(mesh.shape["tp"])
    host = llama.replicate_kv_heads(load_host_params(cfg), cfg, llama.kv_replication(cfg, tp))
    shardings = llama.param_shardings(llama.serving_config(cfg, tp), mesh)
    return jax.tree.map(lambda a, s: jax.device_put(np.asarray(a).astype(dtype), s),
                        host, shardings)
