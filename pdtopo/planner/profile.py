"""Measured per-instance capacity on disk (`planner.capacity.profile`), as an `InstanceProfile`.

    profile = load_profile(path, chips=1, max_batch=32, input_len=..., output_len=...)

Two formats:

- a planner profile JSON: `{"prefill_tps": 8000, "decode_tps": [[1, 60], [32, 1100]],
  "max_batch": 32, "transfer_s_per_token": 2e-6, "chips": 1}` (InstanceProfile.to_dict; what
  a measurement writes, e.g. benchmarks/bench_planner.py);
- a `pdtopo tune` result dir (tune.dir): runs/<slug>-<key>/rate_<rate>.json per bench run, a
  PD candidate's slug `pd-<p>p<tp>-<d>d<tp'>` (pdtopo/tune/candidates.py). For every PD
  candidate whose instances of a role hold `chips` chips, at the highest rate that passed
  (goodput fraction >= `goodput_target`, tune's own test): a P's prompt tokens/s is the run's
  input token throughput / p, raised to input_len / TTFT p50 of the candidate's lowest-rate
  run when that is higher (one prompt alone: a lower bound of its flat-out rate); a D's point
  is (its mean batch by Little's law, output token throughput / d), the batch being
  request_throughput / d x (E2E mean - TTFT mean). The profile keeps the best P rate and
  the best tokens/s per batch size over the candidates. These rates were sustained within the
  SLOs tune ran under, so the profile underestimates a faster instance rather than
  overestimating a slower one. Records written before tune kept token throughputs and the
  workload need `input_len` / `output_len` (the composed config's bench.*).

ProfileError (a ValueError) names the path and what is missing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pdtopo.planner.capacity import InstanceProfile

PD_SLUG = re.compile(r"^pd-(\d+)p(\d+)-(\d+)d(\d+)-[0-9a-f]+$")


class ProfileError(ValueError):
    pass


def load_profile(path: str | Path, *, chips: int = 1, max_batch: int = 32,
                 input_len: int | None = None, output_len: int | None = None,
                 goodput_target: float = 0.9) -> InstanceProfile:
    p = Path(path).expanduser()
    if p.is_dir():
        return profile_from_tune_dir(p, chips=chips, max_batch=max_batch, input_len=input_len,
                                     output_len=output_len, goodput_target=goodput_target)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{p}: not a readable planner profile ({exc})") from None
    return profile_from_dict(data, str(p))


def profile_from_dict(data: dict[str, Any], source: str = "") -> InstanceProfile:
    try:
        return InstanceProfile(
            prefill_tps=float(data["prefill_tps"]),
            decode_tps=tuple((int(b), float(t)) for b, t in data["decode_tps"]),
            max_batch=int(data["max_batch"]),
            transfer_s_per_token=float(data.get("transfer_s_per_token", 0.0)),
            chips=int(data.get("chips", 1)), source=source or str(data.get("source", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{source or 'profile'}: {exc!r} (want prefill_tps, decode_tps "
                           "[[batch, tokens/s], ...], max_batch)") from None


def _records(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(run_dir.glob("rate_*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("stats"), dict):
            out.append(rec)
    return sorted(out, key=lambda r: float(r.get("rate", 0.0)))


def _mean(stats: dict[str, Any], key: str) -> float | None:
    value = (stats.get(key) or {}).get("mean")
    return None if value is None else float(value)


def _lengths(rec: dict[str, Any], input_len: int | None, output_len: int | None
             ) -> tuple[float | None, float | None]:
    work = rec.get("workload") or {}
    return work.get("input_len", input_len), work.get("output_len", output_len)


def _throughput(stats: dict[str, Any], key: str, length: float | None) -> float | None:
    value = stats.get(key)
    if value is not None:
        return float(value)
    rate = stats.get("request_throughput")
    return None if rate is None or length is None else float(rate) * float(length)


def profile_from_tune_dir(root: Path, *, chips: int, max_batch: int,
                          input_len: int | None = None, output_len: int | None = None,
                          goodput_target: float = 0.9) -> InstanceProfile:
    prefill = 0.0
    points: dict[int, float] = {}
    for run_dir in sorted((root / "runs").glob("pd-*")):
        m = PD_SLUG.match(run_dir.name)
        records = _records(run_dir)
        if not m or not records:
            continue
        p, tp, d, td = (int(g) for g in m.groups())
        passed = [r for r in records if float(r.get("goodput", 0.0)) >= goodput_target]
        if not passed:
            continue
        best = passed[-1]
        stats = best["stats"]
        in_len, out_len = _lengths(best, input_len, output_len)
        if tp == chips:
            tput = _throughput(stats, "input_token_throughput", in_len)
            if tput:
                prefill = max(prefill, tput / p)
            first = records[0]["stats"]
            ttft50 = (first.get("ttft_ms") or {}).get("p50")
            if ttft50 and in_len:
                prefill = max(prefill, float(in_len) / (float(ttft50) / 1e3))
        if td == chips:
            tput = _throughput(stats, "output_token_throughput", out_len)
            rate, e2e, ttft = stats.get("request_throughput"), _mean(stats, "e2e_ms"), \
                _mean(stats, "ttft_ms")
            if tput and rate and e2e is not None and ttft is not None:
                batch = max(1, min(max_batch, round(float(rate) / d * (e2e - ttft) / 1e3)))
                points[batch] = max(points.get(batch, 0.0), tput / d)
    if not prefill or not points:
        missing = "a passing PD run with P" if not prefill else "a passing PD run with D"
        raise ProfileError(f"{root}: no per-instance capacity for {chips}-chip instances "
                           f"({missing} instances of {chips} chips, and the workload's "
                           "lengths: bench.input_len / output_len)")
    return InstanceProfile(prefill_tps=prefill, decode_tps=tuple(sorted(points.items())),
                           max_batch=max_batch, chips=chips, source=f"tune:{root}")
