"""nodelay_exec: the library it builds gives every TCP connection a program accepts TCP_NODELAY
(what the Rust router leaves off), leaves other sockets alone, leaves nothing on disk or in
LD_PRELOAD, and the wrapper refuses or warns, naming `proxy.client_nodelay`, when it cannot
build it. Real processes: a Python child listens and reports what its accepted sockets carry."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import NODELAY_MODULE, expand_plan
from pdtopo.launcher.programs import nodelay_exec
from tests.support.ci import require_compiler

# listens on TCP and on a Unix socket, accepts one connection on each, then prints what the
# accepted sockets carry and what the process's environment and mappings say
CHILD = textwrap.dedent("""
    import json, os, socket, sys
    tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen(1)
    unix_path = sys.argv[1]
    unix = socket.socket(socket.AF_UNIX); unix.bind(unix_path); unix.listen(1)
    print(tcp.getsockname()[1], flush=True)
    conn, _ = tcp.accept()
    uconn, _ = unix.accept()
    uconn.sendall(b"ok")
    maps = open("/proc/self/maps").read()
    lib = [line.split(None, 5)[-1] for line in maps.splitlines() if "accept_nodelay" in line]
    print(json.dumps({
        "nodelay": conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "markers": [k for k in os.environ if k.startswith("PDTOPO_NODELAY")],
        "mapped": lib[:1],
    }), flush=True)
""")


def _run_child(tmp_path: Path, wrapper: list[str], env: dict[str, str]) -> tuple[dict, str]:
    sock_path = str(tmp_path / f"u{len(list(tmp_path.glob('u*.sock')))}.sock")
    proc = subprocess.Popen([*wrapper, sys.executable, "-c", CHILD, sock_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)):
            with socket.socket(socket.AF_UNIX) as u:
                u.connect(sock_path)
                assert u.recv(2) == b"ok"  # a Unix socket accepted through the wrapper works
            report = json.loads(proc.stdout.readline())
        proc.wait(timeout=30)
        return report, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def c_compiler() -> str:
    """The wrapper's machine needs a C compiler: skipped without one, failed under CI=true."""
    return require_compiler()


needs_cc = pytest.mark.usefixtures("c_compiler")


def _wrapper(*opts: str) -> list[str]:
    return [sys.executable, "-m", NODELAY_MODULE, *opts, "--"]


@needs_cc
def test_accepted_tcp_connections_get_nodelay_and_nothing_is_left(tmp_path):
    env = {**os.environ, "LD_PRELOAD": ""}
    env.pop("LD_PRELOAD")
    plain, _ = _run_child(tmp_path, [], env)
    assert plain["nodelay"] == 0  # what the Rust router's sockets carry without the wrapper
    wrapped, err = _run_child(tmp_path, _wrapper("--required"), env)
    assert wrapped["nodelay"] != 0, err
    assert wrapped["ld_preload"] is None and wrapped["markers"] == []
    [mapped] = wrapped["mapped"]
    assert mapped.endswith("(deleted)")  # loaded, then its file removed ...
    assert not Path(mapped.split()[0]).parent.exists()  # ... with its private directory


@needs_cc
def test_an_existing_ld_preload_is_restored_for_the_program(tmp_path):
    other = nodelay_exec.build_library(_private_dir(tmp_path))  # any loadable library
    env = {**os.environ, "LD_PRELOAD": str(other)}
    report, err = _run_child(tmp_path, _wrapper(), env)
    assert report["nodelay"] != 0, err
    assert report["ld_preload"] == str(other)


def _private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "lib"
    d.mkdir()
    return d


def _no_compiler_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"  # python only: no cc, gcc or clang on PATH
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    return {**os.environ, "PATH": str(bin_dir)}


def test_required_without_a_compiler_exits_naming_the_setting(tmp_path):
    done = subprocess.run([*_wrapper("--required"), sys.executable, "-c", "print('ran')"],
                          capture_output=True, text=True, env=_no_compiler_env(tmp_path),
                          timeout=60)
    assert done.returncode == 2
    assert "proxy.client_nodelay=true" in done.stderr and "no C compiler" in done.stderr
    assert "ran" not in done.stdout


def test_auto_without_a_compiler_warns_and_runs_the_program_unchanged(tmp_path):
    report, err = _run_child(tmp_path, _wrapper(), _no_compiler_env(tmp_path))
    assert report["nodelay"] == 0 and report["mapped"] == []
    assert "proxy.client_nodelay=auto" in err and "40 ms" in err


@needs_cc
def test_an_inherited_marker_deletes_nothing(tmp_path):
    victim = tmp_path / "victim" / "file"
    victim.parent.mkdir()
    victim.write_text("keep")
    env = {**os.environ, nodelay_exec.SO_ENV: str(victim),
           nodelay_exec.PRELOAD_WAS_ENV: "/stale.so"}
    report, err = _run_child(tmp_path, _wrapper("--required"), env)
    assert report["nodelay"] != 0, err
    assert victim.read_text() == "keep"
    assert report["ld_preload"] is None  # the stale "previous LD_PRELOAD" was not restored


def test_no_temporary_directory_is_a_shim_error(monkeypatch):
    def refuse(**_):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(nodelay_exec.tempfile, "mkdtemp", refuse)
    with pytest.raises(nodelay_exec.ShimError, match="no private temporary directory.*TMPDIR"):
        nodelay_exec.private_directory()


@needs_cc
def test_a_compile_error_is_reported_with_the_compiler_output(tmp_path, monkeypatch):
    bad = tmp_path / "bad.c"
    bad.write_text("int broken(")
    monkeypatch.setattr(nodelay_exec, "SOURCE", bad)
    with pytest.raises(nodelay_exec.ShimError, match="compiling bad.c failed"):
        nodelay_exec.build_library(_private_dir(tmp_path))


def test_usage_without_a_command():
    with pytest.raises(SystemExit, match="usage"):
        nodelay_exec.parse_args(["--required"])
    assert nodelay_exec.parse_args(["--", "x", "--y"]) == (False, ["x", "--y"])


def _proxy_command(*overrides: str) -> list[str]:
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu", *overrides]))
    return plan.by_name()["proxy"].command


@pytest.mark.parametrize("setting, prefix", [
    ([], [NODELAY_MODULE, "--"]),
    (["proxy.client_nodelay=true"], [NODELAY_MODULE, "--required", "--"]),
])
def test_the_rust_router_is_wrapped(setting, prefix):
    cmd = _proxy_command(*setting)
    assert cmd[1] == "-m" and cmd[2:2 + len(prefix)] == prefix
    assert cmd[2 + len(prefix):][1:3] == ["-m", "sglang_router.launch_router"]


@pytest.mark.parametrize("overrides", [["proxy.client_nodelay=false"], ["proxy=gateway"],
                                       ["proxy=mini_lb"]])
def test_other_proxies_and_false_are_not_wrapped(overrides):
    assert NODELAY_MODULE not in _proxy_command(*overrides)


@pytest.mark.parametrize("value", ["sometimes", "0", "1"])
def test_a_bad_setting_is_refused_naming_the_key(value):
    with pytest.raises(TopologyError, match="proxy.client_nodelay.*auto, true or false"):
        _proxy_command(f"proxy.client_nodelay={value}")


def test_the_plan_json_keeps_the_wrapper():
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu"]))
    assert NODELAY_MODULE in json.dumps(plan.to_dict())


def test_inner_command_unwraps_only_the_wrapper():
    cmd = _proxy_command()
    assert nodelay_exec.inner_command(cmd)[1:3] == ["-m", "sglang_router.launch_router"]
    plain = _proxy_command("proxy=gateway")
    assert nodelay_exec.inner_command(plain) == plain
