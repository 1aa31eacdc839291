"""Load Llama / Qwen2 / Qwen3 weights from a local Hugging Face directory (safetensors), streamed
straight into each device's shard.

Flow: `load_params(cfg, mesh, dtype)` checks the checkpoint's tensors against config.json
(`checkpoint.check_tensors`: names and shapes from the headers, nothing left over), then for each
parameter of our tree (`hf_name_map`) builds the sharded array with
`jax.make_array_from_callback`: for every device this process holds, the callback slices that
device's block out of a lazy view of the file (`TensorReader.view`, a memory map), transposes
linear weights from HF's `[out, in]` to our `[in, out]` and casts to `dtype` in one copy of that
block alone. KV heads repeated for tp (`llama.kv_replication`) are read by index from the
model's heads (`llama.kv_replica_columns`); devices holding the same block (replicated
parameters) share one copy. So host memory holds about one tensor's blocks at a time on top of
what the devices keep, and a process of a multi-process instance reads only the blocks of its
own devices. Checkpoints in float32, bfloat16 and float16 load alike (cast per block). Progress goes to the log every
tenth of the tensors (`loading weights: x/y tensors`).
"""

from __future__ import annotations

import logging
import time
from functools import partial
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
    tree_get,
)
from pdtopo.runtime.model import llama

log = logging.getLogger(__name__)


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def read_block(source: np.ndarray, index: tuple, *, transpose: bool,
               columns: np.ndarray | None, dtype: Any) -> np.ndarray:
    """One device's block of a parameter: `index` (slices over our layout) applied to the
    stored tensor `source` (HF layout: transposed for linear weights; output columns mapped
    through `columns` when KV heads are repeated), cast to `dtype`."""
    idx = list(index)
    if columns is not None:
        idx[-1] = columns[idx[-1]]
    if transpose:
        block = source[idx[1], idx[0]] if columns is None else source[idx[1]][:, idx[0]]
        block = block.T
    else:
        block = source[tuple(idx)]
    return np.array(block, dtype=dtype, order="C")


def _once_per_block(read):
    """`read` memoised by block: devices that hold the same block (a replicated parameter)
    share one host copy instead of one each."""
    blocks: dict[str, np.ndarray] = {}

    def cached(index: tuple) -> np.ndarray:
        key = repr(index)
        if key not in blocks:
            blocks[key] = read(index)
        return blocks[key]

    return cached


def load_params(cfg: ModelConfig, mesh: Mesh, dtype: Any) -> llama.Params:
    """Read the checkpoint of `cfg.path` into arrays on `mesh` (tensor-parallel shardings; KV
    heads repeated where the mesh has more tp devices than the model has KV heads)."""
    directory = Path(cfg.path or "")
    tp = int(mesh.shape["tp"])
    r = llama.kv_replication(cfg, tp)
    serving = llama.serving_config(cfg, tp)
    shapes, shardings = llama.param_shapes(serving), llama.param_shardings(serving, mesh)
    columns = llama.kv_replica_columns(cfg, r) if r > 1 else None
    params: llama.Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    t0 = time.perf_counter()
    with TensorReader(directory, checkpoint_index(directory)) as reader:
        check_tensors(cfg, reader)
        names = hf_name_map(cfg)
        every = max(1, len(names) // 10)
        for n, (path, (name, transpose)) in enumerate(names.items(), 1):
            read = partial(read_block, reader.view(name), transpose=transpose,
                           columns=columns if path[-1] in llama.KV_KEYS else None, dtype=dtype)
            _set(params, path, jax.make_array_from_callback(
                tuple(tree_get(shapes, path)), tree_get(shardings, path), _once_per_block(read)))
            if n % every == 0 or n == len(names):
                log.info("loading weights: %d/%d tensors (%.1fs)", n, len(names),
                         time.perf_counter() - t0)
    return params
