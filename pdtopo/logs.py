"""Process-wide logging: one format for pdtopo's programs, and quiet HTTP clients.

httpx and httpcore log one INFO line per request; a P/D server sends a bootstrap heartbeat
every few seconds and `pdtopo bench` sends hundreds of requests, so at the default INFO level
those lines would bury everything else. `quiet_http_clients()` raises them to WARNING unless
the process runs at DEBUG, where they are kept. `root_logging_restored()` undoes what a
command run inside another program (a test, a tool) did to the root logger: Hydra configures it
for its job with a handler bound to the sys.stdout of that moment.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def root_logging_restored() -> Iterator[None]:
    """The root logger's handlers and level as they were before the block: a handler the
    block added is removed (one bound to a stream that may be closed later would make every
    later record a logging error), one it removed is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)  # a no-op for one still there
        root.setLevel(level)
