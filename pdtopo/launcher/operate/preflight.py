"""Pre-flight before anything starts, the I/O half of plan validation: the model, the
platform and the host's ports.

The planner is pure and never reads the model; `check_model(cfg, plan)` does, once per
`pdtopo launch` / `render`, after the plan is expanded and before supervisord starts:
  1. the model config (`model_config_from_cfg`: the `model:` group, and config.json when
     `model.path` is set; a packaged file is fetched and a GGUF file converted first, with
     progress in the log: `pdtopo.model_config.sources`), refusing every unsupported feature by key and
     value;
  2. the checkpoint's tensors against that config (safetensors headers only: names, shapes,
     nothing left over);
  3. every serving process's tensor-parallel size against the model's head and MLP sizes;
and `check_platform(plan)`: a `tpu` plan launched on a host without TPU devices is refused
with the emulation hint (`topology.platform=cpu` runs the same chip split on CPU devices).
Each problem is a `ModelError` (a TopologyError: exit 2, key and value named), so a refused
checkpoint fails the launch at once instead of crash-looping its programs until the health
timeout. A packaged model (the default, SmolLM2) that cannot be fetched (no index reachable,
nothing in `model.cache_dir`) fails here too, before supervisord starts, naming the
`pdtopo fetch` command to run where the index is reachable and `model=tiny_llama`, which needs
no download. With `strict=False` (render, a dry run: the checkpoint may live only where the
programs run, and a TPU topology is often rendered with a model its tp cannot split) a `model.path`
that does not exist here skips steps 1-2 and a tp that cannot split the model is reported as a
warning; a checkpoint that exists here and is refused is an error either way.
`wait_ports_free(plan)` refuses a launch whose ports are bound on this host (retried for a
sweep job, whose previous job may still be releasing them), naming the port's config key.
"""

from __future__ import annotations

import glob
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pdtopo.config.schema import TopologyError
from pdtopo.launcher.plan.expand import Plan
from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.shapes import check_tp
from pdtopo.model_config.sources.fetch_cli import fetch_command
from pdtopo.model_config.sources.package_fetch import FetchError, WheelHashMismatch
from pdtopo.model_config.sources.resolve import cache_dir_of, source_path
from pdtopo.model_config.spec import ModelConfig, model_config_from_cfg
from pdtopo.model_config.tensors import check_checkpoint
from pdtopo.ports import port_in_use

SERVING_ROLES = ("prefill", "decode", "colocated", "local")
LOCAL_SLICE_KEYS = {"prefill": "topology.prefill_slices", "decode": "topology.decode_slices"}


class ModelError(TopologyError):
    """A model or checkpoint the plan cannot serve (shown as 'model error')."""

    kind = "model"


def _model_config(cfg: DictConfig, path: str | None) -> ModelConfig:
    try:
        return model_config_from_cfg(cfg.model)
    except CheckpointError as e:
        if e.where == "model":  # a value of the `model:` group itself
            raise ModelError(e.key if e.key.startswith("model.") else f"model.{e.key}",
                             e.value, e.message) from e
        raise ModelError("model.path", path, f"{e.where}: {e.key}={e.value!r}: {e.message}") from e
    except FileNotFoundError as e:
        raise ModelError("model.path", path, str(e)) from e
    except WheelHashMismatch as e:  # its message says what to do
        raise ModelError("model.package", path, str(e)) from e
    except FetchError as e:
        raise ModelError("model.package", path, f"{e}\n{_unfetched_hint(cfg)}") from e
    except ImportError as e:  # an optional reader (gguf) not installed
        raise ModelError("model.path", path, str(e)) from e
    except OSError as e:  # the cache not writable, a full disk while converting
        raise ModelError("model.cache_dir", OmegaConf.select(cfg, "model.cache_dir"),
                         str(e)) from e
    except (KeyError, ValueError) as e:
        raise ModelError("model", OmegaConf.select(cfg, "model.name"),
                         str(e.args[0] if isinstance(e, KeyError) else e)) from e


def _unfetched_hint(cfg: DictConfig) -> str:
    group = OmegaConf.to_container(cfg.model, resolve=True)
    return (f"Nothing was started. Fetch the model where the package index is reachable: "
            f"`{fetch_command(group)}` (or copy a fetched {cache_dir_of(group)} here), or "
            "serve the tiny random model instead, which downloads nothing: "
            "`pdtopo launch model=tiny_llama`")


def _tp_checks(plan: Plan) -> list[tuple[str, int]]:
    """(config key, tp) of every engine the plan runs."""
    checks = []
    for proc in plan.processes:
        if proc.role == "local":  # mesh: engine name -> devices (one tp mesh each)
            checks += [(LOCAL_SLICE_KEYS[name.rsplit("_", 1)[0]], int(size))
                       for name, size in proc.mesh.items()]
        elif proc.role in SERVING_ROLES:
            checks.append((f"topology.{proc.role}.mesh.tp", int(proc.mesh.get("tp", 1))))
    return list(dict.fromkeys(checks))


def tpu_devices() -> list[str]:
    """TPU device files of this host (TPU VMs expose /dev/accel* or /dev/vfio/N)."""
    return sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))


def check_platform(plan: Plan, devices: list[str] | None = None) -> None:
    """A TPU plan whose programs start here needs this host's TPU devices."""
    if plan.platform != "tpu" or not any(p.role in SERVING_ROLES for p in plan.processes):
        return
    if (tpu_devices() if devices is None else devices):
        return
    raise TopologyError("topology.platform", "tpu",
                        "this host has no TPU devices (no /dev/accel*, no /dev/vfio/N); to "
                        "run this topology here with CPU devices standing in for the chips "
                        "(same chip split, emulated): topology.platform=cpu")


def check_model(cfg: DictConfig, plan: Plan, *, strict: bool = True) -> list[str]:
    """Validate the model for `plan` (see module docstring); returns warnings."""
    return checked_model(cfg, plan, strict=strict)[0]


def checked_model(cfg: DictConfig, plan: Plan, *, strict: bool = True
                  ) -> tuple[list[str], ModelConfig | None]:
    """`check_model`'s warnings, and the model config it read (None where it read none)."""
    if not any(p.role in SERVING_ROLES for p in plan.processes):
        return [], None  # this host runs no model (bootstrap / proxy only)
    group = OmegaConf.to_container(cfg.model, resolve=True)
    try:
        path = source_path(group, fetch=False)  # where a packaged file lives once fetched
    except ValueError as e:
        raise ModelError("model.package", group.get("package"), str(e)) from e
    # a local GGUF file is converted here even for a dry run (render): it is on this machine
    if path and not strict and not Path(str(path)).exists():
        key = "model.path" if OmegaConf.select(cfg, "model.path") else "model.package"
        return [f"{key}: {str(path)!r} does not exist on this machine: the checkpoint was "
                "not checked (pdtopo launch fetches and checks it where the programs run)"], None
    model = _model_config(cfg, path)
    if model.path:
        try:
            check_checkpoint(model)
        except (KeyError, ValueError, FileNotFoundError) as e:
            raise ModelError("model.path", path,
                             str(e.args[0] if isinstance(e, KeyError) else e)) from e
    warnings = []
    for key, tp in _tp_checks(plan):
        try:
            check_tp(model, tp)
        except ValueError as e:
            why = (f"{e}; or serve a model whose heads split {tp} ways (model=hf_local "
                   "model.path=..., or model=tiny_llama to try the topology)")
            if strict:
                raise ModelError(key, tp, why) from e
            warnings.append(f"{key}={tp}: {why}; its programs would fail at start")
    return warnings, model


def check_ports_free(plan: Plan) -> None:
    """Raise TopologyError naming the first port of the plan that is already in use."""
    for proc in plan.processes:
        for kind, port in proc.ports.items():
            if port_in_use(proc.address, port):
                key = proc.port_keys.get(kind, f"{proc.name}.ports.{kind}")
                raise TopologyError(key, port, f"port {port} for program {proc.name} ({kind}) "
                                               f"is already in use on {proc.address}")


def wait_ports_free(plan: Plan, timeout_s: float = 0.0, poll_s: float = 0.5) -> None:
    """`check_ports_free`, retried for up to `timeout_s` (a previous deployment on the same
    ports may still be shutting down)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_ports_free(plan)
            return
        except TopologyError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)
