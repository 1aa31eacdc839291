"""Test setup for every test: JAX on the CPU with 4 emulated devices (set before anything
imports JAX), and the `slow` marker on every test under tests/e2e/ (real processes, compiled
engines, whole commands). Shared values and helpers are in tests/support/."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import pytest  # noqa: E402

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)
