"""A missing tool skips a test locally and fails it under CI=true (tests/support/ci.py); .ci/run
installs every tool those tests need, a C compiler too, and stops when an install fails
instead of going on to a run whose tests would skip. .ci/run runs for real with fake
`id`, `apt-get`, `pip` and `python` on a PATH that holds no `ip`, `prometheus` or compiler."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.ci import in_ci, missing, require_compiler, require_tool
from tests.support.constants import REPO_ROOT

ABSENT = "pdtopo-no-such-program"


@pytest.mark.parametrize("value, ci", [("true", True), ("1", True), ("TRUE", True),
                                       ("", False), ("false", False), ("0", False)])
def test_in_ci(value, ci):
    assert in_ci({"CI": value}) is ci
    assert in_ci({}) is False


def test_a_missing_tool_skips_locally_and_fails_under_ci():
    with pytest.raises(pytest.skip.Exception, match=f"`{ABSENT}` is not installed: apt-get x"):
        require_tool(ABSENT, "apt-get x", {})
    with pytest.raises(pytest.fail.Exception, match=f"`{ABSENT}` is not installed: apt-get x.*"
                       "CI=true"):
        require_tool(ABSENT, "apt-get x", {"CI": "true"})
    assert require_tool("sh", "-", {"CI": "true"}).endswith("/sh")  # present: its path


def test_missing_namespaces_and_compiler_follow_the_same_rule(monkeypatch):
    with pytest.raises(pytest.fail.Exception, match="no namespaces: run as root"):
        missing("no namespaces", "run as root", {"CI": "true"})
    with pytest.raises(pytest.skip.Exception, match="no namespaces: run as root"):
        missing("no namespaces", "run as root", {})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.fail.Exception, match="no C compiler.*apt-get install -y gcc"):
        require_compiler({"CI": "true"})
    with pytest.raises(pytest.skip.Exception, match="no C compiler"):
        require_compiler({})


FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
case "$(basename "$0") $*" in *"$FAIL_ON"*) [ -n "$FAIL_ON" ] && exit 100;; esac
exit 0
"""


def _ci_run(tmp_path: Path, fail_on: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    """.ci/run on a PATH with bash, dirname, basename and fake id (root), apt-get, pip and
    python (which log their calls, failing the one whose command line contains `fail_on`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "basename"):
        real = next(Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists())
        (bin_dir / tool).symlink_to(real)
    for fake in ("apt-get", "pip", "python"):
        (bin_dir / fake).write_text(FAKE)
        (bin_dir / fake).chmod(0o755)
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")  # CI runs as root
    (bin_dir / "id").chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": str(bin_dir), "CALLS": str(calls), "FAIL_ON": fail_on, "HOME": str(tmp_path)}
    res = subprocess.run([str(bin_dir / "bash"), str(REPO_ROOT / ".ci" / "run")], env=env,
                         capture_output=True, text=True, timeout=60)
    return res, calls.read_text().splitlines() if calls.exists() else []


def test_ci_run_installs_every_tool_with_a_compiler(tmp_path):
    res, calls = _ci_run(tmp_path)
    assert res.returncode == 0, res.stderr
    installs = " ".join(c for c in calls if c.startswith("apt-get") and " install " in c)
    for package in ("iproute2", "prometheus", "gcc", "libc6-dev"):
        assert package in installs.split(), (package, calls)
    assert calls[-2:] == ["pip install -e .[test]", "python -m pytest -q"]


@pytest.mark.parametrize("package", ["iproute2", "prometheus", "gcc"])
def test_ci_run_stops_when_an_install_fails(tmp_path, package):
    res, calls = _ci_run(tmp_path, fail_on=package)
    assert res.returncode != 0
    assert f"apt-get install {package}" in res.stderr or package in res.stderr
    assert not any(c.startswith(("pip", "python")) for c in calls), calls  # no run after it
