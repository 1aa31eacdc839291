"""`pdtopo bench [URL] [--output FILE] [--run-dir RUN] [--api-key-file F] [overrides]`.

Composes the config with the given Hydra overrides (e.g. `bench.request_rate=4`), benchmarks
URL (default: the latest run's proxy, or its server for a colocated run), prints the one-screen
table and writes the metrics JSON to `--output` (or `bench.output`). Exit 0 when every request
succeeded, 1 when some failed, 2 on bad input. A proxy with an API key gets it as
`Authorization: Bearer`: the benched run's key (pdtopo.config.run_conf), or `--api-key-file`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from pdtopo.bench.report import metrics_table, write_json
from pdtopo.bench.run import default_url, run_bench
from pdtopo.bench.settings import BenchSettings
from pdtopo.config.compose import compose_config
from pdtopo.config.run_conf import proxy_api_key
from pdtopo.config.run_files import CONFIG_FILE, resolve_run_dir
from pdtopo.config.schema import ProxySchema, typed_proxy


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdtopo bench")
    parser.add_argument("--output", "-o", default=None, help="write the metrics JSON here")
    parser.add_argument("--run-dir", default=None, help="bench this run (default: latest)")
    parser.add_argument("--api-key-file", default=None,
                        help="file whose first line is the proxy's API key (default: the "
                             "run's key, when benching a run)")
    parser.add_argument("args", nargs="*", help="[URL] and Hydra overrides (bench.KEY=VALUE)")
    args = parser.parse_intermixed_args(argv)  # URL --output F bench.k=v, in any order
    urls = [a for a in args.args if a.startswith(("http://", "https://"))]
    overrides = [a for a in args.args if a not in urls]
    err = Console(stderr=True, highlight=False)
    if len(urls) > 1:
        err.print(f"[bold red]pdtopo bench:[/] give at most one URL, got {urls}")
        return 2
    try:
        cfg = compose_config(overrides)
        settings = BenchSettings.from_config(cfg.get("bench"))
        run_dir = None if urls else resolve_run_dir(args.run_dir)
        url = urls[0] if urls else default_url(run_dir)
        api_key = bench_api_key(args.api_key_file, run_dir)
    except (FileNotFoundError, ValueError, HydraException, OmegaConfBaseException) as exc:
        err.print(f"[bold red]pdtopo bench:[/] {exc}", soft_wrap=True)
        return 2
    con = Console(highlight=False)
    con.print(f"benchmarking {url}: {settings.num_workload_requests} requests "
              f"({settings.workload}) at "
              f"{settings.request_rate} req/s ({settings.arrival}), "
              f"concurrency <= {settings.max_concurrency}")
    metrics = run_bench(url, settings, api_key=api_key)
    con.print(metrics_table(metrics))
    output = args.output or settings.output
    if output:
        con.print(f"metrics written to {write_json(metrics, output)}")
    return 0 if metrics["stats"]["requests"]["failed"] == 0 else 1


def bench_api_key(key_file: str | None, run_dir: Path | None) -> str | None:
    """The key to send: `--api-key-file`'s first line, else the benched run's proxy key."""
    if key_file:
        try:
            lines = Path(key_file).expanduser().read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {key_file}: {exc.strerror or exc}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--api-key-file {key_file} is empty")
        return lines[0].strip()
    if run_dir is None:
        return None
    return proxy_api_key(run_dir, typed_proxy(OmegaConf.load(run_dir / CONFIG_FILE))) \
        if (run_dir / CONFIG_FILE).is_file() else proxy_api_key(run_dir, ProxySchema())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
