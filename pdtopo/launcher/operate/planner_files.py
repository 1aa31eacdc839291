"""The live planner's files in a run dir, shared by the planner program
(pdtopo.launcher.programs.planner), `pdtopo scale`, `pdtopo planner`, `pdtopo status` and
`pdtopo top`:

    RUN/planner.log         one JSON line per event: "start" (settings, budget, capacity
                            source), "decision" (Decision.to_dict, whether it was carried out,
                            why not, what each instance showed), "outcome" (a change ended:
                            ok or failed, how long it took, the counts it left)
    RUN/planner.json        the latest status: mode, counts, the last decision, the change
                            under way, the pause, the tallies (what status and top show)
    RUN/planner.prom        the pdtopo:planner_* metrics in Prometheus' text format, rewritten
                            every interval (node_exporter's textfile collector reads *.prom)
    RUN/planner.paused      present while the planner must not act; its text says why (a
                            `pdtopo scale` by hand, `pdtopo planner pause`); `pdtopo planner
                            resume` removes it
    RUN/planner_state.json  what a restarted planner carries on from: hysteresis, back-off,
                            the change under way, the tallies
    RUN/.scale.lock         held (fcntl) by `pdtopo scale` while it changes the deployment: a
                            second scale, by hand or the planner's, waits for it

`pdtopo scale` run by the planner carries SCALE_BY_ENV=planner and SCALE_EXPECT_ENV (the
counts it decided from): it refuses when the planner is paused or the deployment no longer
has those counts (changed under it). Run by hand on a deployment whose planner acts, it
pauses the planner before changing anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pdtopo.config.run_files import CONFIG_FILE

DECISIONS_LOG = "planner.log"
STATUS_FILE = "planner.json"
METRICS_FILE = "planner.prom"
PAUSE_FILE = "planner.paused"
STATE_FILE = "planner_state.json"
SCALE_LOCK = ".scale.lock"
SCALE_BY_ENV = "PDTOPO_SCALE_BY"          # "planner" when the planner runs `pdtopo scale`
SCALE_EXPECT_ENV = "PDTOPO_SCALE_EXPECT"  # "prefill=N,decode=M": the counts it decided from


def write_atomic(path: Path, text: str) -> None:
    """A reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_line(run_dir: Path, record: dict[str, Any]) -> None:
    with (run_dir / DECISIONS_LOG).open("a") as fh:
        fh.write(json.dumps(record, default=str) + "\n")


def read_lines(run_dir: Path, last: int | None = None) -> list[dict[str, Any]]:
    """The planner.log records (the `last` ones), skipping a line cut short."""
    try:
        lines = (run_dir / DECISIONS_LOG).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines[-last:] if last else lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_status(run_dir: Path) -> dict[str, Any] | None:
    return read_json(run_dir / STATUS_FILE)


def stamp(at: float | None) -> str:
    return "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))


def pause(run_dir: Path, reason: str) -> None:
    write_atomic(run_dir / PAUSE_FILE, f"{reason} (at {stamp(time.time())})\n")


def paused(run_dir: Path) -> str | None:
    """Why the planner is paused, None when it is not."""
    try:
        return (run_dir / PAUSE_FILE).read_text().strip() or "paused"
    except OSError:
        return None


def resume(run_dir: Path) -> str | None:
    """Lift the pause; returns why it was paused (None: it was not)."""
    why = paused(run_dir)
    if why is not None:
        (run_dir / PAUSE_FILE).unlink(missing_ok=True)
    return why


def planner_settings(run_dir: Path) -> dict[str, Any] | None:
    """The run's `planner` node (config.yaml, resolved), None without one."""
    try:
        cfg = OmegaConf.load(run_dir / CONFIG_FILE)
    except (OSError, ValueError):
        return None
    node = cfg.get("planner") if hasattr(cfg, "get") else None
    return None if node is None else OmegaConf.to_container(node, resolve=True)  # type: ignore


def planner_acts(run_dir: Path) -> bool:
    node = planner_settings(run_dir)
    return bool(node and node.get("enabled") and node.get("mode") == "act")


def format_counts(counts: dict[str, int]) -> str:
    return ",".join(f"{role}={n}" for role, n in sorted(counts.items(), reverse=True))


def parse_counts_text(text: str) -> dict[str, int]:
    """"prefill=2,decode=1" -> {"prefill": 2, "decode": 1} (format_counts' inverse)."""
    out = {}
    for item in text.split(","):
        role, _, n = item.partition("=")
        if role and n.isdigit():
            out[role.strip()] = int(n)
    return out


@contextmanager
def scale_lock(run_dir: Path, holder: str, say: Callable[[str], None]) -> Iterator[None]:
    """Hold RUN/.scale.lock for one scale; waits (saying for whom) while another holds it."""
    fd = os.open(run_dir / SCALE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another scale"
            say(f"waiting for the scale under way ({other}) to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder}, pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def scale_under_way(run_dir: Path) -> str | None:
    """Who holds the scale lock now (None: nobody)."""
    path = run_dir / SCALE_LOCK
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a scale"
        return None
    finally:
        os.close(fd)


def guard_scale(run_dir: Path, before: dict[str, int], args: list[str],
                say: Callable[[str], None]) -> str | None:
    """Called by `pdtopo scale` (holding the lock) once it knows it will change something:
    the planner's own scale is refused (the reason returned) when the planner is paused or
    the deployment moved from the counts it decided on; a scale by hand pauses an acting
    planner."""
    if os.environ.get(SCALE_BY_ENV) == "planner":
        why = paused(run_dir)
        if why is not None:
            return f"the planner is paused ({why})"
        expect = parse_counts_text(os.environ.get(SCALE_EXPECT_ENV, ""))
        if expect and expect != before:
            return (f"the planner decided on {format_counts(expect)}, the deployment has "
                    f"{format_counts(before)} now")
        return None
    if planner_acts(run_dir) and paused(run_dir) is None:
        pause(run_dir, f"`pdtopo scale {' '.join(args)}` by hand")
        say(f"the planner is paused until `pdtopo planner resume {run_dir}` (a scale by hand "
            "overrides it)")
    return None


def summary(status: dict[str, Any] | None, pause_reason: str | None = None) -> str | None:
    """One line on the planner for `pdtopo status` / `pdtopo top` (None: no planner status)."""
    if not status:
        return None
    counts = status.get("counts") or {}
    shape = f"{counts.get('prefill', '?')}P{counts.get('decode', '?')}D"
    text = f"planner ({status.get('mode')}, every {status.get('interval_s', 0):g} s): {shape}"
    last = status.get("last_decision")
    if last:
        target = last.get("target") or {}
        text += (f"; last decision {stamp(last.get('at'))}: {last.get('label')} -> "
                 f"{target.get('prefill', '?')}P{target.get('decode', '?')}D "
                 f"({last.get('reason')})")
    if status.get("in_flight"):
        text += f"; under way: {status['in_flight']}"
    change = status.get("last_change")
    if change and not status.get("in_flight"):
        text += (f"; last change {change.get('label')} "
                 f"{'done' if change.get('ok') else 'FAILED'} in {change.get('took_s', 0):.0f} s")
    why = pause_reason if pause_reason is not None else status.get("paused")
    if why:
        text += f"; PAUSED: {why} (`pdtopo planner resume`)"
    return text
