"""An ASGI app served for real in the test process: uvicorn on a free 127.0.0.1 port
(pdtopo.ports) in a daemon thread, for tests of HTTP clients and middleware; `json_body`
reads a raw ASGI app's JSON request."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from pdtopo.ports import free_port


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


async def json_body(receive: Any) -> Any:
    """The JSON body of the request a raw ASGI app is handling (all its chunks)."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return json.loads(body)
