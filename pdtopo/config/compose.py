"""Compose pdtopo's Hydra config outside of a Hydra app (tests, runtime direct mode, diff).

conf/ lives at the repository root in a checkout and at pdtopo/conf in an installed wheel;
`conf_dir()` finds whichever exists. `compose_config(overrides)` returns the composed
DictConfig exactly as `pdtopo launch <overrides>` would see it (without the hydra: node).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig


def conf_dir() -> Path:
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"pdtopo config directory not found next to {here}")


def compose_config(
    overrides: Sequence[str] = (), config_dir: Path | None = None
) -> DictConfig:
    directory = Path(config_dir) if config_dir is not None else conf_dir()
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        return compose(config_name="config", overrides=list(overrides))
