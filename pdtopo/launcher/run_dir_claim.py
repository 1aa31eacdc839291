"""A fresh default run directory for every launch or render, even two started in the same second.

The default `hydra.run.dir` (conf/config.yaml: outputs/DATE/HH-MM-SS) names the directory to the
second, and Hydra creates it with exist_ok, so two launches (or renders) in one second would share
it and the second would be refused ("already holds a deployment"). So before Hydra runs,
`claim_default_run_dir(flags, overrides)` resolves that default name itself, with Hydra's own
`now` resolver, and claims it with a plain mkdir, which exactly one process wins; when the name is
taken it claims NAME-2, NAME-3, ... (listed next to NAME). The claimed path reaches Hydra as a
`hydra.run.dir=` override, so the job runs there.

Nothing is claimed (Hydra decides, as before) when the command line sets `hydra.run.dir` (a
named directory that holds a deployment stays refused), runs a multirun, passes any Hydra flag
(--cfg, --help, --info, -m, another config: no job, or another default), or when the default name
needs more than the clock to resolve.

    claim_default_run_dir(flags, overrides) -> the claimed directory, or None
    claim_run_dir(base)                     -> base or base-N, created by this call
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import setup_globals
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pdtopo.config.compose import conf_dir

MAX_SUFFIX = 1000


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").strip()


def default_run_dir_pattern() -> str | None:
    """conf/config.yaml's `hydra.run.dir`, unresolved (None: not set there)."""
    data = OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml"), resolve=False)
    raw = ((data.get("hydra") or {}).get("run") or {}).get("dir")
    return str(raw) if raw else None


def claim_run_dir(base: Path) -> Path:
    """Create `base`, or the first free `base-N` (N = 2, 3, ...), atomically; return it."""
    for n in range(1, MAX_SUFFIX + 1):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        for _ in range(3):  # another launcher may remove an empty parent meanwhile
            base.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.mkdir()
                return path
            except FileExistsError:
                break
            except FileNotFoundError:
                continue
    raise FileExistsError(f"hydra.run.dir: {base} and {base.name}-2 .. {base.name}-{MAX_SUFFIX} "
                          "all exist; set hydra.run.dir to a new directory")


def claim_default_run_dir(flags: Sequence[str], overrides: Sequence[str]) -> Path | None:
    """The default run dir, claimed for this process; None where Hydra should decide."""
    if flags or any(_key(o) in ("hydra.run.dir", "hydra.mode") for o in overrides):
        return None
    pattern = default_run_dir_pattern()
    if not pattern:
        return None
    setup_globals()  # Hydra's `now` resolver (Hydra registers it again when it starts)
    try:
        name = str(OmegaConf.create({"dir": pattern}).dir)
    except OmegaConfBaseException:  # it interpolates the config: leave it to Hydra
        return None
    return claim_run_dir(Path(name))
