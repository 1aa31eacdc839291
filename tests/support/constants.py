"""Values many tests share: the repository's paths, the model overrides of the process tests
and the tiny server the API tests start, greedy sampling parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"

TWO_LAYERS = ["model.num_layers=2"]  # the default tiny model cut to 2 layers (fast compiles)
ONE_LAYER = ["model.num_layers=1"]

# the colocated server of the API tests (tests.support.api_server): one layer, small pool
TINY_OVERRIDES = [
    *ONE_LAYER,
    "engine.max_model_len=1024",
    "engine.num_pages=200",
    "engine.page_size=8",
    "engine.max_running_requests=8",
    "engine.max_prefill_tokens=128",
    "engine.max_new_tokens_default=16",
    "engine.max_new_tokens_limit=1000",
]
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    """sglang `sampling_params` of a deterministic (temperature 0) request."""
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}
