"""A safetensors checkpoint's tensors, checked against the model's parameter tree (no JAX).

Flow: `checkpoint_index(dir)` maps every HF tensor name to its file (through
`model.safetensors.index.json` for sharded checkpoints, else by listing each `*.safetensors`);
`hf_name_map(cfg)` maps our parameter paths to HF names; `check_checkpoint(cfg)` reads only the
files' headers and refuses a missing tensor, a shape that disagrees with config.json, or a tensor
the config does not account for (a bias, a norm, an extra layer: config.json and the weights
describe different models). The launcher's pre-flight runs it before starting anything; the
loader (`loader.py`) runs it again before reading the data. Errors name the directory, file and
tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pdtopo.model_config.safetensors_view import SafetensorsFile
from pdtopo.model_config.shapes import layer_param_shapes, param_shapes
from pdtopo.model_config.spec import ModelConfig

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
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "wo": ("self_attn.o_proj.weight", True),
    "bo": ("self_attn.o_proj.bias", False),
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
        for key in layer_param_shapes(cfg):
            suffix, transpose = _LAYER_NAMES[key]
            names[("layers", i, key)] = (f"model.layers.{i}.{suffix}", transpose)
    return names


def checkpoint_index(directory: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
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
        for name in SafetensorsFile(path).names():
            out[name] = path
    return out


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that do not take part in the forward pass."""
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight")  # tied: the embedding is used


def unused_tensors(cfg: ModelConfig, index: dict[str, Path]) -> list[str]:
    """Checkpoint tensors that the model of `cfg` would not read."""
    wanted = {name for name, _ in hf_name_map(cfg).values()}
    return sorted(n for n in index if n not in wanted and not _ignorable(n, cfg))


class TensorReader:
    """Opens each safetensors file once; a tensor's shape from the header, its data as a lazy
    view (`view`: bytes are read only where it is sliced)."""

    def __init__(self, directory: Path, index: dict[str, Path]):
        self.directory, self.index = directory, index
        self._open: dict[Path, SafetensorsFile] = {}

    def _handle(self, name: str) -> tuple[SafetensorsFile, Path]:
        path = self.index.get(name)
        if path is None:
            files = sorted({p.name for p in self.index.values()})
            raise KeyError(f"model.path={str(self.directory)!r}: tensor {name!r} not found in "
                           f"{', '.join(files)}")
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path], path

    def shape(self, name: str) -> tuple[tuple[int, ...], Path]:
        """The tensor's shape from its file's header (no data read)."""
        handle, path = self._handle(name)
        try:
            return handle.shape(name), path
        except KeyError as e:  # the index may promise a tensor the file lacks
            raise KeyError(f"{path}: cannot read tensor {name!r} listed in the index: {e}") from e

    def view(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype, as a read-only view of its file."""
        handle, path = self._handle(name)
        try:
            return handle.view(name)
        except KeyError as e:
            raise KeyError(f"{path}: cannot read tensor {name!r} listed in the index: {e}") from e

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()


def tree_get(tree: Any, path: tuple) -> Any:
    """The leaf at `path` (a tuple of keys) of a parameter tree."""
    for key in path:
        tree = tree[key]
    return tree


def check_tensors(cfg: ModelConfig, reader: TensorReader) -> None:
    """Refuse missing, misshaped and left-over tensors (headers only)."""
    directory, index = reader.directory, reader.index
    extra = unused_tensors(cfg, index)
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise ValueError(
            f"model.path={str(directory)!r}: the checkpoint holds tensors that "
            f"{directory / 'config.json'} does not account for ({shown}): config.json and the "
            "weights describe different models, or the model uses a feature pdtopo does not "
            "implement")
    shapes = param_shapes(cfg)
    for path, (name, transpose) in hf_name_map(cfg).items():
        ours = tuple(tree_get(shapes, path))
        expected = ours[::-1] if transpose else ours  # HF stores linear weights [out, in]
        shape, file = reader.shape(name)
        if shape != expected:
            raise ValueError(f"{file}: tensor {name!r} has shape {shape}, expected {expected} "
                             f"from {directory / 'config.json'}")


def check_checkpoint(cfg: ModelConfig, directory: str | Path | None = None) -> None:
    """Every tensor the model needs is there with its shape, and none is left over; reads the
    safetensors headers only (the launcher's pre-flight calls this)."""
    directory = Path(directory or cfg.path or "")
    with TensorReader(directory, checkpoint_index(directory)) as reader:
        check_tensors(cfg, reader)
