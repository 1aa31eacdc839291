"""The proxy program when the deployment has an API key: sglang-router (or, with
`--router-module smg.launch_router`, the model gateway of `proxy.kind=gateway`), with the key
kept off the command line (anyone on the host can read a process's argv; its environment only
the owner).

    python -m pdtopo.launcher.programs.router_entry [--router-module MODULE] <launch_router arguments>

The key comes from `PDTOPO_PROXY_API_KEY` (put into the program's environment by the
launcher from `proxy.api_key`, in supervisord.conf with mode 0600) or from the first line of the
file named by `PDTOPO_PROXY_API_KEY_FILE` (`proxy.api_key_file`), or, with
`PDTOPO_PROXY_API_KEY_DERIVED=1` (P/D beyond loopback and no key configured), from the
deployment token (pdtopo.config.credentials). The arguments are parsed by
the router's own parser (both packages offer `parse_router_args` and `launch_router`), the key
is set on the parsed `RouterArgs`, and the router is started in this process, unmodified.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

from pdtopo.config import credentials
from pdtopo.config.credentials import API_KEY_ENV, API_KEY_FILE_ENV
from pdtopo.config.run_files import TOKEN_ENV

DEFAULT_ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_MODULES = (DEFAULT_ROUTER_MODULE, "smg.launch_router")


def read_api_key(environ: Mapping[str, str] = os.environ) -> str:
    """The key from the environment, the key file or the deployment token; SystemExit naming
    what is wrong."""
    try:
        key = credentials.read_api_key(environ, environ.get(TOKEN_ENV))
    except ValueError as exc:
        raise SystemExit(f"router_entry: {exc}") from None
    if not key:
        raise SystemExit(f"router_entry: set {API_KEY_ENV} or {API_KEY_FILE_ENV} "
                         "(proxy.api_key / proxy.api_key_file)")
    return key


def split_router_module(argv: list[str]) -> tuple[str, list[str]]:
    """(router module, the router's own arguments) from this program's arguments."""
    if argv[:1] != ["--router-module"]:
        return DEFAULT_ROUTER_MODULE, argv
    if len(argv) < 2 or argv[1] not in ROUTER_MODULES:
        raise SystemExit(f"router_entry: --router-module takes one of {', '.join(ROUTER_MODULES)}"
                         f", got {argv[1] if len(argv) > 1 else 'nothing'}")
    return argv[1], argv[2:]


def main(argv: list[str] | None = None) -> None:
    module_name, router_argv = split_router_module(sys.argv[1:] if argv is None else argv)
    router = importlib.import_module(module_name)
    args = router.parse_router_args(router_argv)
    args.api_key = read_api_key()
    router.launch_router(args)


if __name__ == "__main__":
    main()
