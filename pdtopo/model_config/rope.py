"""RopeConfig: which rotary embedding a model uses, parsed from either config format.

Two formats carry the same facts:
  - older checkpoints (transformers 4.x): a top-level `rope_theta` and an optional
    `rope_scaling: {rope_type|type, factor, ...}`;
  - current checkpoints (transformers 5.x): `rope_parameters: {rope_type, rope_theta, ...}`.
`rope_from_fields(fields, where)` reads whichever is present (both: they must agree) into one
frozen `RopeConfig`. Supported kinds: `default`, `linear` (inverse frequencies / factor) and
`llama3` (Llama 3.1's wavelength-dependent scaling). Every other kind (`yarn`, `dynamic`,
`longrope`, ...), per-layer-type RoPE, partial rotary and unknown parameters raise
`CheckpointError` naming the key and value: a RoPE we do not implement is never guessed.
The inverse frequencies themselves are computed in `llama.rope_inv_freq`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdtopo.model_config.errors import CheckpointError

DEFAULT_THETA = 10000.0
ROPE_KINDS = ("default", "linear", "llama3")
# parameters each kind reads besides rope_type / rope_theta
_KIND_PARAMS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}
# keys accepted in a rope dict without changing the math
_NEUTRAL = {"rope_type", "type", "rope_theta"}


@dataclass(frozen=True)
class RopeConfig:
    kind: str = "default"
    theta: float = DEFAULT_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope kind {self.kind!r}: expected one of {', '.join(ROPE_KINDS)}")
        if not self.theta > 0:
            raise ValueError(f"rope_theta={self.theta!r} must be positive")


def _kind_of(rope: Mapping[str, Any]) -> Any:
    return rope.get("rope_type", rope.get("type", "default"))


def _parse_dict(rope: Mapping[str, Any], key: str, theta: float | None,
                max_positions: int, where: str) -> RopeConfig:
    """One rope dict (`key` is its config key: rope_scaling or rope_parameters)."""
    if not isinstance(rope, Mapping):
        raise CheckpointError(where, key, rope, "expected a mapping of RoPE parameters")
    nested = [k for k, v in rope.items() if isinstance(v, Mapping)]
    if nested:
        raise CheckpointError(where, f"{key}.{nested[0]}", rope[nested[0]],
                              "per-layer-type RoPE parameters are not supported")
    kind = _kind_of(rope)
    if kind not in ROPE_KINDS:
        raise CheckpointError(where, f"{key}.rope_type", kind,
                              f"RoPE type not supported (supported: {', '.join(ROPE_KINDS)})")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise CheckpointError(where, f"{key}.partial_rotary_factor", partial,
                              "partial rotary embeddings are not supported")
    params = _KIND_PARAMS[kind]
    unknown = sorted(set(rope) - _NEUTRAL - set(params) - {"partial_rotary_factor"})
    if unknown:
        raise CheckpointError(where, f"{key}.{unknown[0]}", rope[unknown[0]],
                              f"not a parameter of RoPE type {kind!r} "
                              f"(its parameters: {', '.join(params) or 'none'})")
    values: dict[str, Any] = {}
    for name in params:
        value = rope.get(name)
        if name == "original_max_position_embeddings" and value is None:
            value = max_positions  # what transformers falls back to
        if value is None:
            raise CheckpointError(where, f"{key}.{name}", None,
                                  f"RoPE type {kind!r} needs this parameter")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(where, f"{key}.{name}", value, "must be a positive number")
        values[name] = value
    if kind == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise CheckpointError(where, f"{key}.high_freq_factor", values["high_freq_factor"],
                              "must exceed low_freq_factor")
    if "original_max_position_embeddings" in values:
        values["original_max_position_embeddings"] = int(
            values["original_max_position_embeddings"])
    inner_theta = rope.get("rope_theta")
    return RopeConfig(kind=kind, theta=float(inner_theta if inner_theta is not None else
                                             theta if theta is not None else DEFAULT_THETA),
                      **{k: v for k, v in values.items()})


def _check_theta(value: Any, key: str, where: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(where, key, value, "must be a positive number")


def rope_from_fields(fields: Mapping[str, Any], where: str, max_positions: int) -> RopeConfig:
    """RopeConfig from config.json fields (or the `model:` group), either format.

    `where` names the source in errors (config.json's path, or `model`); `max_positions` is
    the model's max_position_embeddings (llama3's fallback for its original context length).
    """
    theta = fields.get("rope_theta")
    _check_theta(theta, "rope_theta", where)
    partial = fields.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise CheckpointError(where, "partial_rotary_factor", partial,
                              "partial rotary embeddings are not supported")
    parsed = []
    for key in ("rope_parameters", "rope_scaling"):
        if fields.get(key) is not None:
            rope = fields[key]
            if isinstance(rope, Mapping):
                _check_theta(rope.get("rope_theta"), f"{key}.rope_theta", where)
            parsed.append((key, _parse_dict(rope, key, theta, max_positions, where)))
    if not parsed:
        return RopeConfig(theta=float(theta) if theta is not None else DEFAULT_THETA)
    if len(parsed) == 2 and parsed[0][1] != parsed[1][1]:
        raise CheckpointError(where, "rope_scaling", fields["rope_scaling"],
                              f"disagrees with rope_parameters={fields['rope_parameters']!r}; "
                              "give one of them")
    rope = parsed[0][1]
    if theta is not None and float(theta) != rope.theta:
        raise CheckpointError(where, "rope_theta", theta,
                              f"disagrees with {parsed[0][0]}.rope_theta={rope.theta!r}")
    return rope
