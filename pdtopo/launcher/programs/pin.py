"""Exec wrapper that pins a program to CPU cores: `python -m pdtopo.launcher.programs.pin 0,1 -- CMD...`.

supervisord has no CPU-affinity option, so the rendered program command for a process with
`cpu_affinity` runs through this module: it sets the affinity of its own process and then
`exec`s the real command, so the PID supervisord tracks is the program's PID.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m pdtopo.launcher.programs.pin CORE[,CORE...] -- COMMAND [ARGS...]")
    cores = {int(c) for c in args[0].split(",") if c.strip()}
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError) as exc:  # not Linux, or cores not in our cgroup
        print(f"pdtopo.launcher.programs.pin: cannot pin to {sorted(cores)}: {exc}", file=sys.stderr)
    os.execvp(args[2], args[2:])


if __name__ == "__main__":
    main()
