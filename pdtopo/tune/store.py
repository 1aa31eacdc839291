"""Tune results on disk, one JSON file per finished step, so that a rerun resumes.

    store = ResultStore(tune_dir)
    key = run_key(candidate_cfg)                    # the candidate's config and workload
    store.rate(cand, key, rate) / store.save_rate(cand, key, rate, record)
    store.launch(cand, key)     / store.save_launch(cand, key, record)

Layout under `tune.dir`: runs/<candidate slug>-<key>/rate_<rate>.json (one bench run: its
goodput fraction and stats) and launch.json (launch time, or the error of a launch that
failed: the candidate is then skipped on reruns; delete the file to try it again). The key is
a hash of the candidate's composed config without what does not change a result (the request
rate, which has its own file; ports and placements; launcher, tune and planner settings;
progress and output switches), so a changed workload, model or engine setting never reuses an
old result. Each rate's record also keeps the workload's lengths and token throughputs: the
capacity profile pdtopo/planner/profile.py reads. Files are written whole (temp file, then
rename): a kill leaves finished steps only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pdtopo.tune.candidates import Candidate

_UNKEYED = {"tune": None, "launcher": None, "hydra": None, "sweep": None, "planner": None,
            "bench": ("request_rate", "progress", "output"),
            "topology": ("ports", "bootstrap", "proxy", "name")}


def run_key(cfg: DictConfig) -> str:
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    for group, keys in _UNKEYED.items():
        if keys is None:
            data.pop(group, None)
        elif isinstance(data.get(group), dict):
            for k in keys:
                data[group].pop(k, None)
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ResultStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def dir(self, cand: Candidate, key: str) -> Path:
        return self.root / "runs" / f"{cand.slug}-{key}"

    def _rate_file(self, cand: Candidate, key: str, rate: float) -> Path:
        return self.dir(cand, key) / f"rate_{rate:.6g}.json"

    def rate(self, cand: Candidate, key: str, rate: float) -> dict[str, Any] | None:
        return _read(self._rate_file(cand, key, rate))

    def save_rate(self, cand: Candidate, key: str, rate: float, record: dict[str, Any]) -> None:
        _write(self._rate_file(cand, key, rate), record)

    def launch(self, cand: Candidate, key: str) -> dict[str, Any] | None:
        return _read(self.dir(cand, key) / "launch.json")

    def save_launch(self, cand: Candidate, key: str, record: dict[str, Any]) -> None:
        _write(self.dir(cand, key) / "launch.json", record)
