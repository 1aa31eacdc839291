"""Shared test setup: JAX on the CPU with 4 emulated devices, an ASGI app served on a free port
(pdtopo.ports) in a thread, repo paths."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import pytest  # noqa: E402

from pdtopo.ports import free_port  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[int]:
    """Serve the ASGI `app` with uvicorn on a free 127.0.0.1 port in a daemon thread; yields
    the port once the server accepts connections, and stops it on exit. `config`: more
    `uvicorn.Config` settings (e.g. `http=`, `lifespan=`)."""
    import uvicorn

    port = free_port()
    config.setdefault("log_level", "warning")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start within 20 s"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT
