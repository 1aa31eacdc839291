"""A GGUF file's metadata and tensors, read through the `gguf` library (the format's own).

`open_gguf(path)` parses the header once (metadata values as Python values, the tensor table)
and keeps the tensor data memory-mapped; `GgufFile.dequantize(name)` turns one tensor into a
float32 NumPy array in Hugging Face's row-major order (`[out, in]` for a linear weight), so
a conversion holds about one tensor at a time. Quantization types the converter accepts are
`SUPPORTED_TYPES`; any other is refused by name before anything is written. The `gguf` package
is a dependency of pdtopo (the default model, SmolLM2, is a GGUF file), imported on first use; an
install that lacks it is told the command that adds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdtopo.model_config.errors import CheckpointError

# dequantized by `gguf.quants` (floats, the classic block formats and the K-quants)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def gguf_module() -> Any:
    try:
        import gguf  # deferred: only GGUF files need it (random-init models never import it)
    except ImportError as e:
        raise ImportError("reading a GGUF file needs the `gguf` package, a dependency of "
                          "pdtopo that this install lacks: pip install 'gguf>=0.17'") from e
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order (GGUF lists dimensions innermost first)
    type_name: str          # GGMLQuantizationType name: Q4_1, F32, ...


class GgufFile:
    """One parsed GGUF file (see module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        gguf = gguf_module()
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise CheckpointError(str(self.path), "header", self.path.name,
                                  f"not a readable GGUF file: {e}") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError):  # a value the library cannot render: not ours
                continue
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.tensors = {name: TensorInfo(name, tuple(int(d) for d in reversed(t.shape)),
                                         t.tensor_type.name)
                        for name, t in self._tensors.items()}

    def unsupported_types(self) -> dict[str, str]:
        """Tensor name -> type name, for tensors whose type the converter cannot dequantize."""
        return {n: t.type_name for n, t in self.tensors.items()
                if t.type_name not in SUPPORTED_TYPES}

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32, shaped as `tensors[name].shape`."""
        gguf = gguf_module()
        tensor = self._tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(self.tensors[name].shape)


def open_gguf(path: str | Path) -> GgufFile:
    return GgufFile(path)
