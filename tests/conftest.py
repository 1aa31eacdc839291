"""Shared test setup: JAX on the CPU with 4 emulated devices, free ports, repo paths."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import pytest  # noqa: E402

from pdtopo.bench.deployments import ephemeral_low  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, chosen below the kernel's
    ephemeral range so that no outgoing connection grabs it before the server binds it."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(10000, ephemeral_low())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT
