"""What a test needs from the machine beyond Python packages: a program (`ip`, `prometheus`), a
C compiler, network namespaces.

    path = require_tool("prometheus", "apt-get install -y prometheus")
    require_compiler()
    missing("cannot create network namespaces here (...)", "run as root")

Where one is missing the test is skipped with the install hint, except under `CI=true` (set by
CI services; CI runs as root and .ci/run installs every one of them): there it fails with the
same hint, so CI cannot go green without the end-to-end coverage these tests give.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import NoReturn

import pytest

from pdtopo.launcher.programs.nodelay_exec import COMPILERS, compiler_on_path

CI_ENV = "CI"
COMPILER_HINT = "apt-get install -y gcc libc6-dev (.ci/run installs it)"


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(CI_ENV, "").strip().lower() in ("true", "1", "yes")


def missing(what: str, hint: str, environ: Mapping[str, str] = os.environ) -> NoReturn:
    """Skip the running test (fail it under CI=true) because `what` is missing; `hint` says
    how to get it."""
    reason = f"{what}: {hint}"
    if in_ci(environ):
        pytest.fail(f"{reason} ({CI_ENV}=true: a missing tool fails the test, it is not "
                    "skipped)", pytrace=False)
    pytest.skip(reason)


def require_tool(name: str, hint: str, environ: Mapping[str, str] = os.environ) -> str:
    """The path of program `name` on PATH; missing: `missing()` with `hint`."""
    path = shutil.which(name)
    if path is None:
        missing(f"`{name}` is not installed", hint, environ)
    return path


def require_compiler(environ: Mapping[str, str] = os.environ) -> str:
    """The C compiler pdtopo.launcher.programs.nodelay_exec builds with; missing: `missing()`."""
    path = compiler_on_path()
    if path is None:
        missing(f"no C compiler on PATH ({', '.join(COMPILERS)})", COMPILER_HINT, environ)
    return path
