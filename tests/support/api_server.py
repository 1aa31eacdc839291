"""The colocated server of the API tests: a real pdtopo server process with a tiny model and
fast warmup, on one CPU device, whose SIGTERM shutdown must exit 0. Starting and stopping is
`tests.support.e2e.ColocatedServer`."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from tests.support.constants import ONE_DEVICE, TINY_OVERRIDES
from tests.support.e2e import ColocatedServer, port_block


@contextmanager
def direct_server(tmp_path: Path, extra: list[str] | None = None):
    """Yield the URL of a server started in the direct form (--port + hydra overrides)."""
    with ColocatedServer(None, [*TINY_OVERRIDES, *(extra or [])], tmp_path / "server.log",
                         env=ONE_DEVICE, check_exit=True) as server:
        yield server.url


@contextmanager
def run_dir_server(tmp_path: Path):
    """The launcher's form: a run dir with config.yaml + plan.json naming one colocated
    process; yield its URL."""
    from omegaconf import OmegaConf

    from pdtopo.config.compose import compose_config

    port = port_block(1)
    cfg = compose_config(TINY_OVERRIDES + ["engine.served_model_name=tiny-served"])
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    process = {"name": "colocated_0", "role": "colocated", "host": "localhost",
               "address": "127.0.0.1", "instance_id": "colocated_0",
               "rank": {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1},
               "chips": [0], "mesh": {"tp": 1}, "ports": {"http": port},
               "cpu_affinity": sorted(os.sched_getaffinity(0))}
    (run / "plan.json").write_text(json.dumps({"processes": [process]}))
    with ColocatedServer(port, log_path=tmp_path / "server.log", run_dir=run,
                         process="colocated_0", env=ONE_DEVICE, check_exit=True) as server:
        yield server.url
