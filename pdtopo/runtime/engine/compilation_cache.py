"""JAX's persistent compilation cache, switched on from `launcher.compilation_cache_dir`.

A restarted or sibling process with the same model and shapes loads compiled steps from disk
instead of compiling them again. Called by every server and follower before its first compile.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str | None) -> None:
    if not cache_dir:
        return
    import jax  # deferred: the server process imports JAX on its loader thread, after /health

    path = Path(str(cache_dir)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("JAX compilation cache: %s", path)
