"""The launcher's readiness rules: a Rust router is ready only once it lists every worker."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdtopo.launcher.health import router_workers_ready


@pytest.fixture
def router():
    state = {"workers": [], "status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            body = json.dumps({"workers": state["workers"], "total": len(state["workers"])})
            self.send_response(state["status"])
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", state
    srv.shutdown()


def test_router_ready_only_when_all_workers_registered_and_healthy(router):
    url, state = router
    assert not router_workers_ready(url, 2)
    state["workers"] = [{"url": "p", "is_healthy": True}]
    assert not router_workers_ready(url, 2)
    state["workers"].append({"url": "d", "is_healthy": False})
    assert not router_workers_ready(url, 2)
    state["workers"][1]["is_healthy"] = True
    assert router_workers_ready(url, 2)


def test_router_without_worker_registry_is_ready(router):
    url, state = router
    state["status"] = 404  # MiniLB has no /workers
    assert router_workers_ready(url, 2)


def test_unreachable_router_is_not_ready():
    assert not router_workers_ready("http://127.0.0.1:9", 1, timeout=0.5)
