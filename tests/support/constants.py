"""Values many tests share: the repository's paths, the model overrides of the process tests
(the tiny random model, named: the default model is SmolLM2), the tiny server the API tests
start, greedy sampling parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"

# the tiny random model (conf/model/tiny_llama.yaml; not the default model, SmolLM2) cut to 2
# layers or 1: fast compiles
TINY_MODEL = "model=tiny_llama"
TWO_LAYERS = [TINY_MODEL, "model.num_layers=2"]
ONE_LAYER = [TINY_MODEL, "model.num_layers=1"]

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
