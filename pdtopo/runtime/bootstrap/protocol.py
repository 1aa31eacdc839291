"""Wire schema of the bootstrap server (docs/protocol.md#bootstrap-api): registration, heartbeat, route lookup.

Shared by the server (validation of what arrives) and the client (what it sends), so both sides
agree on field names. Addresses are "host:port" strings; the rank tuple is complete.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["prefill", "decode"]
TOKEN_HEADER = "Authorization"


def _check_addr(value: str | None, field: str) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be 'host:port' with a port in 1..65535, got {value!r}")
    return value


class RankTuple(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    cp_rank: int = Field(0, ge=0)
    cp_size: int = Field(1, ge=1)
    dp_rank: int = Field(0, ge=0)
    dp_size: int = Field(1, ge=1)
    pp_rank: int = Field(0, ge=0)
    pp_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ranks_below_sizes(self) -> RankTuple:
        for axis in ("tp", "cp", "dp", "pp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if rank >= size:
                raise ValueError(f"{axis}_rank={rank} must be < {axis}_size={size}")
        return self


class Registration(RankTuple):
    """PUT /route payload."""

    role: Role
    instance_id: str = Field(min_length=1, max_length=128)
    transfer_addr: str
    zmq_addr: str
    http_addr: str | None = None
    scheduler_addr: str | None = None
    page_size: int = Field(ge=1)
    kv_dtype: str = Field(min_length=1, max_length=32)
    model: str | None = Field(None, max_length=256)
    kv_layout: dict[str, Any] = Field(default_factory=dict)
    mesh_meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("transfer_addr", "zmq_addr", "http_addr", "scheduler_addr")
    @classmethod
    def _addr(cls, value: str | None, info) -> str | None:
        return _check_addr(value, info.field_name)


class Heartbeat(BaseModel):
    """POST /heartbeat payload: identifies one registered rank."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    instance_id: str = Field(min_length=1, max_length=128)
    tp_rank: int = Field(0, ge=0)
    cp_rank: int = Field(0, ge=0)
    dp_rank: int = Field(0, ge=0)
    pp_rank: int = Field(0, ge=0)
