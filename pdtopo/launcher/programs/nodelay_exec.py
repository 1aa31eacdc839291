"""Runs a command with TCP_NODELAY on every TCP connection it accepts (the Rust router's client
connections; `proxy.client_nodelay`).

    python -m pdtopo.launcher.programs.nodelay_exec [--required] -- COMMAND [ARG...]

sglang-router 0.3.2 does not set TCP_NODELAY on the connections it accepts, and no flag of its
turns it on, so on a reused keep-alive connection a stream's first event waits up to 40 ms for
the client's delayed acknowledgement (docs/observability.md has the trace). The fix needs no
change to the binary: `accept_nodelay.c` (next to this module) wraps `accept`/`accept4`. Data
flow: compile it with the host's C compiler into a fresh private directory (mode 0700), load
it once here to prove it loads in this environment, then exec COMMAND with the library first in
LD_PRELOAD. The library deletes its file and directory as it loads and restores LD_PRELOAD, so
nothing stays on disk and COMMAND's children do not inherit it.

COMMAND must be a dynamically linked program started directly (the interpreter, not a shell
script that execs it: a script's shell would take the library and delete it). Without a C
compiler, off Linux, or if the library does not build or load: with `--required`
(`proxy.client_nodelay: true`) this exits 2 naming the setting; otherwise (`auto`) it says so
on stderr, once, and execs COMMAND unchanged.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pdtopo.launcher.plan.expand import NODELAY_MODULE

SOURCE = Path(__file__).with_name("accept_nodelay.c")
LIBRARY_NAME = "accept_nodelay.so"
SO_ENV = "PDTOPO_NODELAY_SO"
PRELOAD_WAS_ENV = "PDTOPO_NODELAY_PRELOAD_WAS"
COMPILERS = ("cc", "gcc", "clang")
COMPILE_TIMEOUT_S = 60
SETTING = "proxy.client_nodelay"


class ShimError(RuntimeError):
    """The library could not be built or loaded here; the message says why."""


def compiler_on_path() -> str | None:
    """The first of COMPILERS on PATH, or None."""
    return next((p for p in map(shutil.which, COMPILERS) if p), None)


def find_compiler() -> str:
    path = compiler_on_path()
    if path:
        return path
    raise ShimError(f"no C compiler on PATH (looked for {', '.join(COMPILERS)})")


def build_library(directory: Path) -> Path:
    """Compile the library into `directory`; the path of the loadable .so."""
    out = directory / LIBRARY_NAME
    cmd = [find_compiler(), "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE),
           "-ldl"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ShimError(f"compiling {SOURCE.name} failed: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ShimError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}): {' | '.join(tail)}")
    try:
        ctypes.CDLL(str(out))  # main() removed PDTOPO_NODELAY_* here: its constructor is a no-op
    except OSError as exc:
        raise ShimError(f"the compiled {LIBRARY_NAME} does not load from {directory} ({exc}); "
                        "is that file system mounted noexec? set TMPDIR to one that is not"
                        ) from None
    return out


def preload_env(environ: Mapping[str, str], library: Path) -> dict[str, str]:
    """COMMAND's environment: the library first in LD_PRELOAD, and what it needs to clean up."""
    was = environ.get("LD_PRELOAD", "")
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library}:{was}" if was else str(library)
    env[SO_ENV] = str(library)
    env[PRELOAD_WAS_ENV] = was
    return env


def parse_args(argv: list[str]) -> tuple[bool, list[str]]:
    """(required, COMMAND); SystemExit naming the usage when COMMAND is missing."""
    required = False
    rest = list(argv)
    if rest[:1] == ["--required"]:
        required, rest = True, rest[1:]
    if rest[:1] != ["--"] or len(rest) < 2:
        raise SystemExit("usage: python -m pdtopo.launcher.programs.nodelay_exec [--required] -- "
                         "COMMAND [ARG...]")
    return required, rest[1:]


def inner_command(command: list[str]) -> list[str]:
    """The program a planned command runs: COMMAND when `command` is this wrapper's
    `PYTHON -m pdtopo.launcher.programs.nodelay_exec [...] -- COMMAND`, else `command` itself."""
    if command[1:3] != ["-m", NODELAY_MODULE]:
        return command
    return parse_args(command[3:])[1]


def private_directory() -> Path:
    """A fresh directory only this user can enter (mode 0700)."""
    try:
        return Path(tempfile.mkdtemp(prefix="pdtopo-nodelay-"))
    except OSError as exc:
        raise ShimError(f"no private temporary directory ({exc}); set TMPDIR") from None


def main(argv: list[str] | None = None) -> None:
    required, command = parse_args(sys.argv[1:] if argv is None else argv)
    # inherited values are not ours: the library would act on them when it loads here
    os.environ.pop(SO_ENV, None)
    os.environ.pop(PRELOAD_WAS_ENV, None)
    env: Mapping[str, str] = os.environ
    directory: Path | None = None
    try:
        if not sys.platform.startswith("linux"):
            raise ShimError(f"the accept wrapper is for Linux (this is {sys.platform})")
        directory = private_directory()
        env = preload_env(os.environ, build_library(directory))
    except ShimError as exc:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        if required:
            print(f"nodelay_exec: {SETTING}=true but {exc}; install a C compiler or set "
                  f"{SETTING}=auto", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        print(f"nodelay_exec: {exc}; starting without TCP_NODELAY on accepted connections "
              f"({SETTING}=auto): streaming first tokens on reused client connections may "
              "wait up to 40 ms", file=sys.stderr, flush=True)
    try:
        os.execvpe(command[0], command, dict(env))
    except OSError as exc:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        raise SystemExit(f"nodelay_exec: cannot run {command[0]}: {exc}") from None


if __name__ == "__main__":
    main()
