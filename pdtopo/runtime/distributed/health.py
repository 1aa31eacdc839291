"""A follower's tiny HTTP endpoint (stdlib, one thread): `GET /health` and `GET /pdtopo/state`.

Followers serve no API (the leader does); the launcher still waits on every process's
`health_url`. `/health` answers 503 {"status": "loading"} until the follower is in its lockstep
loop, then 200; after a failure it answers 503 with the error. `state_fn()` supplies
`/pdtopo/state` (behind the same credential as the leader's API where the server requires
one).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdtopo.runtime.api.http_auth import HttpGuard, unauthorized_body


class HealthServer:
    def __init__(self, host: str, port: int, state_fn: Callable[[], dict[str, Any]],
                 guard: HttpGuard | None = None):
        """`guard`: the credential `/pdtopo/state` asks for (pdtopo.runtime.api.http_auth)."""
        self.status = "loading"
        self.error: str | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] == "/health":
                    ok = owner.status == "ok"
                    body = {"status": owner.status, **({"error": owner.error} if owner.error
                                                       else {})}
                    self._reply(200 if ok else 503, body)
                elif self.path.split("?")[0] == "/pdtopo/state":
                    problem = guard.problem(self.headers.get("Authorization")) if guard else None
                    if problem is not None:
                        self._reply(401, json.loads(unauthorized_body(problem)))
                    else:
                        self._reply(200, {"status": owner.status, **state_fn()})
                else:
                    self._reply(404, {"detail": f"{self.path} not found: a follower process "
                                      "serves /health and /pdtopo/state only (the instance's "
                                      "leader serves the API)"})

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="follower-health",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
