"""What a run dir's supervisord.conf holds that plan.json does not: the programs' working
directory and the proxy's secret environment (its API key lives only there, mode 0600), and
the key clients send the proxy, wherever it comes from.

Read with configparser and supervisor's own `environment=` parser, so what comes back is what
supervisord gives the programs.
"""

from __future__ import annotations

import configparser
from pathlib import Path

from supervisor.datatypes import dict_of_key_value_pairs

from pdtopo.config.credentials import API_KEY_ENV
from pdtopo.config.run_files import API_KEY_FILE, CONF_FILE
from pdtopo.config.schema import ProxySchema


def _conf(run_dir: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(interpolation=None)
    parser.read(run_dir / CONF_FILE)
    return parser


def _value(parser: configparser.RawConfigParser, section: str, key: str) -> str | None:
    if not parser.has_option(section, key):
        return None
    return parser.get(section, key).replace("%%", "%")


def program_environment(run_dir: Path, program: str) -> dict[str, str]:
    raw = _value(_conf(run_dir), f"program:{program}", "environment")
    return dict_of_key_value_pairs(raw) if raw else {}


def workdir(run_dir: Path) -> Path | None:
    raw = _value(_conf(run_dir), "supervisord", "directory")
    return Path(raw) if raw else None


def proxy_api_key(run_dir: Path, proxy: ProxySchema) -> str | None:
    """The key clients (and admin calls) must send to the proxy, or None when it has none
    (the derived key: RUN/api_key, or the multi-host run's RUN/hosts/*/api_key)."""
    derived = [run_dir / API_KEY_FILE, *sorted(run_dir.glob(f"hosts/*/{API_KEY_FILE}"))]
    for path in derived:
        if path.is_file():
            return path.read_text().strip() or None
    if proxy.api_key_file:
        try:
            lines = Path(str(proxy.api_key_file)).expanduser().read_text().splitlines()
        except OSError:
            return None
        return lines[0].strip() if lines and lines[0].strip() else None
    if proxy.api_key:
        return program_environment(run_dir, "proxy").get(API_KEY_ENV) or None
    return None
