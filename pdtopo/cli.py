"""`pdtopo` command line: dispatch on the verb, hand config-composing verbs to Hydra.

  pdtopo launch [--detach] <hydra overrides> [-m]   bring a deployment up (launcher/operate/launch.py)
  pdtopo render [--format k8s] <hydra overrides>    write the run dir only (dry run); k8s:
                                                    also RUN/k8s/ (GKE manifests)
  pdtopo status [RUN_DIR] | stop [RUN_DIR]          operate on a run (latest by default)
  pdtopo logs PROGRAM [RUN_DIR] [-f]
  pdtopo drain PROGRAM|ROLE [RUN_DIR] [--undo] [--force]   take instances out of the router,
                                                    let their requests finish (launcher/operate/rolling.py)
  pdtopo restart PROGRAM|ROLE [RUN_DIR] [--force]   drain, restart, put back; one at a time
  pdtopo top [RUN_DIR] [--interval S] [--once]     live per-program table from /metrics
  pdtopo scale prefill=N decode=M [RUN_DIR]         add or remove instances of a running PD
                                                    deployment (launcher/operate/scale.py)
  pdtopo planner status|pause|resume [RUN_DIR]      the live P/D planner of a run
                                                    (planner.enabled=true; launcher/operate/planner_cli.py)
  pdtopo diff [--format rich|markdown] <overrides A> -- <overrides B>
  pdtopo diff --rev GITREV [--format ...] <overrides>
  pdtopo bench [URL] [--output FILE] [bench.KEY=VALUE ...]  benchmark a proxy/server (latest run)
  pdtopo tune topology=NAME [tune.KEY=VALUE ...] [bench.KEY=VALUE ...]   search the topologies
                                                    of a chip budget for goodput (pdtopo/tune/)
  pdtopo fetch MODEL [model.KEY=VALUE ...]          download / convert a model group's files into
                                                    its cache (pdtopo/model_config/sources/), e.g. smollm2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from pdtopo.bench.cli import main as bench_main
from pdtopo.config.compose import compose_config, conf_dir
from pdtopo.config.run_files import resolve_run_dir
from pdtopo.config.schema import TopologyError
from pdtopo.launcher.hydra_app import run_app
from pdtopo.launcher.operate import display, planner_cli, rolling, scale, stop_status, top
from pdtopo.launcher.operate.hosts import host_cpus, resolve_host_run
from pdtopo.launcher.operate.k8s_job import FORMATS, render_k8s_job
from pdtopo.launcher.operate.launch import LaunchOptions, launch_job
from pdtopo.launcher.operate.prepare import render_job
from pdtopo.launcher.render import diff
from pdtopo.model_config.sources.fetch_cli import main as fetch_main
from pdtopo.tune.cli import main as tune_main

USAGE = __doc__.split("\n\n", 1)[1]
EXIT_USAGE = 2


def _launch(argv: list[str]) -> int:
    detach = "--detach" in argv
    rest = [a for a in argv if a != "--detach"]
    return run_app("launch", rest, lambda cfg, run, multi: launch_job(
        cfg, run, LaunchOptions(detach=detach, multirun=multi)))


def _render(argv: list[str]) -> int:
    fmt, rest, i = "supervisord", [], 0
    while i < len(argv):  # --format k8s | --format=k8s (before Hydra sees the arguments)
        if argv[i] == "--format" or argv[i].startswith("--format="):
            fmt = argv[i + 1] if argv[i] == "--format" and i + 1 < len(argv) else \
                argv[i].partition("=")[2]
            i += 2 if argv[i] == "--format" else 1
            continue
        rest.append(argv[i])
        i += 1
    if fmt not in FORMATS:
        print(f"pdtopo render: --format must be one of {', '.join(FORMATS)}, got {fmt!r}",
              file=sys.stderr)
        return EXIT_USAGE
    job = render_k8s_job if fmt == "k8s" else render_job
    return run_app("render", rest, lambda cfg, run, multi: job(cfg, run))


def _run_dir_verb(verb: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"pdtopo {verb}")
    if verb == "logs":
        parser.add_argument("program")
    if verb in ("drain", "restart"):
        parser.add_argument("target", metavar="PROGRAM|ROLE",
                            help="a prefill/decode program (prefill_0) or a role (prefill)")
    parser.add_argument("run_dir", nargs="?", default=None)
    if verb == "logs":
        parser.add_argument("-f", "--follow", action="store_true")
    if verb == "top":
        parser.add_argument("--interval", type=float, default=2.0,
                            help="seconds between the two samples rates come from")
        parser.add_argument("--once", action="store_true",
                            help="print one table (two samples --interval apart) and exit")
    if verb == "drain":
        parser.add_argument("--undo", action="store_true",
                            help="put drained instances back into the router")
    if verb in ("drain", "restart"):
        parser.add_argument("--force", action="store_true",
                            help="also when no other instance of the role is serving")
    args = parser.parse_args(argv)
    try:
        run = resolve_host_run(resolve_run_dir(args.run_dir))
    except FileNotFoundError as exc:
        print(f"pdtopo {verb}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if verb == "status":
        return stop_status.status(run)
    if verb == "stop":
        return stop_status.stop(run)
    if verb == "top":
        if args.interval <= 0:
            parser.error(f"--interval must be > 0, got {args.interval:g}")
        return top.run(run, args.interval, args.once)
    if verb in ("drain", "restart"):
        return rolling.run(verb, run, args.target, undo=getattr(args, "undo", False),
                           force=args.force)
    return stop_status.logs(run, args.program, args.follow)


def _scale(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("usage: pdtopo scale prefill=N decode=M [RUN_DIR]  (either count or both)")
        return 0
    counts = [a for a in argv if "=" in a]
    rest = [a for a in argv if "=" not in a]
    if len(rest) > 1:
        print(f"pdtopo scale: one run dir at most, got {' '.join(rest)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run = resolve_host_run(resolve_run_dir(rest[0] if rest else None))
    except FileNotFoundError as exc:
        print(f"pdtopo scale: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return scale.run(run, counts)


def _planner(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdtopo planner")
    parser.add_argument("action", choices=planner_cli.ACTIONS)
    parser.add_argument("run_dir", nargs="?", default=None)
    args = parser.parse_args(argv)
    try:
        run = resolve_host_run(resolve_run_dir(args.run_dir))
    except FileNotFoundError as exc:
        print(f"pdtopo planner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return planner_cli.run(run, args.action)


def _diff(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdtopo diff")
    parser.add_argument("--rev", default=None, help="compare conf/ at this git revision")
    parser.add_argument("--format", choices=("rich", "markdown"), default="rich")
    parser.add_argument("overrides", nargs="*")
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        side_b = parser.parse_args(argv[cut + 1:])
        args.rev = args.rev or side_b.rev
        args.format = side_b.format if side_b.format != "rich" else args.format
        over_a, over_b = args.overrides, side_b.overrides
    else:
        args = parser.parse_args(argv)
        over_a = over_b = args.overrides
        if args.rev is None:
            parser.error("give two override sets separated by --, or --rev GITREV")
    err = display.console(stderr=True)
    try:
        if args.rev:
            with diff.temp_dir() as tmp:
                old_conf = diff.conf_at_rev(args.rev, conf_dir(), Path(tmp))
                cfg_a = compose_config(over_a, config_dir=old_conf)
                cfg_b = compose_config(over_b)
                label_a, label_b = f"conf@{args.rev}", "working tree"
                res = diff.diff_configs(cfg_a, cfg_b, host_cpus(), label_a, label_b)
        else:
            cfg_a, cfg_b = compose_config(over_a), compose_config(over_b)
            res = diff.diff_configs(cfg_a, cfg_b, host_cpus(), diff.label_of(over_a),
                                    diff.label_of(over_b))
    except TopologyError as exc:
        display.print_topology_error(exc, err)
        return EXIT_USAGE
    except (HydraException, OmegaConfBaseException, RuntimeError, OSError) as exc:
        err.print(f"[bold red]pdtopo diff:[/] {exc}", markup=True, soft_wrap=True)
        return EXIT_USAGE
    if args.format == "markdown":
        sys.stdout.write(diff.to_markdown(res))
    else:
        diff.print_rich(res, display.console())
    return 0 if res.identical else 1


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print("usage:\n" + USAGE)
        return 0 if args else EXIT_USAGE
    verb, rest = args[0], args[1:]
    if verb == "launch":
        return _launch(rest)
    if verb == "render":
        return _render(rest)
    if verb in ("status", "stop", "logs", "drain", "restart", "top"):
        return _run_dir_verb(verb, rest)
    if verb == "scale":
        return _scale(rest)
    if verb == "planner":
        return _planner(rest)
    if verb == "diff":
        return _diff(rest)
    if verb == "bench":
        return bench_main(rest)
    if verb == "tune":
        return tune_main(rest)
    if verb == "fetch":
        return fetch_main(rest)
    print(f"pdtopo: unknown command {verb!r}\nusage:\n{USAGE}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
