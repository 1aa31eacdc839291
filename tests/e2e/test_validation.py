"""One test per validation error class: `pdtopo launch` exits 2, names key and value,
writes no run dir and starts nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdtopo.cli import main
from pdtopo.ports import free_port


@pytest.fixture
def free_ports() -> list[str]:
    return [f"topology.ports.http_base={free_port()}", f"topology.bootstrap.port={free_port()}",
            f"topology.proxy.port={free_port()}", f"topology.proxy.prometheus_port={free_port()}",
            "launcher.health_timeout_s=5"]


def launch_fails(tmp_path: Path, capsys, free_ports, *overrides: str) -> str:
    run = tmp_path / "run"
    # the tiny model: the port check comes after the model pre-flight (the default fetches)
    code = main(["launch", "--detach", f"hydra.run.dir={run}", "model=tiny_llama", *free_ports,
                 *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not run.exists(), "a run dir was written for an invalid topology"
    return " ".join(err.split())


CASES = {
    "overlapping_chips": (["topology=2p2d", "topology.decode.chips=[[0,1],[6,7]]",
                           "topology.decode.mesh.tp=2"],
                          ["topology.decode.chips", "[0, 1]", "chip 0", "prefill_0", "decode_0"]),
    "chips_out_of_range": (["topology=1p1d_v4", "topology.decode.chips_per_instance=4",
                            "topology.decode.mesh.tp=4"],
                           ["topology.decode.chips_per_instance", "[2, 3, 4, 5]", "out of range"]),
    "unsplittable_chips": (["topology=1p1d_v6e8", "topology.prefill.chips=[[1,2]]",
                            "topology.prefill.mesh.tp=2"],
                           ["topology.prefill.chips", "[1, 2]", "contiguous aligned"]),
    "unsupported_split_size": (["topology=2p2d", "topology.prefill.chips_per_instance=3",
                                "topology.prefill.mesh.tp=3"],
                               ["topology.prefill.chips_per_instance", "[0, 1, 2]",
                                "3 chips per process"]),
    "mesh_mismatch": (["topology=1p1d_v6e8", "topology.prefill.mesh.tp=2"],
                      ["topology.prefill.mesh.tp", "2", "4 chips"]),
    "duplicate_ports": (["topology=2p2d_cpu", "+topology.decode.port_overrides={0: {zmq: 32000}}"],
                        ["topology.decode.port_overrides.0.zmq", "32000", "prefill_0 (zmq)"]),
    "zero_instances": (["topology.decode.instances=0"],
                       ["topology.decode.instances", "0", "at least one instance"]),
    "unknown_accelerator": (["topology.accelerator=v9x-3"],
                            ["topology.accelerator", "v9x-3", "unknown accelerator"]),
    "accelerator_platform_mismatch": (["topology.platform=tpu"],
                                      ["topology.accelerator", "cpu-2", "platform"]),
    "unknown_platform": (["topology.platform=gpu"],
                         ["topology.platform", "gpu", "unknown platform"]),
    "unknown_mode": (["topology.mode=hybrid"], ["topology.mode", "hybrid", "unknown mode"]),
    "page_size_mismatch": (["+topology.decode.engine.page_size=32"],
                           ["topology.decode.engine.page_size", "32", "page_size=16"]),
    "kv_dtype_mismatch": (["+topology.prefill.engine.kv_dtype=bfloat16"],
                          ["topology.prefill.engine.kv_dtype", "bfloat16", "float32"]),
    "unknown_key": (["+topology.prefill.chip_count=2"],
                    ["topology error", "topology.prefill.chip_count", "2", "unknown key"]),
    # caught by Hydra while composing (the topology files extend the typed schema)
    "bad_type": (["topology.decode.instances=two"], ["topology.decode.instances", "two",
                                                     "could not be converted to Integer"]),
    "unknown_host": (["topology.proxy.host=gpu-box"], ["topology.proxy.host", "gpu-box",
                                                       "unknown host"]),
    "port_out_of_range": (["topology.ports.zmq_base=70000"],
                          ["topology.ports.zmq_base", "70000", "out of range"]),
    "bad_disaggregation_setting": (["disaggregation.transfer_raw_buffers=yes"],
                                   ["disaggregation.transfer_raw_buffers", "yes",
                                    "auto, true or false"]),
    "bad_kv_timeout": (["disaggregation.kv_timeout_s=0"],
                       ["disaggregation.kv_timeout_s", "0", "a number > 0"]),
    "bad_max_peers": (["disaggregation.side_channel_max_peers=0"],
                      ["disaggregation.side_channel_max_peers", "0", "an integer >= 1"]),
    "bad_peer_idle": (["disaggregation.side_channel_peer_idle_s=-1"],
                      ["disaggregation.side_channel_peer_idle_s", "-1", "a number > 0"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_error(case, tmp_path, capsys, free_ports):
    overrides, expected = CASES[case]
    err = launch_fails(tmp_path, capsys, free_ports, *overrides)
    if case != "bad_type":
        assert "topology error" in err
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"


def _bound_after_a_free_port(s: socket.socket) -> int:
    """Bind `s` to a port whose predecessor is free now (prefill_0's zmq port below), so that
    the one conflict the launch finds is decode_0's."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as below:
                below.bind(("127.0.0.1", port - 1))
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of adjacent ports found")


def test_port_already_bound_names_port_and_program(tmp_path, capsys, free_ports):
    with socket.socket() as s:
        port = _bound_after_a_free_port(s)
        s.listen()
        err = launch_fails(tmp_path, capsys, free_ports, f"topology.ports.zmq_base={port - 1}")
    assert "topology.ports.zmq_base" in err and str(port) in err
    assert "decode_0" in err and "already in use" in err


def test_unknown_topology_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["launch", f"hydra.run.dir={run}", "topology=nope_9"]) == 2
    assert not run.exists()
