"""Lazy NumPy views of the tensors in one safetensors file (no data read until sliced).

`SafetensorsFile(path).view(name)` is a read-only `np.memmap` of that tensor in its stored
dtype, so a loader can slice one shard out of it and read only those bytes. The safetensors
library's NumPy reader cannot return bfloat16 ("data type 'bfloat16' not understood") and reads a
whole tensor or a slice into a new array; here the file's header (8-byte little-endian length,
then JSON: name -> dtype, shape, data_offsets) is read once and every tensor is a view of one
memory map, with bfloat16 from `ml_dtypes` (the dtype JAX itself uses).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": None,  # ml_dtypes.bfloat16, imported on first use (it takes ~1 s: the CLI's
                   # pre-flight reads headers only)
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


def _numpy_dtype(code: str) -> np.dtype:
    if code == "BF16":
        import ml_dtypes  # deferred: slow to import, and only bfloat16 tensors need it

        return np.dtype(ml_dtypes.bfloat16)
    return DTYPES[code]
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One safetensors file: its tensors' names, dtypes, shapes and lazy views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise ValueError(f"{self.path}: not a safetensors file (header of {size} bytes)")
            try:
                header = json.loads(fh.read(size))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: not a safetensors file ({e})") from e
        header.pop("__metadata__", None)
        self._entries: dict[str, dict] = header
        self._data_start = 8 + size
        self._map: np.memmap | None = None

    def names(self) -> list[str]:
        return list(self._entries)

    def _entry(self, name: str) -> dict:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in self._entry(name)["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._entry(name)["dtype"]
        if code not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {code}, which pdtopo does "
                             f"not read (supported: {', '.join(DTYPES)})")
        return _numpy_dtype(code)

    def view(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file (bytes are read when indexed)."""
        entry, dtype, shape = self._entry(name), self.dtype(name), self.shape(name)
        begin, end = (int(x) for x in entry["data_offsets"])
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{self.path}: tensor {name!r} spans {end - begin} bytes, "
                             f"not the {shape} {dtype} its header says")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self._data_start + begin
        if start + (end - begin) > self._map.size:
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file "
                             "(truncated download?)")
        return self._map[start:start + (end - begin)].view(dtype).reshape(shape)

    def close(self) -> None:
        self._map = None  # views taken keep the mapping alive until they are dropped
