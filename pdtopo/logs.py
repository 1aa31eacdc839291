"""Process-wide logging: one format for pdtopo's programs, and quiet HTTP clients.

httpx and httpcore log one INFO line per request; a P/D server sends a bootstrap heartbeat
every few seconds and `pdtopo bench` sends hundreds of requests, so at the default INFO level
those lines would bury everything else. `quiet_http_clients()` raises them to WARNING unless
the process runs at DEBUG, where they are kept.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HTTP_CLIENT_LOGGERS = ("httpx", "httpcore")


def quiet_http_clients(level: int = logging.INFO) -> None:
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if level <= logging.DEBUG
                                         else logging.WARNING)


def configure_logging(level: int = logging.INFO) -> None:
    """A program's logging: `level` to stderr in pdtopo's format, HTTP clients quiet."""
    logging.basicConfig(level=level, stream=sys.stderr, format=FORMAT)
    quiet_http_clients(level)
