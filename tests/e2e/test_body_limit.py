"""The request body limit (`server.max_body_bytes`, pdtopo/body_limit.py): the key is checked
naming itself; every proxy kind's command carries it in the flag its own parser reads; the
middleware under real uvicorn answers 413 before reading an oversize body (with a length or
chunked) and leaves the connection usable; MiniLB through pdtopo's entry (a real process)
answers 413 itself instead of forwarding. End to end through servers and proxies:
tests/e2e/test_pd_e2e.py, tests/e2e/test_gateway_e2e.py, tests/e2e/test_large_requests.py."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from sglang_router.launch_router import parse_router_args as router_args
from smg.launch_router import parse_router_args as gateway_args

from pdtopo.body_limit import BodyLimitMiddleware
from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.config.settings import runtime_settings
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.programs.nodelay_exec import inner_command
from pdtopo.ports import free_port
from pdtopo.runtime.api.http_probe import HttpProtocol
from tests.support.constants import REPO_ROOT
from tests.support.e2e import post_oversize, wait_healthy
from tests.support.serving import serve_in_thread

LIMIT = 1024 * 1024


def test_max_body_bytes_is_checked_naming_the_key():
    assert runtime_settings(compose_config([])).server.max_body_bytes == 8 * 1024 * 1024
    for bad in ("100", "-1", "'lots'"):
        with pytest.raises(TopologyError) as err:
            runtime_settings(compose_config([f"server.max_body_bytes={bad}"]))
        assert err.value.key == "server.max_body_bytes", bad
        assert "server.max_body_bytes" in str(err.value)


def _router_args(kind: str, command: list[str]):
    """The proxy's argv as the router's own parser reads it."""
    parse = gateway_args if kind == "gateway" else router_args
    return parse(inner_command(command)[3:])


@pytest.mark.parametrize("kind", ["rust", "gateway", "mini_lb"])
def test_every_proxy_kind_gets_the_servers_limit(kind):
    plan = expand_plan(compose_config(["model=tiny_llama", f"proxy={kind}",
                                       "server.max_body_bytes=4096"]))
    command = plan.by_name()["proxy"].command
    assert command[command.index("--max-payload-size") + 1] == "4096"
    assert _router_args(kind, command).max_payload_size == 4096  # bytes, as the proxy reads it
    if kind == "mini_lb":  # MiniLB enforces no limit itself: pdtopo's entry adds it
        assert inner_command(command)[1:3] == ["-m", "pdtopo.launcher.programs.mini_lb_entry"]
    with pytest.raises(TopologyError) as err:
        expand_plan(compose_config(["model=tiny_llama", "proxy=rust",
                                    'proxy.extra_args=["--max-payload-size=9"]']))
    assert err.value.key == "proxy.extra_args.0"


class _Echo:
    """The app behind the limit: answers with the size of the body it read; counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.calls += 1
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture
def limited():
    app = _Echo()
    with serve_in_thread(BodyLimitMiddleware(app, LIMIT, "server.max_body_bytes"),
                         lifespan="off", http=HttpProtocol) as port:
        yield f"http://127.0.0.1:{port}", app


def _chunks(total: int, size: int = 64 * 1024):
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        sent += n
        yield b"x" * n


def test_oversize_body_is_413_before_it_is_read(limited):
    url, app = limited
    resp, took = post_oversize(url)
    assert resp.status_code == 413 and took < 1.0, (resp.status_code, took)
    error = resp.json()["error"]
    assert error["code"] == 413 and error["type"] == "request_too_large"
    assert f"server.max_body_bytes={LIMIT}" in error["message"]
    assert str(50 * 1024 * 1024) in error["message"]
    assert app.calls == 0, "the app saw a refused request"
    with httpx.Client(base_url=url, timeout=10) as client:
        first = client.post("/generate", content=b"y" * (LIMIT + 1))
        again = client.post("/generate", content=b"y" * LIMIT)  # the same connection
    assert first.status_code == 413
    assert again.status_code == 200 and again.text == str(LIMIT)
    assert app.calls == 1


def test_chunked_body_is_counted_as_it_arrives(limited):
    url, app = limited
    t0 = time.perf_counter()
    resp = httpx.post(f"{url}/generate", content=_chunks(20 * LIMIT), timeout=10)
    assert resp.status_code == 413 and time.perf_counter() - t0 < 1.0
    assert "(chunked)" in resp.json()["error"]["message"]
    assert app.calls == 0
    ok = httpx.post(f"{url}/generate", content=_chunks(LIMIT), timeout=10)
    assert ok.status_code == 200 and ok.text == str(LIMIT), "a body within the limit, whole"
    assert app.calls == 1


def test_mini_lb_entry_answers_413_itself(tmp_path):
    """MiniLB alone would read a body of any size and forward it; with pdtopo's entry it
    answers 413 without contacting P or D (here nothing listens at their addresses)."""
    port = free_port()
    log = open(tmp_path / "mini_lb.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdtopo.launcher.programs.mini_lb_entry", "--pd-disaggregation",
         "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--host",
         "127.0.0.1", "--port", str(port), "--mini-lb", "--policy", "random",
         "--max-payload-size", str(LIMIT)],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc)
        resp, took = post_oversize(url)
        assert resp.status_code == 413 and took < 1.0, (resp.status_code, resp.text, took)
        assert f"server.max_body_bytes={LIMIT}" in resp.json()["error"]["message"]
        small = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30)
        assert small.status_code != 413  # forwarded (and failed: no P/D there)
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
