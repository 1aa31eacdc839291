"""`pdtopo planner status|pause|resume [RUN_DIR]`: the live planner of a running deployment.

    status   the planner program's state (supervisord), its mode, counts, pause, the change
             under way, the last change and the last decisions (RUN/planner.log)
    pause    stop it acting (it keeps deciding and logging): RUN/planner.paused
    resume   let it act again (after a `pdtopo scale` by hand paused it, or `pause`)

Exit codes: 0 ok, 1 the run's planner program is not running (status), 2 no planner in
this run.
"""

from __future__ import annotations

import configparser
from pathlib import Path

from pdtopo.launcher.operate import display
from pdtopo.launcher.operate import planner_files as files
from pdtopo.launcher.operate.supervisor_control import CALL_ERRORS, Supervisor
from pdtopo.launcher.render.supervisord import PLANNER_PROGRAM

ACTIONS = ("status", "pause", "resume")
RECENT = 5  # decisions `status` lists


def _program_state(run_dir: Path) -> str:
    try:
        state, pid = Supervisor(run_dir).states().get(PLANNER_PROGRAM, ("not in supervisord", 0))
    except (*CALL_ERRORS, configparser.Error):
        return "supervisord does not answer"
    return f"{state}" + (f" (pid {pid})" if pid else "")


def run(run_dir: Path, action: str) -> int:
    con = display.console()
    node = files.planner_settings(run_dir)
    if not node or not node.get("enabled"):
        display.console(stderr=True).print(
            f"[bold red]pdtopo planner:[/] {run_dir} runs no planner (planner.enabled=false); "
            "launch it with planner.enabled=true")
        return 2
    if action == "pause":
        if files.paused(run_dir) is None:
            files.pause(run_dir, "`pdtopo planner pause`")
        con.print(f"planner paused: {files.paused(run_dir)}; it keeps deciding and logging "
                  f"(`pdtopo planner resume {run_dir}` lets it act)")
        return 0
    if action == "resume":
        was = files.resume(run_dir)
        con.print("planner resumed" + (f" (was paused: {was})" if was else " (it was not "
                                       "paused)"))
        return 0
    state = _program_state(run_dir)
    con.print(f"planner program: {state}; mode {node.get('mode')}, every "
              f"{node.get('interval_s')} s; log {run_dir / files.DECISIONS_LOG}")
    line = files.summary(files.read_status(run_dir), files.paused(run_dir))
    con.print(line or "no decision yet (the planner decides once it has two scrapes of "
              "the instances)", markup=False)
    recent = [r for r in files.read_lines(run_dir, last=200) if r.get("event") == "decision"]
    for r in recent[-RECENT:]:
        target = r.get("target") or {}
        done = "started" if r.get("acted") else (r.get("not_acted") or
                                                  ("recommended" if r.get("action") != "none"
                                                   else ""))
        con.print(f"  {files.stamp(r.get('at'))} {r.get('label')} -> "
                  f"{target.get('prefill')}P{target.get('decode')}D"
                  f"{f' [{done}]' if done else ''}: {r.get('reason')}", markup=False)
    return 0 if state.startswith("RUNNING") else 1
