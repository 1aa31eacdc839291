"""JSON over HTTP from the CLI to a running deployment: its servers' admin routes and the
router's worker registry (`/workers`). Every failure is an `OperationError` naming the URL.

    admin_request(url, body=None|dict, token=None, method=None, timeout=5.0) -> dict
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

POLL_S = 0.25


class OperationError(RuntimeError):
    """An operation on a running deployment that cannot start or did not finish; the message
    says which and why."""


def admin_request(url: str, *, body: dict | None = None, token: str | None = None,
                  method: str | None = None, timeout: float = 5.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    verb = method or ("POST" if data is not None else "GET")
    req = urllib.request.Request(url, data=data, method=verb)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise OperationError(f"{verb} {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise OperationError(f"{verb} {url}: {exc}") from None


def wait_until(check: Callable[[], bool], timeout: float) -> tuple[bool, float]:
    """Poll `check` every POLL_S until it is true or `timeout` s passed: (done, seconds)."""
    t0 = time.monotonic()
    while True:
        if check():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            return False, time.monotonic() - t0
        time.sleep(POLL_S)
