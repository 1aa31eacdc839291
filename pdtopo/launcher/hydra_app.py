"""Run a launcher job under Hydra's app machinery (so --cfg, --help, -m and run dirs work).

`run_app(verb, argv, job)` builds a `hydra.main` app over conf/, runs it with `argv` as the
command line and calls `job(cfg, run_dir, is_multirun)` for each job; returns the worst exit
code. Hydra is told not to write its .hydra/ subdir or a log file into the run dir, so a job
that fails validation leaves no directory behind. A Hydra composition error exits 2. The default
run dir is claimed first (`run_dir_claim`: NAME-2, ... when two start in the same second); one
that the job left empty is removed afterwards.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pdtopo.config.compose import conf_dir
from pdtopo.launcher.render.run_dir import remove_if_empty
from pdtopo.launcher.run_dir_claim import claim_default_run_dir
from pdtopo.logs import quiet_http_clients, root_logging_restored

HYDRA_DEFAULTS = ("hydra.output_subdir=null", "hydra/job_logging=stdout",
                  "hydra.help.app_name=pdtopo", "hydra.job.name=pdtopo")
# Hydra flags that take a value (argparse needs the overrides to be one contiguous run)
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
_OPTIONAL_VALUE = {"--info", "-i"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate Hydra flags (with their values) from key=value overrides."""
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-"):
            flags.append(arg)
            if arg in _VALUE_FLAGS and i + 1 < len(argv):
                nxt = argv[i + 1]
                if arg not in _OPTIONAL_VALUE or nxt in _INFO_CHOICES:
                    flags.append(nxt)
                    i += 1
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides

Job = Callable[[DictConfig, Path, bool], int]


def _quoted(value: str) -> str:
    """`value` as one quoted string of Hydra's override grammar (spaces, commas, quotes)."""
    value = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)  # \ escapes only
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, value) + "'"  # before a quote


def run_app(verb: str, argv: Sequence[str], job: Job) -> int:
    codes: list[int] = []

    def task(cfg: DictConfig) -> None:
        quiet_http_clients(logging.getLogger().getEffectiveLevel())  # after Hydra's logging
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir).resolve()
        codes.append(job(cfg, run_dir, hc.mode == RunMode.MULTIRUN))

    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(task)
    saved = sys.argv
    flags, overrides = split_argv(argv)
    try:
        claimed = claim_default_run_dir(flags, overrides)
    except OSError as exc:
        print(f"pdtopo {verb}: {exc}", file=sys.stderr)
        return 2
    if claimed is not None:
        overrides.append(f"hydra.run.dir={_quoted(str(claimed))}")
    sys.argv = [f"pdtopo {verb}", *flags, *HYDRA_DEFAULTS, *overrides]
    try:
        with root_logging_restored():  # Hydra's job logging ends with the command
            app()
    except SystemExit as exc:
        if exc.code not in (0, None):
            return 2
    finally:
        sys.argv = saved
        if claimed is not None:
            remove_if_empty(claimed)  # a composition error ran no job
    return max(codes, default=0)
