"""What a loading server is doing, for /health's 503 and the launcher's health table.

The engine already logs its progress (`loading model`, the loader's `loading weights: x/y
tensors`, the runner's `compiled step shape x/y ...`, `warmup: ...`). `LoadProgress` is a
logging handler that keeps the latest of those lines as a short text (`latest()`), so progress is
reported from one place, the log calls, without threading a callback through the loader and
the runner. The loader thread writes it (through logging) and the event loop reads it; a lock
guards the one string.
"""

from __future__ import annotations

import logging
import re
import threading

# message -> short progress text (the first pattern that matches)
PATTERNS = (
    (re.compile(r"loading weights: (\d+/\d+) tensors"), "loading weights {} tensors"),
    (re.compile(r"compiled step shape (\d+/\d+)"), "compiled step shape {}"),
    (re.compile(r"^warmup: "), "running warmup steps"),
    (re.compile(r"^warmed KV (gather|scatter) (\d+/\d+)"), "compiled KV {} {}"),
    (re.compile(r"^loading model "), "loading model"),
    (re.compile(r"^model loaded "), "warming up"),
)


def progress_text(message: str) -> str | None:
    for pattern, text in PATTERNS:
        m = pattern.search(message)
        if m:
            return text.format(*m.groups())
    return None


class LoadProgress(logging.Handler):
    """Latest progress line of the engine's load (see module docstring)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self._lock_text = threading.Lock()
        self._text = "starting"

    def emit(self, record: logging.LogRecord) -> None:
        text = progress_text(record.getMessage())
        if text is not None:
            with self._lock_text:
                self._text = text

    def latest(self) -> str:
        with self._lock_text:
            return self._text

    def attach(self) -> LoadProgress:
        """Listen to pdtopo's loggers (until `detach`)."""
        logging.getLogger("pdtopo").addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("pdtopo").removeHandler(self)
