"""A loading server says what it is doing: while a real server process loads, its /health
answers 503 "engine is loading: <step>" with the steps of its own log (loading the model,
compiling step shapes x/y, warmup), and 200 once it serves; the launcher reads the same text
(`loading_detail`) for its health table."""

from __future__ import annotations

import threading

import httpx

from pdtopo.launcher.operate.health import loading_detail
from tests.support.constants import ONE_DEVICE, TINY_OVERRIDES
from tests.support.e2e import ColocatedServer


def test_health_503_names_the_load_step_until_ready(tmp_path):
    server = ColocatedServer(None, TINY_OVERRIDES, tmp_path / "server.log", env=ONE_DEVICE)
    said: list[str] = []
    details: list[str] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                r = httpx.get(f"{server.url}/health", timeout=2)
            except httpx.HTTPError:
                done.wait(0.02)
                continue
            if r.status_code == 200:
                return
            said.append(r.json()["error"]["message"])
            details.append(loading_detail(f"{server.url}/health"))
            done.wait(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    server.start()
    try:
        poller.join(10)
        assert said, "never saw the server loading"
        assert all(m.startswith("engine is loading: ") for m in said), set(said)
        steps = {m.removeprefix("engine is loading: ") for m in said}
        assert any(s.startswith("compiled step shape ") for s in steps), steps
        assert steps <= {"starting", "loading model", "warming up", "running warmup steps"} | {
            s for s in steps if s.startswith("compiled step shape ")}, steps
        assert set(details) - {""} <= steps  # the launcher shows the same text
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        done.set()
        server.stop_and_check()
