"""`pdtopo tune [overrides]`: compose the config (topology=NAME, tune.*, bench.*), run the
search (pdtopo.tune.run) and report. Exit 0 when a candidate met the goodput target, 1 when
none did, 2 on bad input (named by key), 130 on Ctrl-C (finished steps are kept)."""

from __future__ import annotations

import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from pdtopo.config.schema import TopologyError
from pdtopo.launcher.operate import display
from pdtopo.tune.run import tune

USAGE = """usage: pdtopo tune topology=NAME [tune.KEY=VALUE ...] [bench.KEY=VALUE ...]
  tune.chips=N                 chip budget (default: every chip of the topology's host)
  tune.goodput_target=0.9      fraction of requests within bench.slo at a passing rate
  tune.max_runs_per_candidate  bench runs per candidate (grow the rate, then bisect)
  tune.max_candidates          candidates at most
  tune.dry_run=true            list the candidates and their plans; start nothing
  tune.dir=PATH                results (a rerun resumes from them)"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    flags = [a for a in argv if a.startswith("-")]
    if flags:
        print(f"pdtopo tune: unknown option {flags[0]}\n{USAGE}", file=sys.stderr)
        return 2
    con, err = display.console(), display.console(stderr=True)
    try:
        return tune(list(argv), con)
    except TopologyError as exc:
        display.print_topology_error(exc, err)
        return 2
    except (HydraException, OmegaConfBaseException) as exc:
        err.print(f"[bold red]pdtopo tune:[/] {exc}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("pdtopo tune: interrupted; finished runs are kept, run the same command "
                  "again to resume")
        return 130
