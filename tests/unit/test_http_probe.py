"""A P/D server's HTTP protocol: the router's HTTP/2 prior-knowledge probe (its gRPC
detection) is closed without a warning; HTTP/1.1 and other bad requests behave as uvicorn's."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from fastapi import FastAPI

from pdtopo.runtime.api.http_probe import H2_PREFACE, HttpProtocol
from tests.support.serving import serve_in_thread


@pytest.fixture
def server():
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    with serve_in_thread(app, http=HttpProtocol) as port:
        yield port


def _send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        while True:
            got = s.recv(4096)
            if not got:
                return b"".join(chunks)
            chunks.append(got)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def uvicorn_log():
    """uvicorn's own logger (it does not propagate to the root logger caplog watches)."""
    handler = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_h2_probe_closed_quietly(server, caplog, uvicorn_log):
    with caplog.at_level(logging.DEBUG):
        answer = _send(server, H2_PREFACE + b"\x00\x00\x18\x04\x00\x00\x00\x00\x00")
        time.sleep(0.2)
    assert answer == b""  # closed, nothing sent
    assert not any("Invalid HTTP request" in line for line in uvicorn_log)
    assert "gRPC probe" in caplog.text
    assert httpx.get(f"http://127.0.0.1:{server}/health", timeout=5).json() == {"ok": True}


def test_other_garbage_still_gets_a_400_and_a_warning(server, uvicorn_log):
    answer = _send(server, b"NOT HTTP AT ALL\r\n\r\n")
    time.sleep(0.2)
    assert answer.startswith(b"HTTP/1.1 400")
    assert "Invalid HTTP request received." in uvicorn_log
