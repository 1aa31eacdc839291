"""Device split of a local-disaggregation process: `topology.prefill_slices` / `decode_slices`.

A slice is written as in tpu-inference's PREFILL_SLICES / DECODE_SLICES: `"4"` (4 chips) or
`"2x2"` (a 2x2 block, 4 chips); an int is accepted too. Each key holds one slice or a list of
slices; every slice becomes one engine with a 1-D `tp` mesh over that many devices (a 2-D slice
is flattened: tp = product). Devices are handed out in order: prefill slices first, then decode
slices, e.g. prefill "4" + decode ["2", "2"] on 8 devices -> prefill_0 = devices 0-3,
decode_0 = 4-5, decode_1 = 6-7.

Pure (no JAX import): the launcher uses it to plan the process's chips, the runtime to build the
meshes. Every bad value raises `TopologyError` naming the key and value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pdtopo.config.schema import TopologyError

PREFILL_KEY = "topology.prefill_slices"
DECODE_KEY = "topology.decode_slices"
_SLICE_RE = re.compile(r"^\d+(x\d+)*$")


@dataclass(frozen=True)
class EngineSlice:
    """One engine of the local process: its name, role, slice shape and device range."""

    name: str            # prefill_0, decode_0, decode_1, ...
    role: str            # prefill | decode
    shape: tuple[int, ...]
    first_device: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.size)


@dataclass(frozen=True)
class LocalLayout:
    prefill: tuple[EngineSlice, ...]
    decode: tuple[EngineSlice, ...]

    @property
    def engines(self) -> tuple[EngineSlice, ...]:
        return self.prefill + self.decode

    @property
    def num_chips(self) -> int:
        return sum(s.size for s in self.engines)

    def mesh_summary(self) -> dict[str, int]:
        """engine name -> devices (what the plan shows as the process's `mesh`)."""
        return {s.name: s.size for s in self.engines}


def parse_slice(value: Any, key: str) -> tuple[int, ...]:
    """'4' -> (4,), '2x2' -> (2, 2), 4 -> (4,); TopologyError otherwise."""
    if isinstance(value, bool):
        raise TopologyError(key, value, "a slice is a chip count like '4' or a shape like '2x2'")
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip().lower()
    else:
        raise TopologyError(key, value, "a slice is a chip count like '4' or a shape like '2x2'")
    if not _SLICE_RE.match(text):
        raise TopologyError(key, value, "a slice is a chip count like '4' or a shape like '2x2'")
    shape = tuple(int(x) for x in text.split("x"))
    if any(d < 1 for d in shape):
        raise TopologyError(key, value, "every slice dimension must be >= 1")
    return shape


def parse_slices(value: Any, key: str) -> list[tuple[int, ...]]:
    """One slice or a list of slices (a Hydra ListConfig is fine)."""
    if value is None:
        raise TopologyError(key, None, "mode local needs this key: e.g. '4', '2x2' or ['2', '2']")
    if isinstance(value, (str, int)):
        return [parse_slice(value, key)]
    try:
        items = list(value)
    except TypeError:
        raise TopologyError(key, value, "expected a slice or a list of slices") from None
    if not items:
        raise TopologyError(key, items, "at least one slice is needed")
    return [parse_slice(v, f"{key}.{i}") for i, v in enumerate(items)]


def local_layout(prefill_slices: Any, decode_slices: Any,
                 num_devices: int | None = None) -> LocalLayout:
    """The engines of a local process; `num_devices` (if given) must cover them all."""
    slices: dict[str, list[EngineSlice]] = {"prefill": [], "decode": []}
    nxt = 0
    for role, value, key in (("prefill", prefill_slices, PREFILL_KEY),
                             ("decode", decode_slices, DECODE_KEY)):
        for i, shape in enumerate(parse_slices(value, key)):
            s = EngineSlice(f"{role}_{i}", role, shape, nxt)
            slices[role].append(s)
            nxt += s.size
    layout = LocalLayout(tuple(slices["prefill"]), tuple(slices["decode"]))
    if num_devices is not None and layout.num_chips > num_devices:
        raise TopologyError(
            DECODE_KEY, decode_slices,
            f"prefill {_fmt(layout.prefill)} + decode {_fmt(layout.decode)} need "
            f"{layout.num_chips} devices but this process sees {num_devices}")
    return layout


def layout_from_topology(topology: Any, num_devices: int | None = None) -> LocalLayout:
    """`local_layout` from a topology node (DictConfig, dict or TopologySchema)."""
    get = topology.get if hasattr(topology, "get") else lambda k, d=None: getattr(topology, k, d)
    return local_layout(get("prefill_slices", None), get("decode_slices", None), num_devices)


def _fmt(slices: tuple[EngineSlice, ...]) -> str:
    return "[" + ", ".join("x".join(map(str, s.shape)) for s in slices) + "]"
